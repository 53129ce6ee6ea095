//! Tables of the results that are not per-shape bench rows: the tuning-cost probe
//! (`lmhead-bench probe`), tensor parallelism (`lmhead-bench tp`), the PyTorch package's bench
//! (`python -m lmhead_torch.bench`) and the per-kernel profile (`bench/scripts/ncu_table.py`'s
//! markdown). Each has one view, the default.

use std::fmt::Write as _;

use lmhead_core::record::TpRow;
use serde::Deserialize;
use serde_json::Value;

use super::{counted, median, median_range, x, Source};

/// JSON lines of all of the suite's files, each with the file and line it came from.
fn lines(src: &Source) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for (f, t) in src.files.iter().zip(&src.texts) {
        for (i, l) in t.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            out.push(serde_json::from_str(l).map_err(|e| format!("{f}:{}: {e}", i + 1))?);
        }
    }
    if out.is_empty() {
        return Err(format!("{}: no records", src.file_list()));
    }
    Ok(out)
}

fn only_default(src: &Source, view: &str) -> Result<(), String> {
    match view {
        "" => Ok(()),
        v => Err(format!("suite `{}`: no view `{v}` (its records make one table)", src.suite)),
    }
}

fn text<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("not recorded")
}

/// One record of `lmhead-bench probe`: a training step in a fresh process state.
#[derive(Deserialize)]
struct Probe {
    model: String,
    step: String,
    tokens: usize,
    v: usize,
    d: usize,
    wall_ms: f64,
    tuning: Vec<ProbeTuning>,
}

#[derive(Deserialize)]
struct ProbeTuning {
    family: String,
    how: String,
    seconds: f64,
}

/// `48 µs` as `0.05 ms`, `0.21` as `210 ms`, `1.5` as `1.50 s`.
fn seconds(s: f64) -> String {
    match s {
        s if s >= 1.0 => format!("{s:.2} s"),
        s if s >= 0.01 => format!("{:.0} ms", s * 1e3),
        s => format!("{:.2} ms", s * 1e3),
    }
}

/// Tuning cost: per head and step, the step's wall time and each family's tuning.
pub fn probe(src: &Source, view: &str) -> Result<String, String> {
    only_default(src, view)?;
    let vs = lines(src)?;
    let mut s = String::new();
    let _ = writeln!(s, "| head (v × d) | step | tokens | wall ms | tuning per family (how) |");
    let _ = writeln!(s, "|---|---|---:|---:|---|");
    let mut most: f64 = 0.0;
    for v in &vs {
        let p: Probe = serde_json::from_value(v.clone()).map_err(|e| format!("{}: a probe record: {e}", src.file_list()))?;
        let t: Vec<String> = p.tuning.iter().map(|f| format!("{} {} ({})", f.family, seconds(f.seconds), f.how)).collect();
        most = most.max(p.tuning.iter().map(|f| f.seconds).sum());
        let _ = writeln!(s, "| {} ({} × {}) | {} | {} | {:.1} | {} |", p.model, p.v, p.d, p.step, p.tokens, p.wall_ms, t.join(", "));
    }
    let _ = write!(
        s,
        "\nThe most one step spent tuning (all its families): {}. {} on {}, commit {}; records {}.",
        seconds(most),
        if vs.len() == 1 { "1 step".to_string() } else { format!("{} steps", vs.len()) },
        counted(vs.iter().map(|v| text(v, "gpu")), "step"),
        counted(vs.iter().map(|v| text(v, "commit")), "step"),
        src.file_list()
    );
    Ok(s)
}

