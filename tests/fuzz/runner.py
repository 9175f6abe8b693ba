"""Running the fuzzing: Hypothesis examples of every method through one harness, and the report."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from tests.fuzz.harness import Harness
from tests.fuzz.memory import GiB
from tests.fuzz.payloads import method_payloads
from tests.fuzz.report import Report
from tests.fuzz.target import PUSH_METHODS, TARGETS


def stateful_settings(examples: int, seed: int) -> Callable[[Any], Any]:
    """Hypothesis settings for fuzzing a live shard: ``examples`` generated examples from ``seed``, no
    shrinking or replay (the shard is stateful), no deadline or database."""

    def wrap(test: Any) -> Any:
        return hypothesis_seed(seed)(settings(max_examples=examples, deadline=None, database=None,
                                              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                                              report_multiple_bugs=False)(test))

    return wrap


def fuzz_method(h: Harness, method: str, examples: int, seed: int) -> None:
    """``examples`` Hypothesis examples of ``method`` through the harness (no shrinking: the shard is stateful)."""

    @stateful_settings(examples, seed)
    @given(method_payloads(method))
    def run(payload: Any) -> None:
        try:
            h.exercise(method, payload)
        except Exception as e:  # noqa: BLE001 - a harness problem is a finding, not a reason to stop
            h.fail(method, "harness", f"{type(e).__name__}: {e}", payload)
            if not h.alive():
                h.restart_fresh()

    run()


def server_code_path(env: Optional[dict] = None) -> str:
    """Where a child ``python -m shardps`` imports shardps from (the shard runs with this environment)."""
    out = subprocess.run(
        [sys.executable, "-c", "import shardps; print(shardps.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    return out.stdout.strip() or out.stderr.strip()


def run_fuzz(
    workdir: pathlib.Path,
    examples: int = 50,
    seed: int = 0,
    methods: Optional[Sequence[str]] = None,
    deadline: float = 10.0,
    rss_limit: int = int(1.5 * GiB),
    final_restart: bool = True,
    log: Callable[[str], None] = lambda s: None,
) -> Report:
    """Fuzz every method (setup tables first; DropTable last) against one shard process; a report."""
    t0 = time.monotonic()
    h = Harness(pathlib.Path(workdir), deadline=deadline, rss_limit=rss_limit, log=log)
    order = sorted(methods or TARGETS, key=lambda m: (m == "DropTable", TARGETS.index(m)))
    restart_ok: Optional[bool] = None
    try:
        h.start()
        for i, method in enumerate(order):
            t1 = time.monotonic()
            fuzz_method(h, method, examples, seed * 1000 + i)
            if final_restart and method in PUSH_METHODS:  # kill -9 + restart on the data dir after each push method
                restart_ok = h.restart_check() and restart_ok is not False
            log(f"{method}: {time.monotonic() - t1:.1f}s")
        if final_restart:
            restart_ok = h.restart_check() and restart_ok is not False
    finally:
        h.stop()
    return Report(
        h.counts,
        h.failures,
        h.rss_peak,
        h.restarts,
        time.monotonic() - t0,
        examples,
        seed,
        restart_ok=restart_ok,
        restart_checks=h.restart_checks,
    )
