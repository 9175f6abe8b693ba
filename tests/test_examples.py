"""The example trainers run end to end, as a user runs them, and learn."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from shardps.server.ops.launcher import LocalCluster

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = "clients.examples"  # run as python -m from ROOT


def _run(args: list[str], timeout: int = 240) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_digits_convnet_reaches_95_percent_with_two_workers(mode):
    out = _run(["-m", f"{EXAMPLES}.digits_convnet", "--workers", "2", "--mode", mode, "--epochs", "6",
                "--min-accuracy", "0.95"])
    assert f"({mode}, 2 workers" in out


# The local baseline with one torch thread: with its default two, on 2 cores the rest of the suite keeps busy, its
# OpenMP threads wait on each other at every parallel region (one suite run's local baseline ran at 1,772 samples/s
# against 99,000 alone and the test went past its 120 s; beside 3 busy processes: 3,260 samples/s with 2 threads,
# 34,378 with 1). The AUC compared is the same.
@pytest.mark.timeout(300)
def test_dlrm_async_two_workers_converges(tmp_path):
    result = tmp_path / "dlrm.json"
    _run(["-m", f"{EXAMPLES}.dlrm", "--workers", "2", "--rows", "200000", "--train", "120000", "--test", "30000",
          "--local-threads", "1", "--json", str(result)])
    r = json.loads(result.read_text())
    best, ours, local = r["best_auc"], r["shardps"]["auc"], r["local"]["auc"]
    assert ours > 0.72 and ours > best - 0.1, r  # learned most of the planted signal
    assert abs(ours - local) < 0.03, r  # and as much as local torch.optim training did
    # the shards' CPU counted over the training loops (read by the workers), within the whole run's (which has the
    # tables' creation and rank 0's evaluation besides)
    shards = r["shardps"]
    assert 0 < shards["shards_cpu_s_per_1k"] <= shards["shards_cpu_s_per_1k_whole_run"], shards


def test_lstm_language_model_learns():
    out = _run(["-m", f"{EXAMPLES}.lstm_lm", "--workers", "2", "--steps", "60", "--max-perplexity", "15"])
    assert "held-out perplexity" in out


def test_examples_run_under_torchrun(tmp_path):
    # `python -m torch.distributed.run` is what the torchrun script runs (found without an activated venv).
    with LocalCluster(2) as cluster:
        cluster.write_cluster_file(str(tmp_path / "c.json"))
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--log-dir", str(tmp_path / "torchrun"),  # (else a torchelastic_* directory left in /tmp)
             "-m", f"{EXAMPLES}.lstm_lm", "--cluster-file", str(tmp_path / "c.json"), "--steps", "20", "--mode", "sync"],
            cwd=ROOT, capture_output=True, text=True, timeout=240,
        )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "20 steps x 2 workers" in out.stdout


def test_dlrm_hybrid_ddp_dense_learns_with_replicas_in_step(tmp_path):
    """--dense ddp: the MLPs are replicated by DistributedDataParallel (gloo) and stepped by a local
    torch.optim.Adam, the embeddings train on the shards. DDP must keep the replicas identical, and the
    model must learn what local training learns."""
    result = tmp_path / "dlrm.json"
    _run(["-m", f"{EXAMPLES}.dlrm", "--workers", "2", "--rows", "200000", "--train", "120000", "--test", "30000",
          "--dense", "ddp", "--dense-lr", "4e-3", "--json", str(result)])
    r = json.loads(result.read_text())
    prints = r["shardps"]["dense_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1], prints  # every rank ended with the same MLP values
    ours, local = r["shardps"]["auc"], r["local"]["auc"]
    assert ours > 0.72 and abs(ours - local) < 0.03, r