/// Tensor parallelism: per head, TP = 1 and each TP measured, with the speed-up over TP = 1.
pub fn tp(src: &Source, view: &str) -> Result<String, String> {
    only_default(src, view)?;
    let vs = lines(src)?;
    let mut rows: Vec<TpRow> = Vec::new();
    for v in &vs {
        let r = v.get("tp_row").cloned().ok_or_else(|| format!("{}: a record without `tp_row`", src.file_list()))?;
        rows.push(serde_json::from_value(r).map_err(|e| format!("{}: a tp record: {e}", src.file_list()))?);
    }
    let mut s = String::new();
    let _ = writeln!(s, "| head (tokens × v × d) | TP | v local | GEMM local ms | fused × GEMM | fwd+entropy ms (× TP 1) | fwd+bwd ms (× TP 1) | all-reduce ms, fwd / fwd+bwd |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let one = rows.iter().find(|o| o.tp == 1 && o.model == r.model && o.tokens == r.tokens);
        let speedup = |ms: f64, of: fn(&TpRow) -> f64| match one {
            Some(o) if r.tp > 1 => format!("{ms:.3} ({})", x(of(o) / ms)),
            _ => format!("{ms:.3}"),
        };
        let ar = if r.tp > 1 { format!("{:.3} / {:.3}", r.ar_fwd.p50, r.ar_fwd_bwd.p50) } else { "–".into() };
        let _ = writeln!(
            s,
            "| {} ({} × {} × {}) | {} | {} | {:.3} | {} | {} | {} | {ar} |",
            r.model,
            r.tokens,
            r.v_total,
            r.d,
            r.tp,
            r.v_local,
            r.gemm.p50,
            x(r.fused.p50 / r.gemm.p50),
            speedup(r.fwd_ent.p50, |o| o.fwd_ent.p50),
            speedup(r.fwd_bwd.p50, |o| o.fwd_bwd.p50),
        );
    }
    let gpus = vs.iter().filter_map(|v| v.get("gpus").and_then(Value::as_u64)).max().unwrap_or(1);
    let _ = write!(
        s,
        "\nUp to {gpus} GPUs of {}, one rank per GPU over NCCL; commit {}; records {}.",
        counted(vs.iter().map(|v| text(v, "gpu")), "row"),
        counted(vs.iter().map(|v| text(v, "commit")), "row"),
        src.file_list()
    );
    Ok(s)
}

/// The PyTorch package against the other implementations of the same shapes, in one process.
pub fn torch(src: &Source, view: &str) -> Result<String, String> {
    only_default(src, view)?;
    let vs = lines(src)?;
    let mut shapes: Vec<(u64, u64, u64)> = Vec::new();
    let key = |v: &Value| {
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        (n("t"), n("v"), n("d"))
    };
    for v in &vs {
        if !shapes.contains(&key(v)) {
            shapes.push(key(v));
        }
    }
    let get =
        |shape: (u64, u64, u64), imp: &str| vs.iter().find(|v| key(v) == shape && text(v, "impl") == imp && v.get("fwd_ms").is_some());
    let others: Vec<&str> =
        ["torch", "torch-chunked", "verl", "liger"].into_iter().filter(|i| shapes.iter().any(|&k| get(k, i).is_some())).collect();
    let ms = |v: Option<&Value>| match v {
        Some(v) => format!("{:.2} / {:.2}", v["fwd_ms"].as_f64().unwrap_or(f64::NAN), v["fwd_bwd_ms"].as_f64().unwrap_or(f64::NAN)),
        None => "–".into(),
    };
    let mut s = String::new();
    let _ = write!(s, "| t × v × d | lmhead |");
    for o in &others {
        let _ = write!(s, " {o} |");
    }
    let _ = writeln!(s, " fwd+bwd, torch / lmhead | peak memory, lmhead / torch | binding overhead µs, fwd / bwd |");
    let _ = writeln!(s, "|---|---:|{}---:|---:|---:|", "---:|".repeat(others.len()));
    for &k in &shapes {
        let Some(ours) = get(k, "lmhead") else { continue };
        let _ = write!(s, "| {} × {} × {} | {} |", k.0, k.1, k.2, ms(Some(ours)));
        for o in &others {
            let _ = write!(s, " {} |", ms(get(k, o)));
        }
        let f = |v: &Value, f: &str| v.get(f).and_then(Value::as_f64);
        let eager = get(k, "torch");
        let speed = eager.and_then(|e| Some(f(e, "fwd_bwd_ms")? / f(ours, "fwd_bwd_ms")?)).map(x).unwrap_or_else(|| "–".into());
        let mem = eager
            .and_then(|e| Some(f(ours, "peak_fwd_bwd_bytes")? / f(e, "peak_fwd_bwd_bytes")?))
            .map(|r| format!("{r:.2}"))
            .unwrap_or_else(|| "–".into());
        let over = match (f(ours, "overhead_fwd_us"), f(ours, "overhead_bwd_us")) {
            (Some(a), Some(b)) => format!("{a:.0} / {b:.0}"),
            _ => "–".into(),
        };
        let _ = writeln!(s, " {speed} | {mem} | {over} |");
    }
    let header = |k: &str| {
        counted(vs.iter().map(|v| v.get("header").and_then(|h| h.get(k)).and_then(Value::as_str).unwrap_or("not recorded")), "record")
    };
    let _ = write!(
        s,
        "\nForward (with entropy) / forward+backward ms, medians. On {}, torch {}, commit {}; records {}.",
        header("gpu"),
        header("torch"),
        counted(vs.iter().map(|v| text(v, "commit")), "record"),
        src.file_list()
    );
    Ok(s)
}

