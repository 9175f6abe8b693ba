"""The Compose deployment, run for real: images built offline, 4 shards and the trainer in containers.

Builds the base image from a Debian root filesystem when ``python:3.11-slim`` cannot be pulled, fills
the wheelhouse and builds both images with ``PIP_SOURCE=wheelhouse`` (no network inside the builds),
``up``s docker/compose.yaml as it is (4 shards with write-ahead-log durability and the trainer), and
checks, against the shards reached from this host over the project's own Compose network:

- every shard stays healthy while the trainer runs on the same cores (probe latencies are printed);
- a shard SIGKILLed mid-training is brought back by its restart policy from its volume, training
  finishes with the AUC range of the DLRM example's own test, and a canary counter pushed through
  the crash holds exactly the pushes that were acknowledged;
- each shard's Prometheus metrics, scraped at :9100, count the training's pushes;
- ``stop`` then ``start``: SIGTERM writes the final checkpoint and every shard comes back with the
  same version, rows and dense tensors.

Runs in CI (``.ci/run`` installs docker.io, docker-compose, mmdebstrap and debootstrap) and by ``make docker-test``.
Skips, printing why, where no engine can be used or started (``SHARDPS_DOCKER_TEST=require`` turns
that into a failure; ``=0`` skips it). Everything it starts (containers, networks, volumes, and the
engine when it started one) is removed at the end.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest
import torch
from shardps_client import SGD, TLS, AuthenticationError, Client, PermissionDeniedError, ShardUnavailableError

from shardps.core.specs import Initializer
from tests.docker_engine import Unavailable, compose_command, engine
from tests.test_metrics import scrape, value

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
MODE = os.environ.get("SHARDPS_DOCKER_TEST", "auto")
SHARDS = 4
# The DLRM example's own test sizes (tests/test_examples.py), so the same AUC range applies; its local baseline on
# one thread, as there (2 threads on 2 cores shared with 4 shards and the suite wait on each other).
TRAIN = {"SHARDPS_ROWS": "200000", "SHARDPS_TRAIN": "160000", "SHARDPS_TEST": "30000", "SHARDPS_LOCAL_THREADS": "1"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(MODE == "0", reason="SHARDPS_DOCKER_TEST=0")]


def _skip_or_fail(reason: str) -> None:
    if MODE == "require":
        pytest.fail(f"SHARDPS_DOCKER_TEST=require, but: {reason}")
    pytest.skip(reason)


def _run(cmd: list[str], env: dict[str, str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _docker(env: dict[str, str], *args: str, timeout: float = 60, check: bool = True) -> str:
    return _run(["docker", *args], env, timeout, check).stdout.strip()


@pytest.fixture(scope="module")
def docker_env(tmp_path_factory):
    try:
        with engine(tmp_path_factory.mktemp("docker")) as env:
            yield env
    except Unavailable as e:
        _skip_or_fail(f"no Docker engine: {e}")


def _base_image(env: dict[str, str]) -> str:
    """python:3.11-slim where it is here or can be pulled; else shardps-base:bookworm, built by
    docker/make_base.sh from a Debian root filesystem (reused when the engine already has it)."""
    if os.environ.get("SHARDPS_BASE_IMAGE"):
        return os.environ["SHARDPS_BASE_IMAGE"]
    for image in ("python:3.11-slim", "shardps-base:bookworm"):
        if _run(["docker", "image", "inspect", image], env, 30, check=False).returncode == 0:
            return image
    if _run(["docker", "pull", "python:3.11-slim"], env, 300, check=False).returncode == 0:
        return "python:3.11-slim"
    if not (shutil.which("mmdebstrap") or shutil.which("debootstrap") or os.path.exists("/usr/sbin/debootstrap")):
        _skip_or_fail("python:3.11-slim cannot be pulled and neither mmdebstrap nor debootstrap is installed "
                      "(apt-get install mmdebstrap)")
    _run(["sh", str(DOCKER / "make_base.sh"), "shardps-base:bookworm"], env, 600)
    return "shardps-base:bookworm"


class Deployment:
    """docker/compose.yaml under one project name, driven through the real Compose CLI."""

    def __init__(self, env: dict[str, str], base: str) -> None:
        self.project = f"shardpstest{uuid.uuid4().hex[:8]}"
        self.env = {**env, "SHARDPS_BASE_IMAGE": base, "SHARDPS_PIP_SOURCE": "wheelhouse", **TRAIN}
        self.compose = [*compose_command(env), "-p", self.project, "-f", str(DOCKER / "compose.yaml")]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return _run([*self.compose, *args], self.env, timeout, check, cwd=ROOT).stdout

    def with_tls(self, secrets: pathlib.Path) -> None:
        """From now on, with docker/compose.tls.yaml over the file (mutual TLS and tokens)."""
        self.compose += ["-f", str(DOCKER / "compose.tls.yaml")]
        self.env["SHARDPS_SECRETS"] = str(secrets)

    def container(self, service: str) -> str:
        """The service's container, found by the labels Compose (v1 and v2) puts on it, through the docker CLI:
        ``docker-compose ps`` is a Python program that costs 0.5-0.9 s of CPU a call, and the wait loops below
        ask several times a second (hundreds of calls a run, on the cores the suite shares)."""
        out = _docker(self.env, "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}",
                      "--filter", f"label=com.docker.compose.service={service}")
        ids = out.split()
        assert len(ids) <= 1, f"{service}: containers {ids}"
        return ids[0] if ids else ""

    def inspect(self, service: str) -> dict:
        return json.loads(_docker(self.env, "inspect", self.container(service)))[0]

    def address(self, service: str) -> str:
        nets = self.inspect(service)["NetworkSettings"]["Networks"]
        return f"{next(iter(nets.values()))['IPAddress']}:7000"

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return state["Health"]["Status"] if state.get("Health") else state["Status"]

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = {s: self.health(s) for s in services}
            if all(v == "healthy" for v in states.values()):
                return
            if time.monotonic() > deadline:
                logs = {s: _run(["docker", "logs", "--tail", "15", self.container(s)], self.env, 60, check=False)
                        for s in services if states[s] != "healthy"}
                health = {s: self.inspect(s)["State"].get("Health", {}).get("Log", [])[-1:] for s in logs}
                raise AssertionError(f"not healthy after {timeout:.0f}s: {states}\n" + "\n".join(
                    f"--- {s}: {health[s]}\n{r.stdout}{r.stderr}" for s, r in logs.items()))
            time.sleep(1)

    def down(self) -> None:
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "30", timeout=300, check=False)


def _snapshot(client: Client, rows: int) -> dict[str, torch.Tensor]:
    """Every table's first ``rows`` rows and every dense tensor, pulled from the shards."""
    out: dict[str, torch.Tensor] = {}
    for t in client.shard_info()[0].tables:
        if t.HasField("dense"):
            out[t.dense.name] = client.pull_dense(t.dense.name)[0].clone()
        else:
            out[t.spec.name] = client.pull(t.spec.name, torch.arange(min(rows, t.spec.num_embeddings or rows))).clone()
    return out


