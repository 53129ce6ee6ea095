#!/usr/bin/env python3
"""Side-by-side table of `run-gpu.sh plans` records (docs/GPU.md): per sweep case, the library's
own runs and each variant's (a forced forward plan, a forced chunk width, environment variables).

    python3 bench/scripts/plans_ab.py [--min-step-ms MS] plans.jsonl [more.jsonl ...] > ab.md

A record's variant is named by its `plan_overrides` (`LMHEAD_` left out, sorted), its
`bwd_chunk` and its `dw_after_dh`; a record with none of them is the library's. Per case and
variant: the number of runs, the forward, the forward with entropy and forward+backward as × the
cuBLAS GEMM of the same run (each the median over the variant's runs of `p50 / gemm p50`), the
step's median time in ms, and
against the library's runs of that case: the step's change in × GEMM and in time. Then per variant
name, over the cases that ran it: the median and range of those two changes and how many cases
the variant's step was faster in time. The × GEMM change is the bench's measure; the time change
is shown beside it because at small shapes the GEMM's own time moves between processes.
`--min-step-ms MS`: the summary leaves out cases whose library step took less than MS (median).
"""
import json
import statistics
import sys
from collections import OrderedDict


def variant(rec):
    ov = rec.get("plan_overrides") or {}
    parts = [f"{k.removeprefix('LMHEAD_')}={v}" for k, v in sorted(ov.items())]
    if "bwd_chunk" in rec:
        parts.append(f"chunk={rec['bwd_chunk']}")
    if rec.get("dw_after_dh"):
        parts.append("dw-after-dh")
    return ",".join(parts) or "library"


def case_name(c):
    return f"{c['model']}/tok{c['tokens'] // 1024}k/tp{c['tp']}cp{c['cp']}"


def main(paths, min_step_ms=0.0):
    cases = OrderedDict()
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                row = rec["row"]
                c = row["case"]
                key = (case_name(c), c["t"], c["v"], c["d"])
                g = row["gemm"]["p50"]
                ratio = lambda op: row[op]["p50"] / g if row.get(op) else None
                runs = cases.setdefault(key, OrderedDict()).setdefault(variant(rec), [])
                runs.append((ratio("fwd"), ratio("fwd_ent"), ratio("fwd_bwd"), row["fwd_bwd"]["p50"] if row.get("fwd_bwd") else None))

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    fmt = lambda x, f="{:.3f}": "–" if x is None else f.format(x)
    print("| case (t × v × d) | variant | runs | fwd | fwd+ent | fwd+bwd | step ms | Δ × GEMM | Δ time |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    changes = OrderedDict()
    for (name, t, v, d), variants in cases.items():
        base = variants.get("library")
        b_step, b_ms = (med(r[2] for r in base), med(r[3] for r in base)) if base else (None, None)
        for var, runs in variants.items():
            step, ms = med(r[2] for r in runs), med(r[3] for r in runs)
            dx = dt = None
            if var != "library" and b_step is not None and step is not None:
                dx, dt = step - b_step, ms / b_ms - 1
                if b_ms >= min_step_ms:
                    changes.setdefault(var, []).append((dx, dt))
            print(
                f"| {name} ({t} × {v} × {d}) | {var} | {len(runs)} | {fmt(med(r[0] for r in runs))} | "
                f"{fmt(med(r[1] for r in runs))} | {fmt(med(r[2] for r in runs))} | {fmt(ms, '{:.1f}')} | "
                f"{fmt(dx, '{:+.3f}')} | {fmt(None if dt is None else 100 * dt, '{:+.1f}%')} |"
            )
    if changes:
        print()
        print("| variant | cases | Δ × GEMM median (range) | Δ time median (range) | faster in time |")
        print("|---|---:|---|---|---:|")
        for var, xs in changes.items():
            dx = [x for x, _ in xs]
            dt = [100 * t for _, t in xs]
            print(
                f"| {var} | {len(xs)} | {statistics.median(dx):+.3f} ({min(dx):+.3f} … {max(dx):+.3f}) | "
                f"{statistics.median(dt):+.1f}% ({min(dt):+.1f}% … {max(dt):+.1f}%) | {sum(t < 0 for t in dt)} of {len(dt)} |"
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    min_ms = 0.0
    if args[:1] == ["--min-step-ms"] and len(args) >= 2:
        min_ms, args = float(args[1]), args[2:]
    if not args:
        sys.exit(__doc__)
    main(args, min_ms)