/// One kernel row of `ncu_table.py`'s per-kernel table.
struct NcuRow {
    kernel: String,
    per_flop: f64,
    clock: f64,
    sms: f64,
    tensor: f64,
    dram: f64,
}

/// Per shape its cuBLAS row and kernel rows; per shape the step's (cycles, bench) ratios.
type NcuTables = (Vec<(NcuRow, Vec<NcuRow>)>, Vec<(f64, f64)>);

/// `97.5%` → 97.5; `1.54` → 1.54.
fn number(cell: &str) -> Option<f64> {
    cell.trim().trim_end_matches('%').parse().ok()
}

/// The per-kernel table of the markdown (header `| shape … | kernel | ms | × GEMM per FLOP |
/// account | SM clock | SMs active | tensor pipe | L2 (hit) | DRAM | limit |`), as (shape,
/// cuBLAS row, kernel rows) groups, and the step table's (cycles, bench) pairs.
fn ncu_tables(md: &str) -> Result<NcuTables, String> {
    let (mut groups, mut steps) = (Vec::new(), Vec::new());
    let mut table = "";
    for l in md.lines() {
        if !l.starts_with('|') {
            table = "";
            continue;
        }
        let cells: Vec<&str> = l.trim().trim_matches('|').split('|').map(str::trim).collect();
        if cells.get(1) == Some(&"kernel") && cells.get(3) == Some(&"× GEMM per FLOP") {
            table = "kernels";
        } else if cells.get(2) == Some(&"the same in cycles") {
            table = "steps";
        } else if cells[0].starts_with("---") {
        } else if table == "kernels" && cells.len() >= 10 {
            let bad = || format!("ncu table: a row that does not parse: {l}");
            let row = NcuRow {
                kernel: cells[1].to_string(),
                per_flop: number(cells[3]).ok_or_else(bad)?,
                clock: number(cells[5]).ok_or_else(bad)?,
                sms: number(cells[6]).ok_or_else(bad)?,
                tensor: number(cells[7]).ok_or_else(bad)?,
                dram: number(cells[9]).ok_or_else(bad)?,
            };
            if row.kernel == "cuBLAS" {
                groups.push((row, Vec::new()));
            } else {
                groups.last_mut().ok_or_else(|| format!("ncu table: a kernel row before any cuBLAS row: {l}"))?.1.push(row);
            }
        } else if table == "steps" && cells.len() >= 4 {
            steps.push((number(cells[2]).unwrap_or(f64::NAN), number(cells[3]).unwrap_or(f64::NAN)));
        }
    }
    if groups.is_empty() {
        return Err("ncu table: no per-kernel table (`| … | kernel | ms | × GEMM per FLOP | …`)".into());
    }
    Ok((groups, steps))
}

