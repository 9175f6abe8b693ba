"""Every benchmark runs (short --quick mode), prints its table and writes JSON and a PNG. No speed is asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module,name,extra", [
    # (the suite's time: one of our loops beside the rpc peer, across the lab's hosts with the proxy's delay, the
    # placement with the most parts; make bench runs them all)
    ("bench_throughput", "throughput", ["--backends", "shardps", "torch_rpc", "--shards", "1", "--repeat", "2",
                                        "--placement", "lab-delay"]),
    ("bench_parts", "parts", []),
    ("bench_durability", "durability", []),
    # One worker count, no DDP variant (tests/test_examples.py runs DDP): the suite's time; here and across hosts.
    ("bench_e2e", "e2e", ["--cache-steps", "--workers", "1", "--skip-ddp", "--skip-tables", "--skip-lag",
                          "--placement", "lab"]),
    ("bench_transport", "transport", []),
    ("bench_bounded", "bounded", []),
    ("bench_serving", "serving", []),
    ("bench_fairness", "fairness", ["--kinds", "waiting"]),
    ("bench_collection", "collection", []),
    ("bench_tiered", "tiered", ["--no-stores"]),  # make bench runs the stores' comparison
    ("bench_replicas", "replicas", []),
    ("bench_reshard", "reshard", []),
])
def test_benchmark_quick_run_writes_table_json_and_png(tmp_path, module, name, extra):
    if name in ("throughput", "e2e"):  # they run across the lab's hosts too
        from tests.test_lab import require_lab

        require_lab()
    if name == "replicas":
        from tests.conftest import require_etcd

        require_etcd()
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(tmp_path), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "FAILED" not in out.stderr, out.stderr[-3000:]
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["results"] and all("error" not in r for r in data["results"])
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert "----" in out.stdout  # the table
    if name == "throughput":  # two interleaved runs per configuration: medians, and the ratio's range
        ours = next(r for r in data["results"] if r["backend"] == "shardps")
        assert len(ours["runs_rows_per_s"]) == 2
        assert ours["both_rows_per_s"] == pytest.approx(sum(ours["runs_rows_per_s"]) / 2)
        low, high = map(float, ours["x_torch_rpc_range"].split("-"))  # printed to 2 decimals
        assert low - 0.005 <= ours["x_torch_rpc"] <= high + 0.005
        assert "x rpc range" in out.stdout
        placed = next(r for r in data["results"] if r["backend"] == "shardps" and r["placement"] == "lab-delay")
        assert placed["x_torch_rpc"] > 0 and placed["proxy_cpu_s_per_M_rows"] > 0  # rpc placed alike; the proxy ran
        assert all(r["first_pass_rows_per_s"] > 0 for r in data["results"])
    if name == "durability":  # every setting beside checkpoint's from the same round; replay and restart timed
        assert {r["setting"] for r in data["results"]} == {"none", "checkpoint", "log+always", "log+interval",
                                                           "log+none"}
        assert all(r["x_checkpoint"] == 1.0 for r in data["results"] if r["setting"] == "checkpoint")
        meta = data["meta"]
        assert meta["replay"]["records"] > 0 and meta["replay"]["log_bytes"] >= 8 << 20
        assert meta["restart"]["restart_s"] > 0 and meta["restart"]["checkpoint_bytes"] > 0
    if name == "transport":  # both transports carried the standard workload through the same shards
        std = {r["transport"]: r for r in data["results"] if r["probe"] == "standard workload"}
        assert set(std) == {"grpc stream", "flight"} and std["grpc stream"]["x_grpc"] == 1.0
        assert all(r["rows_per_s"] > 0 and r["server_cpu_s_per_m_rows"] > 0 for r in std.values())
        assert all(r["same_rows"] for r in std.values())  # Flight's pulls read what gRPC's read
    if name == "bounded":  # memory, quality and cost parts, each against its baseline of the same run
        parts = {p: [r for r in data["results"] if r["part"] == p] for p in ("memory", "quality", "cost")}
        assert [r["table"] for r in parts["memory"]] == ["unbounded", "max_rows", "admission + max_rows"]
        assert all(r["rows_end"] <= data["meta"]["args"]["max_rows"] for r in parts["memory"][1:])
        assert parts["quality"][0]["trainer"] == "local torch.optim" and parts["quality"][0]["x_local_auc"] == 1.0
        assert parts["cost"][0]["table"] == "unbounded" and parts["cost"][0]["x_unbounded"] == 1.0
        assert data["meta"]["sweep"]["max_ms"] > 0
    if name == "serving":  # each part beside its baseline of the same run
        parts = {p: [r for r in data["results"] if r["part"] == p] for p in ("export", "delta", "apply")}
        assert all(len(rs) == 2 and rs[1]["x_baseline"] == 1.0 and rs[0]["x_baseline"] > 0 for rs in parts.values())
        assert parts["apply"][0]["rows"] == data["meta"]["args"]["rows"] and parts["apply"][0]["pulls"] > 0
    if name == "collection":  # each row ran the module it names (the collection's once ran separate modules)
        ran = {r["module"]: r["ran"] for r in data["results"]}
        assert ran == {"local": "EmbeddingBag", "collection": "RemoteEmbeddingBagCollection",
                       "separate modules": "RemoteEmbeddingBag"}, ran
    if name == "tiered":  # the table with a disk tier beside the same table in RAM, from the same run
        ram, disk = data["results"]
        assert ram["table"] == "all in RAM" and ram["x_ram_zipf"] == 1.0 and disk["x_ram_zipf"] > 0
        assert ram["x_ram_zipf_pipelined"] == 1.0 and disk["x_ram_zipf_pipelined"] > 0  # the pipelined loop too
        assert disk["hot_rows"] < data["meta"]["args"]["rows"] and disk["disk_bytes_per_row"] > 0
        assert 0 < disk["zipf_hit_rate"] <= 1 and disk["restart_s"] > 0
        parts = {p["part"]: p["us_per_miss"] for p in data["meta"]["parts"]["parts"]}  # a miss's CPU by part
        assert 0 < parts["read from disk > preads"] <= parts["read from disk"] < parts["all the parts"]
    if name == "replicas":  # R = 1 beside a group of 3 from the same round, and a failover that lost nothing
        rows = [r for r in data["results"] if r["part"] == "throughput"]
        assert [(r["replicas"], r["ack"]) for r in rows] == [(1, "-"), (3, "quorum")] and rows[0]["x_r1"] == 1.0
        fo = data["meta"]["failover"]
        assert fo["kills"] == 1 and fo["exact"] and not fo["errors"] and fo["max_s"] > 0
    if name == "e2e":  # local baselines first (every core, one thread), then 1 worker through the shards (across the
        # lab's hosts: the placement with the most parts) in each variant, with its ratios
        local, one, *ours = data["results"]
        assert local["trainer"] == "local torch.optim" and local["x_local"] == 1.0
        assert one["trainer"] == "local torch.optim, 1 thread" and one["fwd_bwd_x_one_thread"] == 1.0
        assert [(r["placement"], r["workers"], r["prefetch"]) for r in ours] == [
            ("lab", 1, p) for p in ("no", "yes")]
        assert all(r["shards_cpu_ms_per_1k"] > 0 and r["trainer_cpu_ms_per_1k"] > 0 for r in ours)
        for r in ours:
            assert r["x_local"] == pytest.approx(r["samples_per_s"] / local["samples_per_s"])
            assert r["fwd_bwd_x_one_thread"] > 0 and r["fwd_bwd_x_local_main"] > 0
            assert 0.5 < r["auc"] <= r["best_auc"]  # it learned something, and not more than the planted truth allows


def test_unknown_backend_is_refused_by_name(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_throughput", "--quick", "--out",
                          str(tmp_path), "--backends", "shardps", "rpc"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "invalid choice: 'rpc'" in out.stderr and "torch_rpc" in out.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
