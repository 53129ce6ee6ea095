#!/usr/bin/env python3
"""Per-kernel account of `lmhead-bench sweep` cases profiled by ncu (docs/PERFORMANCE.md, *How to
reproduce*: the per-shape command, one `== <case>` line before each case's output).

    python3 bench/scripts/ncu_table.py ncu.txt [ncu2.txt ...] [sweep.jsonl ...] > table.md
    python3 bench/scripts/ncu_table.py --compact ncu.txt [ncu2.txt ...] [sweep.jsonl ...] > per-shape.md
    python3 bench/scripts/ncu_table.py --cases sweep.jsonl ... > ncu-cases.txt

Arguments ending in `.jsonl` are sweep records, the others ncu outputs; a case profiled again in a
later ncu output replaces the earlier profile in its place (a re-profiled subset over a whole run).

`--cases`: the names of the sweep cases whose cuBLAS GEMM took at least 12 ms in the records
given (one case per local shape, the latest record's, cheapest first): the input of
`run-gpu.sh ncu` (`NCU_CASES`).

For each case: the cuBLAS GEMM (`nvjet`), the forward, the forward with entropy, and one full
vocab chunk of the d-logits, `dh` and `dW` (the profiled group of each kernel with the most
invocations, then the largest grid). Columns: time (ms, under ncu, clocks not controlled), time
per FLOP against the GEMM's (a chunk kernel does `chunk / v` of the GEMM's FLOP), the account
`(GEMM clock / clock) · (GEMM tensor pipe / tensor pipe) · (GEMM SMs active / SMs active)`, SM
clock, SMs active, tensor pipe busy over active cycles, L2 throughput (hit rate), DRAM throughput,
and the factors more than a point (or 30 MHz) below cuBLAS's (DRAM when at least 35% and twice
cuBLAS's). Then per kernel the median and range over the cases, and per case the sum of the
training step's kernels (forward with entropy, d-logits, `dh`, `dW`) per FLOP in time and in SM
cycles (time × clock: what the sum would be if every kernel ran at the GEMM's clock) beside the
step's ratio in the steady state (`fwd_bwd / gemm` of the sweep records given, by shape), and
per case `dh`'s and `dW`'s SMs active against the whole-tile wave bound
`tiles / (132 · ⌈tiles / 132⌉)`.

`--compact`: one row per case instead (docs/PERFORMANCE.md's per-shape table): the GEMM's time,
each kernel's time per FLOP, the forward's three factors (clock, SMs active, tensor pipe: the
GEMM's over the forward's), its DRAM throughput, the step's kernels summed in cycles, and the
step in the bench.
"""
import json
import re
import statistics
import sys

KINDS = [
    ("cuBLAS", lambda n: n.startswith("nvjet")),
    ("fwd", lambda n: n.startswith("lm_head_fwd_t")),
    ("fwd+ent", lambda n: n.startswith("lm_head_fwd_ent_t")),
    ("d-logits", lambda n: n.startswith("lm_head_bwd_dlogits")),
    ("dh", lambda n: n.startswith("lm_head_bwd_dh")),
    ("dW", lambda n: n.startswith("lm_head_bwd_dw")),
]
METRICS = {
    "gpu__time_duration.sum": "ms",
    "sm__cycles_elapsed.avg.per_second": "clk",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor",
    "sm__cycles_active.avg.pct_of_peak_sustained_elapsed": "active",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2",
    "lts__t_sector_hit_rate.pct": "hit",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram",
}
# Durations in milliseconds.
TIME_UNITS = {"s": 1e3, "ms": 1.0, "us": 1e-3, "ns": 1e-6}
GROUP = re.compile(r"^  (\S+) \((\d+), (\d+), 1\)x\(\d+, 1, 1\).*Invocations (\d+)")