def _auc(logs: str, label: str) -> float:
    """The test AUC on ``label``'s line of the trainer's closing table (not its progress lines)."""
    m = re.search(rf"{re.escape(label)}[^\n\[]*?\s(\d\.\d{{4}})\s+(?:[\d,]+|-)\s*$", logs, re.M)
    assert m, f"no {label!r} line in the trainer's output:\n{logs[-3000:]}"
    return float(m.group(1))


@pytest.mark.timeout(1500)
def test_compose_deployment_trains_survives_a_crash_and_restarts_with_its_state(docker_env, record_property):
    t_start = time.monotonic()
    env = docker_env
    # The wheelhouse fills (pip, mostly waiting on the registry) while the base image is built (mmdebstrap).
    # (Its output goes to a file: a pipe nobody reads until the base is built could fill and stall it.)
    wheels_log = tempfile.TemporaryFile("w+")
    wheels = subprocess.Popen(["sh", str(DOCKER / "wheelhouse.sh")], env={**env, "PYTHON": sys.executable},
                              stdout=wheels_log, stderr=subprocess.STDOUT, text=True)
    try:
        base = _base_image(env)
        t_base = time.monotonic()
        wheels.wait(timeout=600)
        wheels_log.seek(0)
        assert wheels.returncode == 0, f"docker/wheelhouse.sh exited {wheels.returncode}:\n{wheels_log.read()[-3000:]}"
        dep = Deployment(env, base)
    except Unavailable as e:
        _skip_or_fail(str(e))
    finally:
        if wheels.poll() is None:
            wheels.kill()
            wheels.wait()
        wheels_log.close()
    shards = [f"shard-{i}" for i in range(SHARDS)]
    report: dict[str, object] = {"base_image": base, "base_s": round(t_base - t_start, 1),
                                 "base_and_wheelhouse_s": round(time.monotonic() - t_start, 1)}
    try:
        t0 = time.monotonic()
        # The two images side by side; the shards share shard-0's (each service would send the context again).
        dep.run("build", "--parallel", "shard-0", "trainer", timeout=900)
        report["build_s"] = round(time.monotonic() - t0, 1)
        for image in ("shardps-server:latest", "shardps-trainer:latest"):
            report[f"{image} MB"] = round(int(_docker(env, "image", "inspect", "-f", "{{.Size}}", image)) / 1e6)

        # The shards first: the canary table is planted before the trainer starts.
        t0 = time.monotonic()
        dep.run("up", "-d", *shards, timeout=300)
        dep.wait_healthy(shards, timeout=120)
        report["healthy_s"] = round(time.monotonic() - t0, 1)
        addresses = [dep.address(s) for s in shards]
        canary_ids = torch.arange(64)  # rows on every shard
        with Client(addresses) as c:
            c.create_table("canary", dim=2, num_embeddings=64, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))

        dep.run("up", "-d", "trainer", timeout=300)
        probes: dict[str, dict[str, float]] = {s: {} for s in shards}
        unhealthy: list[tuple[str, str]] = []

        def watch_health() -> None:
            for s in shards:
                state = dep.inspect(s)["State"]
                for entry in state["Health"]["Log"]:
                    start, end = (_docker_time(entry[k]) for k in ("Start", "End"))
                    probes[s][entry["Start"]] = end - start
                if state["Health"]["Status"] == "unhealthy":
                    unhealthy.append((s, state["Health"]["Log"][-1]["Output"][-300:]))

        # Wait until the trainer is pushing, then crash shard-1 while a canary pusher runs through it.
        with Client(addresses) as c:
            deadline = time.monotonic() + 300
            while c.shard_info()[1].stats.rows_pushed < 50_000:
                assert dep.health("trainer") == "running", dep.run("logs", "trainer")[-3000:]
                assert time.monotonic() < deadline, "the trainer never started pushing"
                watch_health()
                time.sleep(0.5)
        acked = 0
        stop = threading.Event()
        errors: list[BaseException] = []
        transports: list[str] = []

        def pusher() -> None:
            nonlocal acked
            try:
                with Client(addresses, retry_timeout=60) as c:
                    while not stop.is_set():
                        c.push("canary", canary_ids, torch.full((64, 2), -1.0), wait=True)
                        acked += 1
                    transports.extend(c.transport.data_planes())
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        thread = threading.Thread(target=pusher, daemon=True)
        thread.start()
        while acked < 20 and thread.is_alive():
            time.sleep(0.01)
        victim = dep.inspect("shard-1")
        restarts = victim["RestartCount"]
        # A crash as the kernel delivers it (the OOM killer's SIGKILL): Docker 20.10 takes
        # `docker kill` for a manual stop and does not apply the restart policy after it.
        if pathlib.Path(f"/proc/{victim['State']['Pid']}").exists():
            os.kill(victim["State"]["Pid"], 9)
        else:  # an engine on another host: its CLI's kill, then a start (what the policy would do)
            _docker(env, "kill", "-s", "KILL", victim["Id"])
            _docker(env, "start", victim["Id"])
        t0 = time.monotonic()
        while dep.inspect("shard-1")["RestartCount"] == restarts and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        dep.wait_healthy(["shard-1"], timeout=120)
        report["crash_to_healthy_s"] = round(time.monotonic() - t0, 1)
        pushed_after = acked
        while acked < pushed_after + 20 and thread.is_alive():  # pushes go on through the restarted shard
            time.sleep(0.01)
        stop.set()
        thread.join(120)
        assert not errors, errors
        assert transports == ["zmq"] * SHARDS  # the data plane on its fixed ports, through the crash too
        assert dep.inspect("shard-1")["RestartCount"] > restarts and "replayed" in dep.run("logs", "shard-1")

        # The trainer finishes, having gone through the crash.
        deadline = time.monotonic() + 600
        while dep.health("trainer") == "running":
            assert time.monotonic() < deadline, "the trainer did not finish"
            watch_health()
            time.sleep(1)
        logs = dep.run("logs", "--no-color", "trainer")
        assert dep.inspect("trainer")["State"]["ExitCode"] == 0, logs[-3000:]
        best, ours, local = (_auc(logs, label) for label in
                             ("best achievable", "shardps (2 workers, async)", "local torch.optim"))
        report["auc"] = {"best": best, "shardps": ours, "local": local}
        assert ours > 0.72 and ours > best - 0.1 and abs(ours - local) < 0.03, report
        watch_health()
        assert not [u for u in unhealthy if u[0] != "shard-1"], unhealthy
        # Each shard's Prometheus metrics (the image serves them on 9100), parsed with Prometheus' parser.
        for s, address in zip(shards, addresses):
            samples = scrape(f"http://{address.rsplit(':', 1)[0]}:9100/metrics")
            pushed = sum(v for (name, labels), v in samples.items()
                         if name == "shardps_rows_total" and ("op", "push") in labels)
            assert pushed > 0 and value(samples, "shardps_wal_fsync_seconds_count") > 0, s
            assert value(samples, "shardps_requests_total", method="Push") > 0, s
        latencies = sorted(v for s in shards for v in probes[s].values())
        report["probe_s"] = {"n": len(latencies), "median": round(latencies[len(latencies) // 2], 3),
                             "max": round(latencies[-1], 3)}

        with Client(addresses) as c:
            # Every acknowledged canary push survived the crash, exactly once.
            torch.testing.assert_close(c.pull("canary", canary_ids), torch.full((64, 2), float(acked)),
                                       rtol=0, atol=0)
            before = _snapshot(c, rows=20_000)
            versions = [i.version for i in c.shard_info()]

        # stop: SIGTERM, the final checkpoint; start: restored from the volume, the same state.
        t0 = time.monotonic()
        dep.run("stop", *shards, timeout=300)
        report["stop_s"] = round(time.monotonic() - t0, 1)
        assert [dep.inspect(s)["State"]["ExitCode"] for s in shards] == [0] * SHARDS
        dep.run("start", *shards, timeout=300)
        dep.wait_healthy(shards, timeout=120)
        addresses = [dep.address(s) for s in shards]
        with Client(addresses) as c:
            info = c.shard_info()
            assert [i.version for i in info] == versions
            assert all(i.last_checkpoint == "shutdown" for i in info), [i.last_checkpoint for i in info]
            after = _snapshot(c, rows=20_000)
        assert before.keys() == after.keys() and len(before) > 2
        for name in before:
            assert torch.equal(before[name], after[name]), name

        # Mutual TLS and tokens on (docker/compose.tls.yaml, secrets made as its header says): the shards
        # are recreated on their volumes and report healthy through shardps-health with the client
        # certificate; a reader's token reads the same rows and may not push; plaintext and token-less
        # clients are refused.
        secrets = pathlib.Path(tempfile.mkdtemp(prefix="shardps-secrets-"))
        subprocess.run([sys.executable, "-m", "shardps.server.ops.certs", str(secrets), "--tokens", "--world-readable",
                        "--hosts", ",".join([*shards, "shardps", "localhost", "127.0.0.1"])],
                       check=True, capture_output=True, timeout=60)
        try:
            dep.with_tls(secrets)
            t0 = time.monotonic()
            dep.run("up", "-d", "--no-build", *shards, timeout=300)
            dep.wait_healthy(shards, timeout=120)
            report["tls_up_to_healthy_s"] = round(time.monotonic() - t0, 1)
            addresses = [dep.address(s) for s in shards]
            tls = TLS(ca=str(secrets / "ca.pem"), cert=str(secrets / "client.pem"), key=str(secrets / "client.key"),
                      server_name="shardps")
            reader = (secrets / "reader.token").read_text().strip()
            with Client(addresses, tls=tls, token=reader) as c:
                tls_rows = _snapshot(c, rows=20_000)
                with pytest.raises(PermissionDeniedError):
                    c.push("canary", canary_ids, torch.ones(64, 2), wait=True)
            for name in before:
                assert torch.equal(before[name], tls_rows[name]), name
            with pytest.raises(ShardUnavailableError):
                Client(addresses, retry_timeout=2, timeout=5)  # plaintext to TLS
            with pytest.raises(AuthenticationError):
                Client(addresses, tls=tls, retry_timeout=2, timeout=5, token=None)  # no token
        finally:
            shutil.rmtree(secrets, ignore_errors=True)
        report["total_s"] = round(time.monotonic() - t_start, 1)
    finally:
        print("\ncontainer test:", json.dumps(report))
        record_property("timings", report)  # printed at the end of the run (conftest): where a slow run's time went
        dep.down()


def _docker_time(stamp: str) -> float:
    """Seconds since the epoch of a Docker timestamp (nanosecond digits and a zone offset)."""
    from datetime import datetime

    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    assert m, stamp
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float("0." + (m.group(2) or "0"))
