"""From training to serving: exports (bases and deltas with tombstones) of real shards, read back by an
independent reader (the safetensors library) and by serving shards that follow the deltas.

The reference is the training cluster itself: at every cut, base + deltas must hold exactly the rows a
fresh base of the same cut holds, and a serving shard must answer every pull exactly as the trainer does."""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys
import threading
import time
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from shardps_client import SGD, Adagrad, Client, Eviction, Initializer, RemoteEmbedding
from shardps_client.errors import ExportGapError, InvalidArgumentError, ReadOnlyError, TableExistsError

from shardps.core.exports import compact, generations, load_tables, read_manifest
from shardps.core.routing import shard_of_ids
from shardps.server.ops.report import collect
from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import ShardConfig
from tests.conftest import running_cluster
from tests.procs import start_shard

N, DIM = 3000, 8
INIT = Initializer("normal", std=0.1, seed=3)


@contextlib.contextmanager
def serving(directory: pathlib.Path, num_shards: int, poll_s: float = 0.05) -> Iterator[list[ShardServer]]:
    servers = []
    try:
        for i in range(num_shards):
            servers.append(ShardServer(ShardConfig(i, num_shards, serve_from=str(directory)),
                                       ServerConfig(delta_poll_s=poll_s)).start())
        yield servers
    finally:
        for s in servers:
            s.stop(checkpoint=False)


def _tables(c: Client) -> None:
    c.create_table("emb", dim=DIM, num_embeddings=N, optimizer=Adagrad(lr=0.3), initializer=INIT)
    c.create_table("hot", dim=DIM, num_embeddings=N, optimizer=SGD(lr=0.5), initializer=INIT,
                   eviction=Eviction(max_rows=150, policy="lru"))
    c.register_dense("w", torch.randn(40, 6))


def _train(c: Client, rng: np.random.Generator, steps: int, tables: tuple = ("emb", "hot")) -> None:
    for _ in range(steps):
        ids = rng.integers(0, N, 200)
        for table in tables:
            c.push(table, ids, rng.standard_normal((200, DIM)).astype(np.float32))
        c.push_dense("w", torch.from_numpy(rng.standard_normal((40, 6)).astype(np.float32)))
    c.flush()


@contextlib.contextmanager
def trained(steps: int, seed: int) -> Iterator[tuple[list[ShardServer], Client, np.random.Generator]]:
    """A training cluster of two shards holding the test's tables after ``steps`` rounds of pushes."""
    rng = np.random.default_rng(seed)
    with running_cluster(2) as servers, Client([s.address for s in servers]) as c:
        _tables(c)
        _train(c, rng, steps)
        yield servers, c, rng


def _every_row(c: Client, table: str) -> np.ndarray:
    return c.pull(table, torch.arange(N)).numpy()


def _served(state: dict, table: str, num_shards: int) -> np.ndarray:
    """Every id's value as base + deltas hold it (absent ids read as the initializer's value)."""
    out = INIT.rows(np.arange(N), DIM)
    for s in range(num_shards):
        t = state[s].get(table)
        if t is not None:
            out[t.ids] = t.values
    return out


def _same_rows(a: dict, b: dict, num_shards: int) -> None:
    for s in range(num_shards):
        assert sorted(a[s]) == sorted(b[s])
        for name in a[s]:
            np.testing.assert_array_equal(a[s][name].ids, b[s][name].ids, err_msg=f"{name} shard {s}")
            np.testing.assert_array_equal(a[s][name].values, b[s][name].values, err_msg=f"{name} shard {s}")


