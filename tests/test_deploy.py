"""The Dockerfiles and the Compose file, checked against the real CLIs (ours and Compose's), and the
cluster Compose describes started as plain processes and trained against. tests/test_containers.py
runs the same files in a real Docker engine."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import kubernetes_validate as kv
import pytest
import yaml

from shardps import probe
from shardps.server.ops.cli import parse_args
from shardps.server.ops.launcher import check_health
from shardps.server.rpc import ServerConfig
from shardps.server.shard.facade import ShardConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _shards(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if name.startswith("shard-")}


def _dockerfile(name: str) -> list[str]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with the environment unset: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_images_build_from_any_base_offline_and_run_slim_and_unprivileged():
    for name in ("Dockerfile.server", "Dockerfile.trainer"):
        lines = _dockerfile(name)
        assert lines[0] == "ARG BASE_IMAGE=python:3.11-slim"
        stages = [line for line in lines if line.startswith("FROM ")]
        # Two stages: the wheelhouse and pip stay in the build stage, only the venv reaches the image.
        assert stages == ["FROM ${BASE_IMAGE} AS build", "FROM ${BASE_IMAGE}"]
        run = next(line for line in lines if line.startswith("RUN ") and "pip install" in line)
        assert "wheelhouse) set -- --no-index --find-links /wheelhouse" in run and "--no-compile" not in run
        assert "python -m shardps.core.kernels" in run  # the kernels compiled at build time
        final = lines[lines.index("FROM ${BASE_IMAGE}"):]
        assert "COPY --from=build /opt/venv /opt/venv" in final
        assert not any("pip install" in line or "wheelhouse" in line for line in final)
        # numba only uses a cache directory its user can write: the baked kernels belong to that user.
        assert any("NUMBA_CACHE_DIR=/opt/numba-cache" in line for line in final)
        assert any("chown -R" in line and "/opt/numba-cache" in line for line in final)
        users = [line.split()[1] for line in final if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0")
    server = _dockerfile("Dockerfile.server")
    assert not any("torch" in line for line in server if line.startswith(("RUN", "ARG")))
    assert 'VOLUME ["/data"]' in server
    assert 'ENTRYPOINT ["shardps", "serve"]' in server  # exec form: the server is PID 1 and gets SIGTERM
    trainer = _dockerfile("Dockerfile.trainer")
    assert "ARG TORCH=torch==2.13.0" in trainer and any("download.pytorch.org/whl/cpu" in line for line in trainer)


def test_image_and_compose_health_checks_agree_and_use_the_light_probe(compose):
    (line,) = [line for line in _dockerfile("Dockerfile.server") if line.startswith("HEALTHCHECK")]
    flags = dict(re.findall(r"--([a-z-]+)=(\S+)", line))
    check = compose["x-shard"]["healthcheck"]
    assert {k.replace("-", "_"): v for k, v in flags.items()} == {
        k: str(check[k]) for k in ("interval", "timeout", "start_period", "retries")}
    assert line.endswith('CMD ["shardps-health", "127.0.0.1:7000"]')
    assert check["test"] == ["CMD", "shardps-health", "127.0.0.1:7000"]
    args = probe.build_parser().parse_args(check["test"][2:])
    assert args.addresses == ["127.0.0.1:7000"] and args.timeout < float(check["timeout"].rstrip("s"))


def test_health_probe_loads_neither_numpy_nor_the_server():
    """What keeps each probe at ~0.1 s of CPU: it imports grpc and the health messages, nothing else."""
    code = ("import sys; from shardps import probe; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'numba', 'torch', 'shardps')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["['shardps',", "'shardps.probe']"]


@pytest.mark.parametrize("tool", [["docker-compose"], ["docker", "compose"]], ids=["docker-compose-1", "compose-v2"])
def test_compose_file_is_valid_for_the_real_compose_tools(tool, tmp_path):
    """`config` parses and validates the file the way `up` would, with no engine needed."""
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} is not installed")
    version = subprocess.run([*tool, "version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0:
        pytest.skip(f"{' '.join(tool)} is not installed")
    make_compose = _docker_script("make_compose")
    (tmp_path / "compose.8.yaml").write_text(make_compose.make(8))
    for path in (DOCKER / "compose.yaml", tmp_path / "compose.8.yaml"):
        out = subprocess.run([*tool, "-p", "shardps", "-f", str(path), "config"], capture_output=True, text=True,
                             timeout=60, cwd=DOCKER)
        assert out.returncode == 0, out.stderr
        resolved = yaml.safe_load(out.stdout)
        assert resolved["services"]["shard-0"]["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim",
                                                                   "PIP_SOURCE": "index"}
        assert "--train" in resolved["services"]["trainer"]["command"]


def test_shard_services_form_one_cluster(compose):
    shards = _shards(compose)
    n = len(shards)
    assert n == 4 and sorted(shards) == [f"shard-{i}" for i in range(n)]
    counts, indexes, volumes = set(), [], set()
    for name, svc in shards.items():
        env = svc["environment"]
        indexes.append(int(env["SHARDPS_SHARD_INDEX"]))
        assert name == f"shard-{env['SHARDPS_SHARD_INDEX']}"
        counts.add(int(env["SHARDPS_NUM_SHARDS"]))
        assert svc["restart"] in ("always", "unless-stopped", "on-failure")
        assert svc["healthcheck"]["test"][:2] == ["CMD", "shardps-health"]
        (vol,) = svc["volumes"]
        source, target = vol.split(":")
        assert target == "/data" and source in compose["volumes"]
        volumes.add(source)
    assert sorted(indexes) == list(range(n)) and counts == {n} and len(volumes) == n


def test_every_service_command_parses_with_the_real_cli(compose):
    entry = [line for line in _dockerfile("Dockerfile.server") if line.startswith("ENTRYPOINT")][0]
    assert entry == 'ENTRYPOINT ["shardps", "serve"]'
    image_env = {"SHARDPS_HOST": "0.0.0.0", "SHARDPS_PORT": "7000", "SHARDPS_DATA_DIR": "/data"}
    for svc in _shards(compose).values():
        # The container runs the ENTRYPOINT with no flags: everything comes from the environment.
        args = parse_args(["serve"], {**image_env, **svc["environment"]})
        assert (args.host, args.port, args.data_dir) == ("0.0.0.0", 7000, "/data")
        ShardConfig(shard_index=args.shard_index, num_shards=args.num_shards, data_dir=args.data_dir,
                    durability=args.durability)
        ServerConfig(host=args.host, port=args.port, checkpoint_interval_s=args.checkpoint_interval)
        assert probe.build_parser().parse_args(svc["healthcheck"]["test"][2:]).addresses == ["127.0.0.1:7000"]
    trainer = compose["services"]["trainer"]
    cmd = [_interpolate(a) for a in trainer["command"]]
    assert cmd[:2] == ["-m", "clients.examples.dlrm"]
    assert cmd[cmd.index("--train") + 1] == "400000" and cmd[cmd.index("--rows") + 1] == "1000000"
    addresses = cmd[cmd.index("--addresses") + 1].split(",")
    assert addresses == [f"shard-{i}:7000" for i in range(len(_shards(compose)))]
    assert set(trainer["depends_on"]) == set(_shards(compose))
    assert all(d["condition"] == "service_healthy" for d in trainer["depends_on"].values())


def test_generator_reproduces_the_committed_file_and_scales():
    make_compose = _docker_script("make_compose")
    assert make_compose.make(4) == (DOCKER / "compose.yaml").read_text()
    eight = yaml.safe_load(make_compose.make(8))
    shards = _shards(eight)
    assert sorted(int(s["environment"]["SHARDPS_SHARD_INDEX"]) for s in shards.values()) == list(range(8))
    assert {s["environment"]["SHARDPS_NUM_SHARDS"] for s in shards.values()} == {"8"}
    assert len(eight["volumes"]) == 8 and len(eight["services"]["trainer"]["depends_on"]) == 8


def test_cluster_described_by_compose_trains(compose, tmp_path):
    """Start each shard service's command with its environment (host/port/data moved to this
    machine's loopback and a temp dir), wait for its healthcheck, then run the trainer's command."""
    procs = []
    try:
        for name, svc in sorted(_shards(compose).items()):
            ready = tmp_path / f"{name}.ready"
            assert svc["environment"]["SHARDPS_DATA_PORT"] == "7100"  # fixed inside its container's network
            env = {**os.environ, **svc["environment"], "SHARDPS_HOST": "127.0.0.1", "SHARDPS_PORT": "0",
                   "SHARDPS_DATA_PORT": "0",
                   "SHARDPS_DATA_DIR": str(tmp_path / name), "SHARDPS_READY_FILE": str(ready)}
            log = open(tmp_path / f"{name}.log", "w")
            procs.append((subprocess.Popen([sys.executable, "-m", "shardps", "serve"], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), ready))
        addresses = []
        deadline = time.monotonic() + 60
        for proc, ready in procs:
            while not (ready.exists() and ready.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            addresses.append(ready.read_text())
        for a in addresses:
            while check_health(a) != "SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.05)
        health = subprocess.run([sys.executable, "-m", "shardps", "health", *addresses], capture_output=True, text=True,
                                timeout=60)
        assert health.returncode == 0, health.stdout
        cmd = [_interpolate(a) for a in compose["services"]["trainer"]["command"]]
        cmd[cmd.index("--addresses") + 1] = ",".join(addresses)
        for flag, value in (("--rows", "50000"), ("--train", "40000"), ("--test", "10000")):
            cmd[cmd.index(flag) + 1] = value
        out = subprocess.run([sys.executable, *cmd, "--no-local"],
                             cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "shardps (2 workers, async)" in out.stdout
        stats = subprocess.run([sys.executable, "-m", "shardps", "stats", *addresses, "--interval", "0", "--json"],
                               capture_output=True, text=True, timeout=60)
        import json

        rows = json.loads(stats.stdout)
        assert [r["shard_index"] for r in rows] == [0, 1, 2, 3] and all(r["durability"] == "log" for r in rows)
        assert all(r["pushes"] > 0 for r in rows)
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            assert proc.wait(30) == 0  # SIGTERM: graceful stop and final checkpoint


def test_cluster_command_reports_and_restarts_a_dead_shard(tmp_path):
    cluster_file = tmp_path / "cluster.json"
    proc = subprocess.Popen([sys.executable, "-m", "shardps", "cluster", "--shards", "2", "--cluster-file",
                             str(cluster_file), "--data-dir", str(tmp_path / "data")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not cluster_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        import json

        info = json.loads(cluster_file.read_text())
        addresses = info["addresses"]
        assert all(check_health(a) == "SERVING" for a in addresses)
        os.kill(info["pids"][1], 9)  # kill -9 shard 1
        while check_health(addresses[1]) != "SERVING":  # restarted on the same address
            assert time.monotonic() < deadline + 30
            time.sleep(0.1)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "shard 1" in out and "died with exit code -9" in out and "restarted" in out
    assert re.search(r"shard 0: 127\.0\.0\.1:\d+, data plane on ports \d+, \d+", out), out
    assert proc.returncode == 0
    # A clean stop removes the temporary log directory it printed (no --log-dir given): nothing left in /tmp.
    assert f"(logs in {info['logs']})" in out and "logs kept" not in out
    assert pathlib.Path(info["logs"]).name.startswith("shardps-logs-") and not pathlib.Path(info["logs"]).exists()


# ---- Kubernetes -------------------------------------------------------------------------------

def _k8s(text: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


def _docker_script(name: str):
    """One of docker/'s generator scripts (make_compose, make_k8s), imported as a module."""
    sys.path.insert(0, str(DOCKER))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_kubernetes_manifests_are_valid_against_the_schemas():
    """Offline, against the API schemas of the oldest version the manifests need (1.28: the pod-index
    label) and the newest kubernetes-validate knows, in strict mode (unknown fields are errors)."""
    make_k8s = _docker_script("make_k8s")
    assert make_k8s.make(4) == (DOCKER / "k8s" / "shardps.yaml").read_text()
    for shards in (1, 4, 16):
        docs = list(yaml.safe_load_all(make_k8s.make(shards, namespace="training")))
        assert [d["kind"] for d in docs] == ["Service", "StatefulSet", "PodDisruptionBudget", "Job"]
        for version in ("1.28.0", kv.latest_version()):
            for d in docs:
                kv.validate(d, version, strict=True)
    broken = _k8s(make_k8s.make(4))["StatefulSet"]
    broken["spec"]["replica"] = broken["spec"].pop("replicas")  # a typo the validator must catch
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.28.0", strict=True)