def cases(text):
    for block in re.split(r"^== ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        row = re.search(r"^\| " + re.escape(name.strip()) + r" \| (\d+) \| (\d+) \| (\d+) \|(.*)\|$", body, re.M)
        groups, cur = [], None
        for line in body.splitlines():
            m = GROUP.match(line)
            if m:
                cur = {"name": m[1], "grid": int(m[2]) * int(m[3]), "inv": int(m[4])}
                groups.append(cur)
                continue
            f = line.split()
            if cur is not None and len(f) >= 5 and f[0] in METRICS:
                # ncu picks a duration's unit per value (`ms`, or `us` for short kernels).
                cur[METRICS[f[0]]] = float(f[-1].replace(",", "")) * TIME_UNITS.get(f[1], 1.0)
        if row and groups:
            t, v, d = int(row[1]), int(row[2]), int(row[3])
            ch = re.search(r"chunk (\d+)", row[4])
            yield name.strip(), (t, v, d, int(ch[1]) if ch else v), groups


def merged(texts):
    """The `== <case>` blocks of several ncu outputs as one text, in the order of first appearance,
    each case's block from the last output that profiled it."""
    blocks = {}
    for text in texts:
        for block in re.split(r"^== ", text, flags=re.M)[1:]:
            blocks[block.partition("\n")[0].strip()] = block
    return "".join("== " + b for b in blocks.values())


def pick(groups, test):
    g = [x for x in groups if test(x["name"]) and "ms" in x]
    return max(g, key=lambda x: (x["inv"], x["grid"])) if g else None


def table(text):
    out = [
        "| shape (t × v × d), chunk | kernel | ms | × GEMM per FLOP | account | SM clock | SMs active | tensor pipe | L2 (hit) | DRAM | limit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    summary, sums, compact = [], [], []
    for case, (t, v, d, chunk), groups in cases(text):
        k = {kind: pick(groups, test) for kind, test in KINDS}
        g = k["cuBLAS"]
        if g is None:
            continue
        first = True
        step, cycles = 0.0, 0.0
        per = {}
        for kind, _ in KINDS:
            x = k[kind]
            if x is None:
                continue
            share = 1.0 if kind in ("cuBLAS", "fwd", "fwd+ent") else chunk / v
            per_flop = x["ms"] / (g["ms"] * share)
            factors = (g["clk"] / x["clk"], g["active"] / x["active"], g["tensor"] / x["tensor"])
            acct = factors[0] * factors[1] * factors[2]
            per[kind] = (per_flop, factors, x)
            lim = []
            if kind != "cuBLAS":
                if g["clk"] - x["clk"] >= 0.03:
                    lim.append(f"clock −{round(100 * (1 - x['clk'] / g['clk']))}%")
                if g["active"] - x["active"] > 1:
                    lim.append(f"idle SMs −{g['active'] - x['active']:.1f}%")
                if g["tensor"] - x["tensor"] > 1:
                    lim.append(f"tensor −{round(g['tensor'] - x['tensor'])}%")
                if x["dram"] >= 35 and x["dram"] >= 2 * g["dram"]:
                    lim.append("DRAM")
                summary.append((kind, per_flop, lim))
                if kind != "fwd":
                    step += per_flop
                    cycles += per_flop * x["clk"] / g["clk"]
            shape = f"{t} × {v} × {d}, {chunk}" if first else ""
            first = False
            out.append(
                f"| {shape} | {kind} | {x['ms']:.2f} | {per_flop:.2f} | {acct:.2f} | {x['clk']:.2f} | {x['active']:.1f}% "
                f"| {x['tensor']:.1f}% | {x['l2']:.0f}% ({x['hit']:.0f}%) | {x['dram']:.0f}% | {', '.join(lim)} |"
            )
        sums.append(((t, v, d, chunk), step, cycles))
        compact.append(((t, v, d, chunk), g, per, cycles))
    return out, summary, sums, compact


def wave_rows(compact, slots=132):
    """`dh` and `dW`: SMs active against the whole-tile wave bound `tiles / (slots · ⌈tiles /
    slots⌉)` (each block's tiles run the full K, so no tile-granular schedule beats it)."""
    out = [
        "| local t × v × d (chunk) | `dh` tiles | bound | SMs active | `dW` tiles | bound | SMs active |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (t, v, d, chunk), _, per, _ in compact:
        cells = []
        for kind, rows in (("dh", t), ("dW", chunk)):
            x = per.get(kind)
            m = x and re.search(r"_m(\d+)_n(\d+)_", x[2]["name"])
            if not m:
                cells += ["–"] * 3
                continue
            tiles = -(-rows // int(m[1])) * -(-d // int(m[2]))
            bound = 100 * tiles / (slots * -(-tiles // slots))
            cells += [str(tiles), f"{bound:.1f}%", f"{x[2]['active']:.1f}%"]
        out.append(f"| {t} × {v} × {d} ({chunk}) | " + " | ".join(cells) + " |")
    return out


def compact_rows(compact, bench):
    """One row per shape: the GEMM, each kernel's time per FLOP, the forward's account factors."""
    out = [
        "| local t × v × d (chunk) | GEMM ms (ncu) | fwd | fwd: clock · SMs · tensor | fwd DRAM | fwd+ent | d-logits | `dh` | `dW` | Σ step, cycles | step (bench) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (t, v, d, chunk), g, per, cycles in compact:
        cell = lambda k: f"{per[k][0]:.2f}" if k in per else "–"
        fwd = per.get("fwd")
        acct = " · ".join(f"{f:.3f}" if i else f"{f:.2f}" for i, f in enumerate(fwd[1])) if fwd else "–"
        dram = f"{fwd[2]['dram']:.0f}%" if fwd else "–"
        b = bench.get((t, v, d))
        out.append(
            f"| {t} × {v} × {d} ({chunk}) | {g['ms']:.1f} | {cell('fwd')} | {acct} | {dram} | {cell('fwd+ent')} | {cell('d-logits')} "
            f"| {cell('dh')} | {cell('dW')} | {cycles:.2f} | {f'{b:.2f}' if b is not None else '–'} |"
        )
    return out


def records(files):
    """The latest sweep record per local shape `(t, v, d)` in `files`."""
    rows = {}
    for f in files:
        for line in open(f):
            if line.strip():
                r = json.loads(line)["row"]
                c = r["case"]
                rows[(c["t"], c["v"], c["d"])] = r
    return rows


def large_cases(files, min_gemm_ms=12.0):
    """The case names of the shapes whose GEMM took at least `min_gemm_ms`, cheapest first."""
    big = sorted((r["gemm"]["p50"], r["case"]) for r in records(files).values() if r["gemm"]["p50"] >= min_gemm_ms)
    return [f"{c['model']}/tok{c['tokens'] // 1024}k/tp{c['tp']}cp{c['cp']}" for _, c in big]


def main():
    if sys.argv[1] == "--cases":
        print("\n".join(large_cases(sys.argv[2:])))
        return
    compact_only = sys.argv[1] == "--compact"
    args = sys.argv[2:] if compact_only else sys.argv[1:]
    text = merged(open(a).read() for a in args if not a.endswith(".jsonl"))
    rows, summary, sums, compact = table(text)
    bench = {k: r["fwd_bwd"]["p50"] / r["gemm"]["p50"] for k, r in records([a for a in args if a.endswith(".jsonl")]).items()}
    if compact_only:
        print("\n".join(compact_rows(compact, bench)))
        return
    print("\n".join(rows))
    print()
    print("| kernel | shapes | median × GEMM per FLOP | range | clock low | SMs idle | tensor low | DRAM |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, _ in KINDS[1:]:
        s = [x for x in summary if x[0] == kind]
        if not s:
            continue
        r = sorted(x[1] for x in s)
        med = statistics.median(r)
        cnt = lambda p: sum(any(l.startswith(p) for l in x[2]) for x in s)
        print(f"| {kind} | {len(s)} | {med:.2f} | {r[0]:.2f}–{r[-1]:.2f} | {cnt('clock')} | {cnt('idle')} | {cnt('tensor')} | {cnt('DRAM')} |")
    print()
    print("\n".join(wave_rows(compact)))
    if bench:
        print()
        print("| shape (t × v × d), chunk | Σ step kernels, time per FLOP (ncu) | the same in cycles | step in the bench | bench − cycles |")
        print("|---|---:|---:|---:|---:|")
        for (t, v, d, chunk), step, cycles in sums:
            b = bench.get((t, v, d))
            if b is not None:
                print(f"| {t} × {v} × {d}, {chunk} | {step:.2f} | {cycles:.2f} | {b:.2f} | {b - cycles:+.2f} |")


if __name__ == "__main__":
    main()