def _wait(predicate, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_base_and_deltas_reproduce_the_live_tables(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "export"
    with trained(3, seed=0) as (servers, c, rng):
        base = c.export(out)
        assert base.kind == "base" and base.seq == 0 and base.rows > 0
        # An independent reader: the safetensors library, on the files the manifest names.
        m = read_manifest(out / "base-000000.json")
        assert m["num_shards"] == 2 and {e["name"] for e in m["tables"]} == {"emb", "hot", "w"}
        emb = next(e for e in m["tables"] if e["name"] == "emb")
        got = INIT.rows(np.arange(N), DIM)
        for part in emb["shards"]:
            f = load_file(str(out / part["file"]))
            assert set(f) == {"ids", "values"} and f["values"].shape == (part["rows"], DIM)
            got[f["ids"]] = f["values"]
        np.testing.assert_array_equal(got, _every_row(c, "emb"))
        for i in range(1, 5):
            _train(c, rng, 2, ("emb", "hot") if i < 3 else ("emb",))
            if i == 3:
                c.drop_table("hot")
            d = c.export_delta(out)
            assert (d.kind, d.seq) == ("delta", i)
            if i <= 2:
                assert d.tombstones > 0  # LRU evicted rows of "hot": they must not come back when served
            # Row by row: the chain equals a fresh base of the same cut.
            fresh = tmp_path / f"fresh-{i}"
            c.export(fresh)
            _, chained = load_tables(out)
            _, direct = load_tables(fresh)
            _same_rows(chained, direct, 2)
            for table in ("emb",) + (("hot",) if i < 3 else ()):
                np.testing.assert_array_equal(_served(chained, table, 2), _every_row(c, table))
            np.testing.assert_array_equal(
                np.concatenate([chained[s]["w"].values[np.argsort(chained[s]["w"].ids)] for s in range(2)]).shape,
                (40, 6))
        assert read_manifest(out / "delta-000003.json")["dropped"] == ["hot"]
        assert c.export_delta(out).kind == "none"  # nothing changed: nothing written
        # Compaction folds the chain into base 4 and prunes (keep 1 base): the same rows.
        before = load_tables(out)[1]
        r = compact(out, keep_bases=1)
        assert (r.kind, r.seq) == ("base", 4)
        assert [(seq, kind) for seq, kind, _ in generations(out)] == [(4, "base")]
        _same_rows(load_tables(out)[1], before, 2)
        assert not (out / "delta-000001").exists()


def test_serving_shards_follow_deltas_and_refuse_changes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "export"
    with trained(2, seed=1) as (servers, c, rng):
        c.export(out)
        with serving(out, 2) as replicas, Client([s.address for s in replicas], retry_timeout=1) as r:
            for table in ("emb", "hot"):
                np.testing.assert_array_equal(_every_row(r, table), _every_row(c, table))
            np.testing.assert_array_equal(r.pull_dense("w")[0], c.pull_dense("w")[0])
            # Read-only: pushes, new tables, drops refused with a clear status; the same spec is accepted.
            with pytest.raises(ReadOnlyError, match="read-only"):
                r.push("emb", [1, 2], np.ones((2, DIM), np.float32))
                r.flush()
            with pytest.raises(ReadOnlyError, match="read-only"):
                r.create_table("new", dim=4)
            with pytest.raises(ReadOnlyError):
                r.drop_table("emb")
            with pytest.raises(TableExistsError):
                r.create_table("emb", dim=DIM + 1, num_embeddings=N)
            r.create_table("emb", dim=DIM, num_embeddings=N, optimizer=Adagrad(lr=0.3), initializer=INIT)
            # Deltas: each applied whole. A pull of one shard's rows sees one delta's values or the next's,
            # never a mix (shards apply a delta independently: atomicity is per shard).
            seen_mixed: list = []
            stop = threading.Event()
            owned = [np.flatnonzero(shard_of_ids(np.arange(N), 2) == s) for s in range(2)]

            def reader() -> None:
                with Client([s.address for s in replicas]) as rr:
                    while not stop.is_set():
                        for ids in owned:
                            rows = rr.pull("emb", torch.from_numpy(ids)).numpy()
                            if not (rows == rows[0, 0]).all():
                                seen_mixed.append(np.unique(rows))

            t = threading.Thread(target=reader)
            for k in range(1, 4):
                c.load_state_dict("emb", {"weight": torch.full((N, DIM), float(k))})
                d = c.export_delta(out)
                _wait(lambda seq=d.seq: all(s.shard.serving.delta == seq for s in replicas), what=f"delta {d.seq}")
                if k == 1:
                    t.start()
                np.testing.assert_array_equal(_every_row(r, "emb"), np.full((N, DIM), float(k), np.float32))
                assert r.pull_with_version("emb", torch.arange(10))[1].by_shard == \
                    {s: v for s, v in enumerate(d.versions)}
            stop.set()
            t.join(30)
            assert not seen_mixed, f"a pull saw rows of two deltas: {seen_mixed[:3]}"
            _train(c, rng, 2)
            c.export_delta(out)
            _wait(lambda: all(s.shard.serving.delta == 4 for s in replicas), what="delta 4")
            for table in ("emb", "hot"):
                np.testing.assert_array_equal(_every_row(r, table), _every_row(c, table))
            rows = collect([s.address for s in replicas], interval=0)
            assert rows[0]["serving"]["delta"] == 4 and rows[0]["serving"]["base"] == 0
            assert rows[0]["serving"]["deltas_applied"] == 4 and not rows[0]["serving"]["error"]


def test_bad_deltas_are_refused_and_the_last_good_state_served(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "export"
    with trained(2, seed=2) as (servers, c, rng):
        c.export(out)
        with serving(out, 2, poll_s=3600) as replicas, Client([s.address for s in replicas]) as r:
            follower, state = replicas[0].follower, replicas[0].shard.serving
            _train(c, rng, 2)
            c.export_delta(out)
            assert follower.poll() and state.delta == 1
            good = _every_row(r, "emb")
            # A truncated file: refused, its name in the error; the shard serves delta 1 still.
            _train(c, rng, 2)
            c.export_delta(out)
            broken = out / read_manifest(out / "delta-000002.json")["tables"][0]["shards"][0]["file"]
            data = broken.read_bytes()
            broken.write_bytes(data[: len(data) // 2])
            assert not follower.poll()
            assert broken.name in state.error and "checksum" in state.error and state.delta == 1
            np.testing.assert_array_equal(_every_row(r, "emb")[np.arange(N) % 2 == 0], good[np.arange(N) % 2 == 0])
            assert "next delta refused" in subprocess.run(
                [sys.executable, "-m", "shardps", "stats", replicas[0].address, "--interval", "0"],
                capture_output=True, text=True, check=True).stdout
            # Repaired, it applies.
            broken.write_bytes(data)
            assert follower.poll() and state.delta == 2 and not state.error
            # Out of sequence: a delta 4 with no delta 3 is refused, named.
            _train(c, rng, 1)
            c.export_delta(out)
            for p in sorted(out.glob("delta-000003*")):
                p.rename(p.with_name(p.name.replace("000003", "000004")))
            assert not follower.poll()
            assert "delta-000004.json" in state.error and "out of sequence" in state.error and state.delta == 2
            # A delta that does not start where the served state is (its manifest's previous generation).
            for p in sorted(out.glob("delta-000004*")):
                p.rename(p.with_name(p.name.replace("000004", "000003")))
            m = json.loads((out / "delta-000003.json").read_text())
            assert follower.poll() and state.delta == 3 and m["previous"] == 2
    # Another shard map: refused at start with the way out; resharded by compaction it serves.
    with pytest.raises(RuntimeError, match="written by a cluster of 2 shards.*shardps compact"):
        start_shard(0, 3, tmp_path, extra=["--serve-from", str(out)])
    resharded = tmp_path / "three"
    compact(out, resharded, num_shards=3)
    _, two = load_tables(out)
    _, three = load_tables(resharded)
    for table in ("emb", "hot"):
        np.testing.assert_array_equal(_served(two, table, 2), _served(three, table, 3))
    procs = [start_shard(i, 3, tmp_path, extra=["--serve-from", str(resharded)]) for i in range(3)]
    try:
        with Client([p.address for p in procs]) as r3:
            np.testing.assert_array_equal(_every_row(r3, "emb"), _served(two, "emb", 2))
    finally:
        for p in procs:
            p.terminate()


def test_served_dlrm_scores_like_the_trainer(tmp_path: pathlib.Path) -> None:
    """The DLRM example end to end: train through shards, export, serve, score; then deltas move it."""
    result = tmp_path / "serving.json"
    subprocess.run([sys.executable, "-m", "clients.examples.serving", "--rows", "2000", "--train", "12000",
                    "--test", "4000", "--deltas", "2", "--json", str(result)], check=True, timeout=300)
    r = json.loads(result.read_text())
    assert r["served_auc"] == r["trainer_auc"] and r["max_score_diff"] == 0.0
    assert r["trainer_auc"] > 0.6
    for d in r["deltas"]:
        assert d["served_equals_trainer"] and d["max_score_diff"] == 0.0
        assert d["moved"] > 0  # predictions moved with the delta


def test_state_dict_round_trip_with_nn_embedding_and_log_replay(tmp_path: pathlib.Path) -> None:
    """``load_state_dict`` / ``state_dict`` against torch.nn.Embedding (the reference module), through the log."""
    ref = torch.nn.Embedding(500, DIM)
    procs = [start_shard(i, 2, tmp_path, data_dir=str(tmp_path / f"log-{i}"), extra=["--durability", "log"])
             for i in range(2)]
    try:
        with Client([p.address for p in procs]) as c:
            c.create_table("t", dim=DIM, num_embeddings=500, optimizer=SGD(lr=0.1), initializer=INIT)
            c.load_state_dict("t", ref.state_dict())
            got = c.state_dict("t")
            assert set(got) == {"weight"}
            torch.testing.assert_close(got["weight"], ref.weight.detach(), rtol=0, atol=0)
            copy = torch.nn.Embedding(500, DIM)
            copy.load_state_dict(got)  # an ordinary PyTorch model loads it
            ids = torch.tensor([[3, 7], [499, 0]])
            torch.testing.assert_close(RemoteEmbedding(c, "t")(ids), copy(ids), rtol=0, atol=0)
            for bad, match in (({"weight": torch.zeros(499, DIM)}, "shape"), ({"w": ref.weight}, "weight"),
                               ({"weight": torch.full((500, DIM), float("nan"))}, "NaN")):
                with pytest.raises(InvalidArgumentError, match=match):
                    c.load_state_dict("t", bad)
            # A push after the load steps from the loaded values (SGD, the reference optimizer).
            c.push("t", [5], torch.ones(1, DIM))
            c.flush()
            expected = ref.weight.detach()[5] - 0.1
        for p in procs:  # kill -9: the assignment and the push come back from the log
            p.kill()
        procs = [start_shard(i, 2, tmp_path, data_dir=str(tmp_path / f"log-{i}"), extra=["--durability", "log"])
                 for i in range(2)]
        with Client([p.address for p in procs]) as c:
            w = c.state_dict("t")["weight"]
            torch.testing.assert_close(w[5], expected, rtol=0, atol=1e-7)
            torch.testing.assert_close(w[:5], ref.weight.detach()[:5], rtol=0, atol=0)
            # After a restart the shards cannot say what they evicted before it: a delta needs a new base.
            out = tmp_path / "export"
            c.export(out)
    finally:
        for p in procs:
            p.terminate()
    procs = [start_shard(i, 2, tmp_path, data_dir=str(tmp_path / f"log-{i}"), extra=["--durability", "log"])
             for i in range(2)]
    try:
        with Client([p.address for p in procs]) as c:
            with pytest.raises(ExportGapError, match="write a new base"):
                c.export_delta(out)
            r = c.export_delta(out, fallback_base=True)
            assert (r.kind, r.seq) == ("base", 1)
            assert c.export_delta(out).kind == "none"
    finally:
        for p in procs:
            p.terminate()


def test_export_command_follows_with_deltas_and_compacts(tmp_path: pathlib.Path) -> None:
    """``shardps export --delta-interval`` as users run it, while a trainer pushes; a serving shard follows."""
    out = tmp_path / "export"
    with trained(1, seed=4) as (servers, c, rng):
        cmd = [sys.executable, "-m", "shardps", "export", *[s.address for s in servers], "--out", str(out),
               "--delta-interval", "0.3", "--count", "4", "--compact-every", "3", "--keep-bases", "1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                _train(c, rng, 1)
                time.sleep(0.05)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr
        lines = [json.loads(line) for line in stdout.splitlines()]
        assert [(x["kind"], x["seq"]) for x in lines] == [("base", 0), ("delta", 1), ("delta", 2), ("delta", 3),
                                                           ("base", 3), ("delta", 4)]
        assert [(seq, kind) for seq, kind, _ in generations(out)] == [(3, "base"), (4, "delta")]
        with serving(out, 2) as replicas:
            assert all(s.shard.serving.delta == 4 and s.shard.serving.base == 3 for s in replicas)
            with Client([s.address for s in replicas]) as r:
                _, state = load_tables(out)
                np.testing.assert_array_equal(_every_row(r, "emb"), _served(state, "emb", 2))
