"""Fuzzing the shard's wire surface: the report mode.

    python -m tests.fuzz --examples 400 --seed 1     # or SHARDPS_FUZZ_EXAMPLES / SHARDPS_FUZZ_SEED

starts a shard, runs the examples of every method, prints a table of method x
status code and the peak RSS, then the kill -9 round trip of the two exact
regressions, and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
from typing import Optional, Sequence

from tests.fuzz.crash import crash_roundtrip
from tests.fuzz.regressions import regression_calls
from tests.fuzz.report import Failure
from tests.fuzz.runner import run_fuzz, server_code_path
from tests.fuzz.target import TARGETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.fuzz",
        description="Fuzzing the shard's wire surface: request generators, a harness, a crash check, a report.",
    )
    p.add_argument(
        "--examples",
        type=int,
        default=int(os.environ.get("SHARDPS_FUZZ_EXAMPLES", "100")),
        help="examples per method [env SHARDPS_FUZZ_EXAMPLES]",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=int(os.environ.get("SHARDPS_FUZZ_SEED", "0")),
        help="Hypothesis seed [env SHARDPS_FUZZ_SEED]",
    )
    p.add_argument("--methods", default="", help="comma-separated subset of methods (default: all)")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds per call")
    p.add_argument("--rss-limit-mb", type=int, default=1536, help="the shard is killed (a failure) above this RSS")
    p.add_argument("--no-crash-test", action="store_true", help="skip the kill -9 regression round trip")
    p.add_argument("--workdir", default=None, help="keep shard logs and data here (default: a temp dir)")
    p.add_argument("-v", "--verbose", action="store_true", help="print failures as they happen")
    p.add_argument("--dump", default=None, help="write every failure with its whole input here (JSON lines)")
    return p


def _dump(path: str, failures: list[Failure]) -> None:
    """Every failure with its whole input, one JSON object a line."""
    with open(path, "w") as f:
        for fail in failures:
            payload = fail.payload if isinstance(fail.payload, list) else [fail.payload or b""]
            f.write(
                json.dumps(
                    {
                        "method": fail.method,
                        "kind": fail.kind,
                        "detail": fail.detail,
                        "cause": fail.cause,
                        "input_hex": [b.hex() for b in payload],
                    }
                )
                + "\n"
            )


def _crash_check(workdir: pathlib.Path, deadline: float) -> bool:
    """The kill -9 round trip of the two exact regressions, printed; True if it passed."""
    workdir.mkdir(exist_ok=True)
    result = crash_roundtrip(workdir, regression_calls(), deadline)
    print("crash round trip (overlong tag, duplicated grads; as Push, PushBatch, Stream):")
    for method, outcome in result.outcomes:
        print(f"  {method:10s} {','.join(outcome)}")
    print(f"  kill -9 + restart: {result.explain()}")
    return result.ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m] or None
    for m in methods or []:
        if m not in TARGETS:
            p.error(f"unknown method {m}; known: {', '.join(TARGETS)}")
    with tempfile.TemporaryDirectory(prefix="shardps-fuzz-") as tmp:
        workdir = pathlib.Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
        (workdir / "fuzz").mkdir(exist_ok=True)
        report = run_fuzz(
            workdir / "fuzz", args.examples, args.seed, methods, args.deadline, args.rss_limit_mb << 20, log=log
        )
        report.server_code = server_code_path()
        print(report.format(), flush=True)
        if args.dump:
            _dump(args.dump, report.failures)
        bad = bool(report.failures) or report.restart_ok is False
        if not args.no_crash_test:
            bad = not _crash_check(workdir / "crash", args.deadline) or bad
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
