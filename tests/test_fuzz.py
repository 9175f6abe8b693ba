"""Bounded fuzzing of a real shard process: every method, the data plane's raw multipart messages, raw bytes,
and a kill -9 after malicious pushes.

The generators and the harness are in tests/fuzz/. Each call must get a
status a client may legitimately get (never INTERNAL or UNKNOWN); a refused call
must change nothing (version, rows of t and d); the shard must stay alive and
below 1.5 GiB RSS; and after kill -9 it must restart on its data dir holding
exactly what it acknowledged.

``SHARDPS_FUZZ_EXAMPLES`` (default 35 per method) and ``SHARDPS_FUZZ_SEED``
(default 0) scale and vary the run; ``python -m tests.fuzz`` prints the same
run as a table.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.fuzz import crash, regressions, runner

EXAMPLES = int(os.environ.get("SHARDPS_FUZZ_EXAMPLES", "35"))
SEED = int(os.environ.get("SHARDPS_FUZZ_SEED", "0"))


@pytest.mark.slow
@pytest.mark.timeout(max(300, 6 * EXAMPLES))
def test_every_method_survives_fuzzing(tmp_path):
    report = runner.run_fuzz(tmp_path, examples=EXAMPLES, seed=SEED)
    print(report.format())
    if report.failures or not report.restart_ok:
        pytest.fail(report.format(), pytrace=False)
    # The fuzzing reached the shard's logic, not only its parser: valid pushes were applied.
    for method in ("Push", "PushDense", "PushBatch", "Stream", "DataPlane"):
        assert report.counts[(method, "OK")] > 0, f"no {method} was accepted:\n{report.format()}"


def _describe(result: crash.CrashResult) -> str:
    calls = "\n".join(f"  {m:10s} {','.join(codes)}" for m, codes in result.outcomes)
    return f"{result.explain()}\nlive answers:\n{calls}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill9_after_malicious_pushes_restarts_with_exactly_the_acknowledged_state(tmp_path):
    """The overlong tag (8a 80 80 80 80 00 for 0a) and the grads field sent twice, as Push, in a
    PushBatch and on a Stream: whatever the live answer, the shard restarts after kill -9 and
    holds exactly the pushes it acknowledged."""
    calls = regressions.regression_calls()
    result = crash.crash_roundtrip(tmp_path, calls)
    assert result.ok, _describe(result)
    assert result.before is not None and result.before[0] == result.applied, _describe(result)
    # The valid pushes around them were applied.
    assert [codes for m, codes in result.outcomes if m == "Push"][::2] == [["OK"]] * 3, _describe(result)


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(
    max_examples=max(2, EXAMPLES // 20),
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
@hypothesis_seed(SEED)
@given(calls=crash.crash_calls())
def test_kill9_after_fuzzed_pushes_restarts_with_exactly_the_acknowledged_state(tmp_path_factory, calls):
    result = crash.crash_roundtrip(tmp_path_factory.mktemp("crash"), calls)
    hexes = "\n".join(f"  {m}: {p.hex() if isinstance(p, bytes) else [f.hex() for f in p]}" for m, p in calls)
    assert result.ok, f"{_describe(result)}\ninputs:\n{hexes}"
    assert result.before is not None and result.before[0] == result.applied, f"{_describe(result)}\ninputs:\n{hexes}"