/// Per kernel, over the profiled shapes: time per FLOP against cuBLAS's GEMM and the three
/// factors (cuBLAS's clock, SMs active and tensor pipe over the kernel's) whose product is it.
pub fn ncu(src: &Source, view: &str) -> Result<String, String> {
    only_default(src, view)?;
    let mut groups = Vec::new();
    let mut steps = Vec::new();
    for (f, t) in src.files.iter().zip(&src.texts) {
        let (g, st) = ncu_tables(t).map_err(|e| format!("{f}: {e}"))?;
        groups.extend(g);
        steps.extend(st);
    }
    let mut kernels: Vec<&str> = Vec::new();
    for (_, ks) in &groups {
        for k in ks {
            if !kernels.contains(&k.kernel.as_str()) {
                kernels.push(&k.kernel);
            }
        }
    }
    let mut s = String::new();
    let _ = writeln!(s, "| kernel | shapes | time per FLOP × GEMM | clock | SMs active | tensor pipe | DRAM, % of peak |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    let f2 = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "–".into());
    for k in kernels {
        let of: Vec<(&NcuRow, &NcuRow)> =
            groups.iter().flat_map(|(g, ks)| ks.iter().filter(|r| r.kernel == k).map(move |r| (g, r))).collect();
        let col = |f: fn(&NcuRow, &NcuRow) -> f64| median(&of.iter().map(|(g, r)| f(g, r)).collect::<Vec<_>>());
        let dram: Vec<f64> = of.iter().map(|(_, r)| r.dram).collect();
        let _ = writeln!(
            s,
            "| {k} | {} | {} | {} | {} | {} | {:.0}% (up to {:.0}%) |",
            of.len(),
            median_range(&of.iter().map(|(_, r)| r.per_flop).collect::<Vec<_>>()),
            f2(col(|g, r| g.clock / r.clock)),
            f2(col(|g, r| g.sms / r.sms)),
            f2(col(|g, r| g.tensor / r.tensor)),
            median(&dram).unwrap_or(f64::NAN),
            dram.iter().copied().fold(0.0, f64::max),
        );
    }
    let cublas: Vec<f64> = groups.iter().map(|(g, _)| g.dram).collect();
    let _ = write!(
        s,
        "\nMedians over {} shapes; clock, SMs active and tensor pipe are cuBLAS's over the kernel's (1.03: the kernel 3% short), \
         and their product reproduces the time per FLOP; cuBLAS's DRAM: {:.0}% (up to {:.0}%).",
        groups.len(),
        median(&cublas).unwrap_or(f64::NAN),
        cublas.iter().copied().fold(0.0, f64::max)
    );
    if !steps.is_empty() {
        let _ = write!(
            s,
            " The step's four kernels in SM cycles: {} one GEMM; the step in the bench: {}.",
            median_range(&steps.iter().map(|p| p.0).collect::<Vec<_>>()),
            median_range(&steps.iter().map(|p| p.1).collect::<Vec<_>>())
        );
    }
    let _ = write!(s, " From {} (`ncu --clock-control none`; GPU and commit in its header).", src.file_list());
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(name: &str, text: &str) -> Source {
        Source { suite: "s".into(), files: vec![format!("docs/results/{name}")], texts: vec![text.into()] }
    }

    #[test]
    fn probe_table() {
        let line = serde_json::json!({"commit": "c1", "d": 2048, "gpu": "NVIDIA H200", "model": "m", "step": "cold: new bucket", "suite": "probe",
            "timestamp": 1, "tokens": 20000, "v": 248320, "wall_ms": 145.04,
            "tuning": [{"family": "FwdEnt", "how": "table", "seconds": 4.8e-5}, {"family": "BwdDh", "how": "3 timed", "seconds": 0.21}]});
        let t = probe(&source("probe.jsonl", &line.to_string()), "").unwrap();
        assert!(
            t.contains("| m (248320 × 2048) | cold: new bucket | 20000 | 145.0 | FwdEnt 0.05 ms (table), BwdDh 210 ms (3 timed) |"),
            "{t}"
        );
        assert!(t.contains("The most one step spent tuning (all its families): 210 ms. 1 step on NVIDIA H200, commit c1; records `docs/results/probe.jsonl`."), "{t}");
        assert_eq!((seconds(1.5), seconds(0.0123), seconds(4.8e-5)), ("1.50 s".into(), "12 ms".into(), "0.05 ms".into()));
        assert!(probe(&source("probe.jsonl", &line.to_string()), "summary").unwrap_err().contains("no view `summary`"));
    }

    #[test]
    fn tp_speedup_over_one_gpu() {
        let timing = |x: f64| serde_json::json!({"p20": x, "p50": x, "p80": x});
        let row = |tp: usize, gemm: f64, fwd: f64, bwd: f64| {
            serde_json::json!({"commit": "c", "gpu": "NVIDIA H200", "gpus": tp, "suite": "tp", "tp_row": {
                "model": "m", "tokens": 8192, "v_total": 1000, "d": 512, "tp": tp, "v_local": 1000 / tp,
                "gemm": timing(gemm), "fused": timing(gemm * 1.05), "fwd_ent": timing(fwd), "fwd_lp": timing(fwd), "fwd_bwd": timing(bwd),
                "ar_fwd": timing(0.5), "ar_fwd_bwd": timing(2.0), "per_rank_fwd_ent": [fwd], "fwd_ent_cfg": "x", "check_max_abs": null}})
            .to_string()
        };
        let text = [row(1, 10.0, 10.4, 42.0), row(2, 5.0, 5.2, 22.0)].join("\n");
        let t = tp(&source("tp.jsonl", &text), "").unwrap();
        assert!(t.contains("| m (8192 × 1000 × 512) | 1 | 1000 | 10.000 | 1.05× | 10.400 | 42.000 | – |"), "{t}");
        assert!(t.contains("| m (8192 × 1000 × 512) | 2 | 500 | 5.000 | 1.05× | 5.200 (2.00×) | 22.000 (1.91×) | 0.500 / 2.000 |"), "{t}");
        assert!(t.contains("Up to 2 GPUs of NVIDIA H200, one rank per GPU over NCCL; commit c;"), "{t}");
    }

    #[test]
    fn torch_table_skips_absent_implementations() {
        let h = serde_json::json!({"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"});
        let rec = |imp: &str, fwd: f64, bwd: f64, peak: f64| {
            serde_json::json!({"t": 4096, "v": 32000, "d": 4096, "impl": imp, "fwd_ms": fwd, "fwd_bwd_ms": bwd, "peak_fwd_bwd_bytes": peak,
                "overhead_fwd_us": 112.09, "overhead_bwd_us": 36.7, "header": h})
            .to_string()
        };
        let skipped =
            serde_json::json!({"t": 4096, "v": 32000, "d": 4096, "impl": "verl", "skipped": "not importable", "header": h}).to_string();
        let text = [rec("lmhead", 1.49, 6.77, 5.0e8), rec("torch", 3.21, 8.88, 2.5e9), skipped].join("\n");
        let t = torch(&source("torch-bench.jsonl", &text), "").unwrap();
        let first = t.lines().next().unwrap();
        assert_eq!(
            first,
            "| t × v × d | lmhead | torch | fwd+bwd, torch / lmhead | peak memory, lmhead / torch | binding overhead µs, fwd / bwd |"
        );
        assert!(t.contains("| 4096 × 32000 × 4096 | 1.49 / 6.77 | 3.21 / 8.88 | 1.31× | 0.20 | 112 / 37 |"), "{t}");
        assert!(t.contains("On NVIDIA H200, torch 2.11.0+cu130, commit not recorded;"), "{t}");
    }

    #[test]
    fn ncu_factors_from_the_per_kernel_table() {
        let md = "# header\n\n\
            | shape (t × v × d), chunk | kernel | ms | × GEMM per FLOP | account | SM clock | SMs active | tensor pipe | L2 (hit) | DRAM | limit |\n\
            |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n\
            | 1 × 2 × 3, 8 | cuBLAS | 10.00 | 1.00 | 1.00 | 1.60 | 100.0% | 96.0% | 56% (80%) | 20% |  |\n\
            |  | fwd | 10.50 | 1.05 | 1.05 | 1.55 | 99.0% | 94.0% | 72% (78%) | 25% | clock −3% |\n\
            | 4 × 5 × 6, 8 | cuBLAS | 20.00 | 1.00 | 1.00 | 1.50 | 100.0% | 98.0% | 56% (80%) | 30% |  |\n\
            |  | fwd | 21.40 | 1.07 | 1.07 | 1.45 | 100.0% | 96.0% | 72% (78%) | 45% | clock −3% |\n\
            \n\
            | shape (t × v × d), chunk | Σ step kernels, time per FLOP (ncu) | the same in cycles | step in the bench | bench − cycles |\n\
            |---|---:|---:|---:|---:|\n\
            | 1 × 2 × 3, 8 | 4.22 | 4.16 | 4.15 | -0.01 |\n";
        let t = ncu(&source("ncu.md", md), "").unwrap();
        // Clock factors 1.60/1.55 = 1.032 and 1.50/1.45 = 1.034: median 1.033.
        assert!(t.contains("| fwd | 2 | 1.06× (1.05–1.07×) | 1.033 | 1.005 | 1.021 | 35% (up to 45%) |"), "{t}");
        assert!(t.contains("Medians over 2 shapes;"), "{t}");
        assert!(t.contains("cuBLAS's DRAM: 25% (up to 30%)."), "{t}");
        assert!(
            t.contains("The step's four kernels in SM cycles: 4.16× (4.16–4.16×) one GEMM; the step in the bench: 4.15× (4.15–4.15×)."),
            "{t}"
        );
        assert!(ncu(&source("ncu.md", "# nothing\n"), "").unwrap_err().contains("no per-kernel table"));
    }
}
