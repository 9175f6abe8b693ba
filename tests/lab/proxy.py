"""The fault proxy of a link (``proxy.c``): built once per source version, run in the link's source host, driven
over its control socket.

A link ``src -> dst`` routed through a proxy: an nftables rule in ``src``'s namespace redirects the TCP connections
``src`` opens to ``dst`` to the proxy, which relays them to where they were going. So only that link is shaped:
other hosts still reach ``dst`` directly, and ``dst``'s own connections to ``src`` are another link. Per direction
(``up``: the requests, src -> dst; ``down``: the answers) it delays, jitters, loses (a stall of one retransmission
timeout, as TCP makes of a lost segment) or blackholes, and it can reset every connection.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
from typing import Any, Optional

from tests.lab.cbuild import compiled

SOURCE = pathlib.Path(__file__).with_name("proxy.c")
DIRECTIONS = ("up", "down", "both")


def binary() -> pathlib.Path:
    """The compiled proxy (built with the C compiler on first use, kept per source hash in the temp dir)."""
    return compiled(SOURCE, "shardps-lab-proxy", "the lab's proxy")


class Proxy:
    """The proxy of one link, as the lab started it (``Lab.link``). Settings hold until changed; ``heal`` clears
    every fault and keeps the routing."""

    def __init__(self, src: str, dst: str, control: str, port: int, popen: subprocess.Popen) -> None:
        self.src, self.dst, self.control, self.port, self.popen = src, dst, control, port, popen

    def _send(self, *lines: str) -> list[str]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.control)
            s.sendall("".join(line + "\n" for line in lines).encode())
            s.shutdown(socket.SHUT_WR)
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        answers = data.decode().splitlines()
        for line, answer in zip(lines, answers):
            if answer.startswith("err"):
                raise ValueError(f"proxy {self.src}->{self.dst}: {line!r}: {answer[4:]}")
        if len(answers) < len(lines):
            raise RuntimeError(f"proxy {self.src}->{self.dst} did not answer {lines!r} (exited: "
                               f"{self.popen.poll()})")
        return answers

    def set(self, direction: str = "both", *, delay_ms: Optional[float] = None, jitter_ms: Optional[float] = None,
            loss: Optional[float] = None, rto_ms: Optional[float] = None,
            blackhole: Optional[bool] = None) -> None:
        """Change a direction's settings (the others stay as they are)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        parts = []
        if delay_ms is not None:
            parts.append(f"delay_us={delay_ms * 1000:g}")
        if jitter_ms is not None:
            parts.append(f"jitter_us={jitter_ms * 1000:g}")
        if loss is not None:
            if not 0 <= loss <= 1:
                raise ValueError(f"loss is a probability, got {loss}")
            parts.append(f"loss={loss:g}")
        if rto_ms is not None:
            parts.append(f"rto_ms={rto_ms:g}")
        if blackhole is not None:
            parts.append(f"blackhole={int(blackhole)}")
        self._send(f"set {direction} " + " ".join(parts))

    def delay(self, ms: float, jitter_ms: float = 0.0, direction: str = "both") -> None:
        self.set(direction, delay_ms=ms, jitter_ms=jitter_ms)

    def loss(self, p: float, direction: str = "both", rto_ms: float = 200.0) -> None:
        self.set(direction, loss=p, rto_ms=rto_ms)

    def blackhole(self, direction: str = "both") -> None:
        self.set(direction, blackhole=True)

    def heal(self) -> None:
        """No delay, jitter, loss or blackhole in either direction (what a blackhole held is delivered)."""
        self.set("both", delay_ms=0, jitter_ms=0, loss=0, blackhole=False)

    def reset(self) -> None:
        """Close every connection through the proxy with an RST at both ends."""
        self._send("reset")

    def stats(self) -> dict[str, Any]:
        """{"conns", "accepted", "resets", "bytes_up", "bytes_down", "lost_up", "lost_down"}."""
        return json.loads(self._send("stats")[0])
