"""``python -m tests.lab sweep [--all]``: remove what labs left behind (of dead owners; ``--all``: every lab's).
``python -m tests.lab check``: say whether a lab can be made here, and why not."""

from __future__ import annotations

import argparse
import sys

from tests.lab.netns import sweep, why_unavailable


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.lab", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="remove labs' leftovers (namespaces, mounts, loop devices, processes)")
    s.add_argument("--all", action="store_true", help="every lab's, running ones included")
    sub.add_parser("check", help="can a lab be made here?")
    args = p.parse_args()
    if args.cmd == "check":
        reason = why_unavailable()
        print(reason or "a lab can be made here")
        return 1 if reason else 0
    found = sweep(everything=args.all)
    for kind, items in found.items():
        for item in items:
            print(f"removed {'netns' if kind == 'netns' else kind[:-1]}: {item}")
    if not any(found.values()):
        print("nothing to sweep")
    return 0


if __name__ == "__main__":
    sys.exit(main())
