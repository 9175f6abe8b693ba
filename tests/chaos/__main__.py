"""``python -m tests.chaos``: run the campaign's scenarios, print the table, write chaos.json and chaos.txt.

    python -m tests.chaos                       # every scenario at length (make chaos)
    python -m tests.chaos --short               # one round of each, scenarios of one spec sharing a cluster (CI)
    python -m tests.chaos --scenario disks --seed 7

Exit code 1 when any checker failed or a scenario could not run."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from tests.chaos.runner import Result, report, run_session
from tests.chaos.scenarios import BY_NAME, FULL, SCENARIOS, SHORT, Scenario


def sessions(chosen: list[Scenario], short: bool) -> list[list[Scenario]]:
    """Scenarios of one spec share a cluster, in the table's order (each runs on a healed, settled cluster; its row
    counts the operations invoked in its window)."""
    out: list[list[Scenario]] = []
    for s in chosen:
        for group in out:
            if group[0].spec == s.spec:
                group.append(s)
                break
        else:
            out.append([s])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", nargs="+", choices=sorted(BY_NAME), default=None, help="these scenarios only")
    p.add_argument("--short", action="store_true", help="the short version (CI): one round each")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mixed-s", type=float, default=None, help="seconds of the mixed scenario")
    p.add_argument("--out", default="benchmarks/results/chaos", help="where chaos.json, chaos.txt and logs go")
    args = p.parse_args(argv)
    chosen = [BY_NAME[n] for n in args.scenario] if args.scenario else [s for s in SCENARIOS
                                                                        if s.short or not args.short]
    scale = SHORT if args.short else FULL
    if args.mixed_s is not None:
        from dataclasses import replace

        scale = replace(scale, mixed_s=args.mixed_s)
    out = pathlib.Path(args.out)
    results: list[Result] = []
    t0 = time.monotonic()
    for group in sessions(chosen, args.short):
        print(f"chaos: session {', '.join(s.name for s in group)} ...", flush=True)
        t1 = time.monotonic()
        results += run_session(group, scale, args.seed, out)
        print(f"chaos: session took {time.monotonic() - t1:.0f} s", flush=True)
        for r in results[-len(group):]:
            state = "ok" if r.ok else ("ERROR " + r.error.splitlines()[-1] if r.error else
                                        "FAILED " + ", ".join(r.checks_failed))
            print(f"chaos:   {r.scenario}: {r.operations} ops, {r.acknowledged} acked, {r.lost} lost, "
                  f"{r.applied_twice} twice, stall max {r.stall_max_s}: {state}", flush=True)
    text = report(results, out, {"seed": args.seed, "short": args.short, "seconds": round(time.monotonic() - t0, 1)})
    print()
    print(text)
    print(f"\nwrote {out / 'chaos.json'} and {out / 'chaos.txt'} ({time.monotonic() - t0:.0f} s)")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