def test_kubernetes_statefulset_runs_one_shard_per_ordinal_with_probes_volume_and_metrics():
    k = _k8s((DOCKER / "k8s" / "shardps.yaml").read_text())
    sts, svc, pdb, job = k["StatefulSet"], k["Service"], k["PodDisruptionBudget"], k["Job"]
    n = sts["spec"]["replicas"]
    assert n == 4 and sts["spec"]["serviceName"] == svc["metadata"]["name"] == "shardps"
    assert svc["spec"]["clusterIP"] == "None"  # headless: stable names shardps-i.shardps
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == labels == sts["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["selector"]["matchLabels"] == labels and pdb["spec"]["maxUnavailable"] == 1
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["SHARDPS_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["SHARDPS_NUM_SHARDS"]["value"] == str(n)
    # The container's command through the real CLI: the image's ENTRYPOINT, its ENV, the pod's env
    # (the ordinal as the kubelet fills it in).
    image_env = dict(re.findall(r"(SHARDPS_[A-Z_]+)=(\S+)", next(
        line for line in _dockerfile("Dockerfile.server") if line.startswith("ENV SHARDPS_HOST"))))
    for ordinal in range(n):
        pod_env = {k: v.get("value", str(ordinal)) for k, v in env.items()}
        args = parse_args(["serve"], {**image_env, **pod_env})
        assert (args.shard_index, args.num_shards, args.durability) == (ordinal, n, "log")
        ShardConfig(shard_index=args.shard_index, num_shards=args.num_shards, data_dir=args.data_dir,
                    durability=args.durability)
        assert args.data_dir == "/data" and args.port == 7000
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.data_port == 7100 and args.data_threads == 2
    assert ports == {"grpc": args.port, "metrics": args.metrics_port, "data-0": 7100, "data-1": 7101}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 7000, "metrics": 9100, "data-0": 7100,
                                                                    "data-1": 7101}
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == args.metrics_port
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe_name]["grpc"] == {"port": args.port}  # gRPC health, spoken by the kubelet
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert c["volumeMounts"] == [{"name": claim["metadata"]["name"], "mountPath": "/data"}]
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["fsGroup"] == 10001
    assert "cpu" in c["resources"]["requests"] and "memory" in c["resources"]["limits"]
    # Long enough for the in-flight calls' grace and the final checkpoint.
    assert pod["terminationGracePeriodSeconds"] >= args.grace + 60
    # The trainer Job: its command through the example's own parser, one address per ordinal.
    (t,) = job["spec"]["template"]["spec"]["containers"]
    from clients.examples import dlrm

    assert t["args"][:2] == ["-m", "clients.examples.dlrm"]
    targs = dlrm.build_parser().parse_args(t["args"][2:])
    assert targs.addresses.split(",") == [f"shardps-{i}.shardps.default.svc:7000" for i in range(n)]


