#!/usr/bin/env python3
"""Two builds of the library timed on the same shapes: per suite and operation, the median over
the shapes of new / base, the range and the shape count (docs/PERFORMANCE.md, *The launch rules
against the build before them*).

    python3 bench/scripts/builds_ab.py --base COMMIT[,COMMIT...] records.jsonl [more.jsonl ...]

Records are `lmhead-bench` lines (`quick`, `peers`, `sweep`); those whose `commit` is one of the
COMMITs are the base, every other commit is "new". Per shape (suite, case) and build, the median of the
records' `p50`s is taken (a shape timed twice per build, as in base, new, new, base, gives two);
a shape is compared where both builds timed it. Ratios are of times, not of × GEMM: both
builds' GEMMs are cuBLAS's, and each build's own GEMM column shows how much the machine moved
between the runs (its median ratio is printed beside the operations').
"""
import argparse
import json
import statistics
from collections import defaultdict

OPS = ("gemm", "fwd", "fwd_ent", "fwd_bwd")


def case_key(c):
    return (c["model"], c["tokens"], c["tp"], c["cp"], c["t"], c["v"], c["d"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the base build's commit(s) as recorded, comma-separated")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    base = set(a.base.split(","))
    times = defaultdict(lambda: defaultdict(list))  # (suite, case) -> (build, op) -> [ms]
    for path in a.files:
        for line in open(path):
            if not line.strip():
                continue
            r = json.loads(line)
            if "row" not in r:
                continue
            build = "base" if r["commit"] in base else "new"
            key = (r["suite"], case_key(r["row"]["case"]))
            for op in OPS:
                t = r["row"].get(op)
                if t:
                    times[key][(build, op)].append(t["p50"])
    suites = sorted({s for s, _ in times})
    print("| suite | shapes | " + " | ".join(f"{op} new/base" for op in OPS) + " |")
    print("|---|---:|" + "---:|" * len(OPS))
    for suite in suites:
        cells, n = [], 0
        for op in OPS:
            rs = [
                statistics.median(t[("new", op)]) / statistics.median(t[("base", op)])
                for (s, _), t in times.items()
                if s == suite and t.get(("new", op)) and t.get(("base", op))
            ]
            n = max(n, len(rs))
            cells.append(f"{statistics.median(rs):.3f} ({min(rs):.2f}–{max(rs):.2f})" if rs else "–")
        if n:
            print(f"| {suite} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
