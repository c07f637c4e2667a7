"""``python -m perf [decode|prefill|append ...]``: run the perf cases, print a table, write
perf/out/results.{json,csv}. Shapes come from VKATTN_PERF_* (see perf/common.py)."""
from __future__ import annotations

import sys

import vkattn

from . import append, decode, prefill
from .common import PerfConfigError, Shape, print_table, write_results

SCRIPTS = {"decode": decode, "prefill": prefill, "append": append}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = argv or list(SCRIPTS)
    bad = [n for n in names if n not in SCRIPTS]
    if bad:
        print(f"unknown perf script(s) {bad}; choose from {list(SCRIPTS)}", file=sys.stderr)
        return 2
    try:
        shape = Shape.from_env()
        device = vkattn.default_device()
        rows = []
        for n in names:
            rows += SCRIPTS[n].run(shape, device)
    except PerfConfigError as e:
        print(f"perf: {e}", file=sys.stderr)
        return 2
    print_table(rows, device.name)
    out = write_results(rows, device.name)
    print(f"\nresults: {out}/results.json, {out}/results.csv")
    return 0 if all(r.verified for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