def test_kubernetes_tls_manifests_are_valid_and_wire_every_file_the_shard_and_trainer_read():
    """The --tls variant: valid against the schemas; the shard's TLS and token flags (from its env,
    through the real CLI) name files its Secret mounts hold; the probes run shardps-health with the
    client certificate; the trainer's client finds TLS and its token from its env."""
    make_k8s = _docker_script("make_k8s")
    assert make_k8s.make_tls(4) == (DOCKER / "k8s" / "shardps-tls.yaml").read_text()
    docs = list(yaml.safe_load_all(make_k8s.make_tls(4, namespace="training")))
    for version in ("1.28.0", kv.latest_version()):
        for d in docs:
            kv.validate(d, version, strict=True)
    k = _k8s((DOCKER / "k8s" / "shardps-tls.yaml").read_text())
    pod = k["StatefulSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value", "0") for e in c["env"]}
    args = parse_args(["serve"], env)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"]}
    keys = {"shardps-tls": {"tls.crt", "tls.key", "ca.crt"}, "shardps-client-tls": {"tls.crt", "tls.key", "ca.crt"},
            "shardps-tokens": {"tokens"}, "shardps-trainer-token": {"token"}}

    def from_secret(path: str, volumes: dict, mounted: dict) -> None:
        directory, name = path.rsplit("/", 1)
        assert name in keys[volumes[mounted[directory]]], path

    for path in (args.tls_cert, args.tls_key, args.tls_client_ca, args.tokens_file,
                 env["SHARDPS_TLS_CA"], env["SHARDPS_TLS_CLIENT_CERT"], env["SHARDPS_TLS_CLIENT_KEY"]):
        from_secret(path, secrets, mounts)
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe_name]["exec"]["command"]
        assert command[:2] == ["shardps-health", "127.0.0.1:7000"]
    tpod = k["Job"]["spec"]["template"]["spec"]
    (t,) = tpod["containers"]
    tenv = {e["name"]: e["value"] for e in t["env"]}
    tmounts = {m["mountPath"]: m["name"] for m in t["volumeMounts"]}
    tsecrets = {v["name"]: v["secret"]["secretName"] for v in tpod["volumes"]}
    for name in ("SHARDPS_TLS_CA", "SHARDPS_TLS_CLIENT_CERT", "SHARDPS_TLS_CLIENT_KEY", "SHARDPS_TOKEN_FILE"):
        from_secret(tenv[name], tsecrets, tmounts)
    assert tpod["securityContext"]["fsGroup"] == 10002  # the Secret's files readable by the trainer's group


