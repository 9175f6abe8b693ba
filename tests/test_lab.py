"""The lab's own tests: a partition cuts exactly the links it names and heal() restores them, one-way drops are
one-way, a rate cap holds, the proxy delays, loses, blackholes and resets only the link routed through it, clocks
and disks fail as documented, and nothing is left behind by a lab whose owner fails, is interrupted or is killed.

Every timing assertion is a lower bound (a delay or a cap makes things at least this slow; a busy machine only
makes them slower), never a rate or an upper bound on speed. Skips where no lab can be made (not root), saying
why; ``SHARDPS_REQUIRE_LAB=1`` (set by ``.ci/run``) turns that into a failure."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.lab import Clock, Lab, leftovers, why_unavailable
from tests.lab.netns import NETNS_DIR

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT = str(ROOT / "tests" / "lab" / "agent.py")


def require_lab() -> None:
    """Skip (or, under SHARDPS_REQUIRE_LAB=1, fail) where no lab can be made, saying why."""
    reason = why_unavailable()
    if reason:
        (pytest.fail if os.environ.get("SHARDPS_REQUIRE_LAB") == "1" else pytest.skip)(
            f"no lab here: {reason}")


@pytest.fixture
def lab():
    require_lab()
    with Lab(["a", "b", "c", "d"]) as lab:
        yield lab


def _agents(lab: Lab) -> dict[str, tuple[int, int, pathlib.Path]]:
    """An agent on every host: {host: (tcp port, udp port, file of datagrams received)}."""
    procs = {n: (lab.spawn(n, [sys.executable, AGENT, "serve", str(lab.dir / f"udp-{n}")]), lab.dir / f"udp-{n}")
             for n in lab.hosts}
    out = {}
    deadline = time.monotonic() + 20
    for n, (p, f) in procs.items():
        while not (m := re.search(r"PORTS (\d+) (\d+)", p.log())):
            assert p.alive() and time.monotonic() < deadline, p.log()
            time.sleep(0.02)
        out[n] = (int(m.group(1)), int(m.group(2)), f)
    return out


def _reach(lab: Lab, agents: dict, timeout: float = 0.6) -> dict[tuple[str, str], bool]:
    """Which host reaches which (a TCP echo), every pair."""
    out = {}
    for src in lab.hosts:
        targets = {f"{lab.address(d)}:{agents[d][0]}": d for d in lab.hosts if d != src}
        r = json.loads(lab.run(src, [sys.executable, AGENT, "reach", str(timeout), *targets]).stdout)
        out.update({(src, targets[t]): ok for t, ok in r.items()})
    return out


def _expect(lab: Lab, cut: set[tuple[str, str]]) -> dict[tuple[str, str], bool]:
    return {(s, d): (s, d) not in cut for s in lab.hosts for d in lab.hosts if s != d}


def test_partition_cuts_only_the_named_links_and_heal_restores_them(lab):
    agents = _agents(lab)
    assert _reach(lab, agents) == _expect(lab, set())
    lab.partition(["a", "b"], ["c"])  # d in no group: keeps every link
    both = {("a", "c"), ("c", "a"), ("b", "c"), ("c", "b")}
    assert _reach(lab, agents) == _expect(lab, both)
    lab.isolate("d")
    alone = {(x, "d") for x in "abc"} | {("d", x) for x in "abc"}
    assert _reach(lab, agents) == _expect(lab, alone)  # replaced the partition
    lab.bridge(["a"], "b", ["c"])
    assert _reach(lab, agents) == _expect(lab, {("a", "c"), ("c", "a")})
    lab.heal()
    assert _reach(lab, agents) == _expect(lab, set())
    # the rules live in the hosts' namespaces only
    assert "shardps_lab" not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def test_one_way_drop_is_one_way(lab):
    agents = _agents(lab)
    lab.drop("a", "b")  # a's packets to b are lost; b's to a arrive

    def send(src: str, dst: str, payload: str) -> None:
        lab.run(src, [sys.executable, AGENT, "udp", f"{lab.address(dst)}:{agents[dst][1]}", payload])

    send("b", "a", "b-to-a")
    send("a", "b", "a-to-b")
    send("c", "b", "c-to-b")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got_a = agents["a"][2].read_text() if agents["a"][2].exists() else ""
        got_b = agents["b"][2].read_text() if agents["b"][2].exists() else ""
        if "b-to-a" in got_a and "c-to-b" in got_b:
            break
        time.sleep(0.05)
    assert "b-to-a" in got_a and "c-to-b" in got_b
    time.sleep(0.2)  # a-to-b was sent before c-to-b arrived: had it passed, it would be here by now
    assert "a-to-b" not in agents["b"][2].read_text()
    lab.heal()
    send("a", "b", "a-to-b-healed")
    deadline = time.monotonic() + 10
    while "a-to-b-healed" not in agents["b"][2].read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "a-to-b-healed" in agents["b"][2].read_text()


def test_rate_cap_holds_and_goes(lab):
    agents = _agents(lab)
    lab.rate("b", 40)  # 40 Mbit/s each way on b's link
    size = 4 << 20
    r = json.loads(lab.run("a", [sys.executable, AGENT, "send", f"{lab.address('b')}:{agents['b'][0]}",
                                 str(size)], timeout=60).stdout)
    assert r["bytes"] == size
    floor = (size * 8 - 256 * 1024 * 8) / 40e6  # the bucket's burst may pass at once; the rest at the rate
    assert r["seconds"] >= 0.9 * floor, r  # a cap makes it at least this slow (a busy machine only slower)
    assert "tbf" in lab.run("b", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    lab.rate("b", None)
    assert "tbf" not in lab.run("b", ["tc", "qdisc", "show", "dev", "eth0"]).stdout


def _echo(lab: Lab, src: str, dst: str, agents: dict, timeout: float = 5.0) -> dict:
    return json.loads(lab.run(src, [sys.executable, AGENT, "echo", f"{lab.address(dst)}:{agents[dst][0]}",
                                    str(timeout)]).stdout)


def test_proxy_delays_loses_blackholes_and_resets_only_its_link(lab):
    agents = _agents(lab)
    proxy = lab.link("a", "b")
    assert "seconds" in _echo(lab, "a", "b", agents)
    assert proxy.stats()["accepted"] == 1
    _echo(lab, "c", "b", agents)  # another host's link to b does not go through it
    assert proxy.stats()["accepted"] == 1

    proxy.delay(150)  # each way: an echo's round trip takes at least 300 ms
    assert _echo(lab, "a", "b", agents)["seconds"] >= 0.3
    proxy.set("up", delay_ms=0)
    assert _echo(lab, "a", "b", agents)["seconds"] >= 0.15
    proxy.heal()

    proxy.loss(1.0, direction="down", rto_ms=400)  # every answer chunk stalls one RTO
    assert _echo(lab, "a", "b", agents)["seconds"] >= 0.4
    assert proxy.stats()["lost_down"] >= 1
    proxy.heal()

    proxy.blackhole("down")  # the request arrives, the answer never comes back
    r = _echo(lab, "a", "b", agents, timeout=0.5)
    assert "timed out" in r.get("error", ""), r
    proxy.heal()

    # a connection held open through the proxy: reset() ends it with an RST
    script = textwrap.dedent(f"""
        import socket, sys, time
        c = socket.create_connection(("{lab.address('b')}", {agents['b'][0]}), timeout=10)
        c.sendall(b"x"); c.recv(1)
        print("connected", flush=True)
        try:
            c.recv(1)
            print("closed")
        except OSError as e:
            print("error", e.errno)
    """)
    p = lab.spawn("a", [sys.executable, "-c", script])
    deadline = time.monotonic() + 10
    while "connected" not in p.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    proxy.reset()
    p.popen.wait(10)
    assert f"error {errno.ECONNRESET}" in p.log(), p.log()


def test_clock_jumps_and_runs_fast_for_one_process_only(lab):
    script = textwrap.dedent("""
        import threading, time
        print("START", time.time(), flush=True)
        while True:  # a timed wait on a threading primitive, as every shard thread makes (libfaketime hung them)
            threading.Event().wait(0.1)
            time.sleep(0.01)
            print("NOW", time.time(), time.monotonic(), flush=True)
    """)
    clock = Clock(offset_s=3600)
    p = lab.spawn("a", [sys.executable, "-c", script], clock=clock)
    deadline = time.monotonic() + 10
    while "NOW" not in p.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    first = float(re.search(r"START (\S+)", p.log()).group(1))
    assert 3590 < first - time.time() < 3610
    clock.jump(-7200)  # now an hour behind
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        last = re.findall(r"NOW (\S+) (\S+)", p.log())[-1]
        if float(last[0]) < time.time():
            break
        time.sleep(0.1)
    assert -3610 < float(last[0]) - time.time() < -3590
    p.stop(signal.SIGKILL)
    assert abs(time.time() - float(subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                                                  capture_output=True, text=True).stdout) < 5)

    fast = lab.spawn("a", [sys.executable, "-c", "import time; a=time.monotonic()\nwhile time.monotonic()-a<2: pass\n"
                                                 "print('DONE', flush=True)"], clock=Clock(rate=2.0))
    t = time.monotonic()
    fast.popen.wait(30)
    assert "DONE" in fast.log()
    assert time.monotonic() - t < 1.9  # 2 s of its clock passed in under 2 s of ours (its clock runs fast)


def test_disks_fill_block_fail_and_fsyncs_fail(lab):
    full = lab.disk("a", size_mb=8, kind="tmpfs")
    full.fill()
    with pytest.raises(OSError) as e:
        with open(full.path / "x", "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
    assert e.value.errno == errno.ENOSPC
    full.unfill()
    (full.path / "x").write_bytes(b"ok")

    disk = lab.disk("a", size_mb=32)
    done = threading.Event()

    def write() -> None:
        fd = os.open(disk.path / "y", os.O_WRONLY | os.O_CREAT)
        os.write(fd, b"y" * 4096)
        os.fsync(fd)
        os.close(fd)
        done.set()

    disk.freeze()
    t = threading.Thread(target=write)
    t.start()
    assert not done.wait(0.5)  # blocked while frozen
    disk.thaw()
    assert done.wait(10)
    t.join()
    disk.fail()
    with pytest.raises(OSError) as e:
        (disk.path / "z").write_bytes(b"z")
    assert e.value.errno == errno.EIO

    script = textwrap.dedent(f"""
        import os, sys, time
        fd = os.open("{lab.dir}/fiu-file", os.O_WRONLY | os.O_CREAT)
        print("READY", flush=True)
        while not os.path.exists("{lab.dir}/go"):
            time.sleep(0.02)
        os.write(fd, b"w")
        print("WROTE", flush=True)
        try:
            os.fsync(fd)
            print("FSYNC OK", flush=True)
        except OSError as e:
            print("FSYNC", e.errno, flush=True)
    """)
    p = lab.spawn("a", [sys.executable, "-c", script], failpoints=True)
    deadline = time.monotonic() + 10
    while "READY" not in p.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    p.failpoints.fsync_errors()
    (lab.dir / "go").touch()
    p.popen.wait(10)
    assert "WROTE" in p.log() and f"FSYNC {errno.EIO}" in p.log(), p.log()


_OWNER = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    sys.path.insert(0, {root!r})
    faulthandler.register(signal.SIGUSR1)  # where it is, should it not end (the test asks before it fails)
    # Ctrl-C as in a terminal: a process started with SIGINT ignored (as an xdist worker's children can be, after
    # some library set it so there) keeps it ignored, and the owner slept on through the test's SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from tests.lab import Lab
    lab = Lab(["a", "b"]).start()
    print("LAB", lab.id, flush=True)
    with lab:
        p = lab.spawn("a", [sys.executable, "-c", "import time; time.sleep(600)"])
        print("PID", p.pid, flush=True)
        lab.link("a", "b").delay(1)
        lab.partition(["a"], ["b"])
        lab.rate("b", 100)
        print("DISK", lab.disk("b", size_mb=16).path, flush=True)
        print("READY", flush=True)
        if {how!r} == "raise":
            raise RuntimeError("failing on purpose")
        time.sleep(600)
""")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["raise", "sigint", "sigterm", "sigkill"])
def test_nothing_is_left_behind(how, tmp_path):
    require_lab()
    out = tmp_path / "out"
    with open(out, "w") as f:
        owner = subprocess.Popen([sys.executable, "-c", _OWNER.format(root=str(ROOT), how=how)], stdout=f,
                                 stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 60
    while "READY" not in out.read_text() and owner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    text = out.read_text()
    assert "READY" in text or how == "raise", text
    lab_id = re.search(r"LAB (\S+)", text).group(1)
    pid = int(re.search(r"PID (\d+)", text).group(1))
    disk = re.search(r"DISK (\S+)", text).group(1)
    if how != "raise":  # all there before the owner goes
        assert [n for n in os.listdir(NETNS_DIR) if n.startswith(lab_id)]
        assert os.path.exists(f"/proc/{pid}") and disk in pathlib.Path("/proc/self/mounts").read_text()
        owner.send_signal({"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how])
    try:
        owner.wait(120)
    except subprocess.TimeoutExpired:
        owner.send_signal(signal.SIGUSR1)
        time.sleep(1)
        owner.kill()
        owner.wait(10)
        pytest.fail(f"the lab's owner did not end within 120 s of {how}; its output and stacks:\n{out.read_text()}")
    if how == "raise":
        assert "failing on purpose" in out.read_text()
    if how == "sigkill":  # nobody cleaned up: the next lab's sweep does
        assert any(n.startswith(lab_id) for n in os.listdir(NETNS_DIR))
        from tests.lab import sweep

        sweep()
    assert not [n for n in os.listdir(NETNS_DIR) if n.startswith(lab_id)]
    assert not os.path.exists(f"/proc/{pid}") or _zombie_or_gone(pid)
    assert disk not in pathlib.Path("/proc/self/mounts").read_text()
    assert not pathlib.Path(disk).parent.exists()
    found = leftovers(everything=True)
    assert not [x for kind in found.values() for x in kind if lab_id in x], found


def test_a_sweep_beside_another_process_s_capability_probe():
    """One pytest worker's lab sweeps while another worker's ``why_unavailable`` holds its probe namespace for a
    moment: the sweep leaves a live process's probe alone (it once failed on the name) and removes a dead one's."""
    require_lab()
    from tests.lab import sweep
    from tests.lab.netns import PREFIX

    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"{PREFIX}probe-{live.pid}", f"{PREFIX}probe-{dead.pid}"]
    try:
        for n in names:
            subprocess.run(["ip", "netns", "add", n], check=True, capture_output=True)
        sweep()
        left = os.listdir(NETNS_DIR)
        assert names[0] in left and names[1] not in left, left
    finally:
        live.kill()
        live.wait()
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _zombie_or_gone(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
