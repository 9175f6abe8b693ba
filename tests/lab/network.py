"""Network faults inside the lab's namespaces: nftables cuts (partitions, one-way drops), the redirect that routes
a link through its proxy, and tbf rate caps.

Every rule lives in the hosts' own namespaces, in tables of the lab's name (``shardps_lab`` for cuts,
``shardps_lab_proxy`` for redirects), never in the machine's own tables (Docker keeps its rules there). A cut drops
packets on the receiving host's input hook only: the sender sees silence, as from a dead switch port (a drop on its
own output hook would fail its sends with EPERM at once, which no real network does).
"""

from __future__ import annotations

from typing import Mapping

from tests.lab.netns import in_ns

CUT_TABLE = "shardps_lab"
PROXY_TABLE = "shardps_lab_proxy"


def set_grudges(netns: str, drop_from: list[str]) -> None:
    """Make host ``netns`` drop every packet arriving from the addresses ``drop_from`` (none: heal it). Replaces
    whatever cut it had, in one nft transaction."""
    rules = [f"table inet {CUT_TABLE} {{}}", f"delete table inet {CUT_TABLE}",
             f"table inet {CUT_TABLE} {{",
             "  chain input { type filter hook input priority -10; policy accept;"]
    if drop_from:
        rules.append(f"    ip saddr {{ {', '.join(sorted(drop_from))} }} drop")
    rules += ["  }", "}"]
    in_ns(netns, "nft", "-f", "-", input="\n".join(rules) + "\n")


def grudges_of(groups: list[list[str]], hosts: list[str]) -> dict[str, set[str]]:
    """A complete partition: each host of a group hears no host of another group; hosts in no group keep every
    link (the control host, say)."""
    where = {h: i for i, g in enumerate(groups) for h in g}
    out: dict[str, set[str]] = {h: set() for h in hosts}
    for h in hosts:
        if h not in where:
            continue
        out[h] = {o for o in hosts if o in where and where[o] != where[h]}
    return out


def set_redirect(netns: str, links: Mapping[str, tuple[int, int, str]]) -> None:
    """Route the connections host ``netns`` opens to each destination address through that link's proxy:
    ``links``: {destination address: (proxy port, mark, tcp ports clause or "")}. The proxy's own connections carry
    the mark and pass."""
    rules = [f"table ip {PROXY_TABLE} {{}}", f"delete table ip {PROXY_TABLE}", f"table ip {PROXY_TABLE} {{",
             "  chain output { type nat hook output priority -100; policy accept;"]
    for dst, (port, mark, dports) in sorted(links.items()):
        match = f"tcp dport {dports} " if dports else "meta l4proto tcp "
        rules.append(f"    meta mark != {mark} ip daddr {dst} {match}redirect to :{port}")
    rules += ["  }", "}"]
    in_ns(netns, "nft", "-f", "-", input="\n".join(rules) + "\n")


def set_rate(netns: str, dev: str, mbit: float | None) -> None:
    """Cap ``dev``'s egress in ``netns`` at ``mbit`` Mbit/s with tbf (None: remove the cap). The bucket holds 4 ms
    of the rate (at least 64 KiB, one GSO segment), so the cap holds over any window longer than that."""
    if mbit is None:
        in_ns(netns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        return
    burst = max(65536 + 1514, int(mbit * 1e6 / 8 * 0.004))
    in_ns(netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
          "burst", str(burst), "latency", "50ms")