def test_compose_tls_override_is_generated_valid_and_complete(tmp_path):
    make_compose = _docker_script("make_compose")
    assert make_compose.make_tls(4) == (DOCKER / "compose.tls.yaml").read_text()
    override = yaml.safe_load(make_compose.make_tls(4))
    base = yaml.safe_load(make_compose.make(4))
    assert set(override["services"]) == set(base["services"])
    for i in range(4):
        env = override["services"][f"shard-{i}"]["environment"]
        args = parse_args(["serve"], {**base["services"][f"shard-{i}"]["environment"], **env})
        assert args.tls_cert and args.tls_key and args.tls_client_ca and args.tokens_file
        assert all(p.startswith("/run/secrets/") for p in (args.tls_cert, args.tls_key, args.tls_client_ca,
                                                           args.tokens_file))
    if shutil.which("docker-compose") is None:
        return
    out = subprocess.run(["docker-compose", "-p", "shardps", "-f", str(DOCKER / "compose.yaml"), "-f",
                          str(DOCKER / "compose.tls.yaml"), "config"], capture_output=True, text=True, timeout=60,
                         cwd=DOCKER, env={**os.environ, "SHARDPS_SECRETS": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    merged = yaml.safe_load(out.stdout)
    shard = merged["services"]["shard-1"]
    assert shard["environment"]["SHARDPS_SHARD_INDEX"] == "1" and "SHARDPS_TLS_CERT" in shard["environment"]
    assert any(str(tmp_path) in str(v) for v in shard["volumes"])
    assert merged["services"]["trainer"]["environment"]["SHARDPS_TOKEN_FILE"] == "/run/secrets/admin.token"


def test_replica_groups_in_compose_and_kubernetes_are_generated_valid_and_wired():
    """docker/compose.replicas.yaml and docker/k8s/shardps-replicas.yaml (2 groups of 3 members and their etcd) are
    what the generators make; every member names its group, member id, etcd and its own address; the trainer
    reaches each group as its members joined by "|"; the manifests pass the API schemas offline."""
    make_compose, make_k8s = _docker_script("make_compose"), _docker_script("make_k8s")
    text = (DOCKER / "compose.replicas.yaml").read_text()
    assert make_compose.make_replicas(2, 3) == text
    c = yaml.safe_load(text)
    members = {k: v for k, v in c["services"].items() if k.startswith("shard-")}
    assert sorted(members) == [f"shard-{i}-{m}" for i in range(2) for m in range(3)]
    assert c["services"]["etcd"]["build"]["dockerfile"] == "docker/Dockerfile.etcd"
    for name, svc in members.items():
        i, m = name.split("-")[1:]
        env = svc["environment"]
        assert (env["SHARDPS_SHARD_INDEX"], env["SHARDPS_MEMBER"], env["SHARDPS_REPLICAS"]) == (i, f"m{m}", "3")
        assert env["SHARDPS_ETCD"] == "http://etcd:2379" and env["SHARDPS_ADVERTISE"] == f"{name}:7000"
        assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
    command = c["services"]["trainer"]["command"]
    assert command[command.index("--addresses") + 1] == ",".join(
        "|".join(f"shard-{i}-{m}:7000" for m in range(3)) for i in range(2))
    manifests = (DOCKER / "k8s" / "shardps-replicas.yaml").read_text()
    assert make_k8s.make_replicas(2, 3) == manifests
    docs = list(yaml.safe_load_all(manifests))
    assert [d["kind"] for d in docs].count("StatefulSet") == 3  # etcd and one per group
    for d in docs:
        kv.validate(d, "1.28.0", strict=True)
    sts = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "shardps-1"][0]
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert sts["spec"]["replicas"] == 3 and env["SHARDPS_SHARD_INDEX"]["value"] == "1"
    assert "pod-index" in env["SHARDPS_MEMBER"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["SHARDPS_ADVERTISE"]["value"] == "$(POD_NAME).shardps-1.default.svc:7000"
