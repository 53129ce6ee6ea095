//! Tables of `lmhead-bench` records (`{gpu, driver, commit, suite, timestamp, tuning, row}`):
//! every time as a ratio to the cuBLAS bf16 GEMM of the same shape timed in the same run.
//!
//! Views (the word after the suite in a marker):
//! - `shapes` (the default, unless the records hold both tunings): one row per shape, cheapest
//!   GEMM first, with the library's workspace after the backward when it was timed;
//! - `summary`: median and range of each ratio per model, over the shapes whose GEMM takes at
//!   least [`LARGE_GEMM_MS`], and over all;
//! - `versus-fixed` (the default when the records hold autotuned and fixed-config runs): the
//!   autotuned run against the fixed configs timed in the same process, as latency reductions.
//!
//! Only autotuned records make the first two; the latest record of a shape wins.

use std::fmt::Write as _;

use super::super::markdown::reduction_table;
use super::super::{latest, pairs, parse, Record, Tuning};
use super::{counted, driver_text, median_range, x, Source};

/// Shapes whose GEMM takes at least this many milliseconds are the large ones (those the
/// per-kernel account profiles).
pub const LARGE_GEMM_MS: f64 = 12.0;

/// Every record of the suite's files, in order (a later file wins a tie of timestamps).
fn records(src: &Source) -> Result<Vec<Record>, String> {
    let mut all: Vec<Record> = Vec::new();
    for (f, t) in src.files.iter().zip(&src.texts) {
        let offset = all.last().map(|r| r.line).unwrap_or(0);
        let mut rs = parse(t).map_err(|e| format!("{f}: {e}"))?;
        for r in &mut rs {
            r.line += offset;
        }
        all.extend(rs);
    }
    if all.is_empty() {
        return Err(format!("{}: no records", src.file_list()));
    }
    Ok(latest(&all))
}

/// The autotuned records, cheapest GEMM (`t·v·d`) first.
fn auto_by_size(records: &[Record]) -> Vec<&Record> {
    let mut v: Vec<&Record> = records.iter().filter(|r| r.tuning == Tuning::Auto).collect();
    v.sort_by_key(|r| r.row.case.t as u128 * r.row.case.v as u128 * r.row.case.d as u128);
    v
}

/// The line under a table: GPU, driver, commits, files, and the log-prob check when it ran.
pub fn footer(src: &Source, rows: &[&Record]) -> String {
    let mut s = String::new();
    let drivers: Vec<String> = rows.iter().map(|r| driver_text(&r.driver)).collect();
    let commits = counted(rows.iter().map(|r| r.commit.as_str()), "shape");
    let _ = write!(
        s,
        "{} shapes on {}, driver {}, {} {commits}; records {}.",
        rows.len(),
        counted(rows.iter().map(|r| r.gpu.as_str()), "shape"),
        counted(drivers.iter().map(String::as_str), "shape"),
        if commits.contains(", ") { "commits" } else { "commit" },
        src.file_list()
    );
    let checked: Vec<f64> = rows.iter().filter_map(|r| r.row.check_max_abs).collect();
    if !checked.is_empty() {
        let worst = checked.iter().copied().fold(0.0, f64::max);
        let _ = write!(
            s,
            " Timed log-probs checked against the f64 reference on sampled rows at {} of them: largest error {worst:.1e}.",
            checked.len()
        );
    }
    s
}

/// The table of `src` in `view`.
pub fn render(src: &Source, view: &str) -> Result<String, String> {
    let records = records(src)?;
    let both = records.iter().any(|r| r.tuning == Tuning::Auto) && records.iter().any(|r| r.tuning != Tuning::Auto);
    match view {
        "" if both => versus_fixed(src, &records),
        "" | "shapes" => Ok(shapes(src, &records)),
        "summary" => Ok(summary(src, &records)),
        "versus-fixed" => versus_fixed(src, &records),
        v => Err(format!("suite `{}`: no view `{v}` (shapes, summary, versus-fixed)", src.suite)),
    }
}

/// Ratios of one record: forward, forward with entropy, forward+backward (if timed).
fn ratios(r: &Record) -> [Option<f64>; 3] {
    let (row, g) = (&r.row, r.row.gemm.p50);
    [Some(row.fwd.p50 / g), Some(row.fwd_ent.p50 / g), row.fwd_bwd.as_ref().map(|t| t.p50 / g)]
}

fn shapes(src: &Source, records: &[Record]) -> String {
    let rows = auto_by_size(records);
    let with_bwd = rows.iter().any(|r| r.row.fwd_bwd.is_some());
    let mut s = String::new();
    let _ = write!(s, "| shape (t × v × d) | case | GEMM ms | forward | forward + entropy |");
    let _ = writeln!(s, "{}", if with_bwd { " forward + backward | workspace MiB |" } else { "" });
    let _ = writeln!(s, "|---|---|---:|---:|---:|{}", if with_bwd { "---:|---:|" } else { "" });
    for r in &rows {
        let c = &r.row.case;
        let [f, e, b] = ratios(r);
        let _ = write!(
            s,
            "| {} × {} × {} | {} | {:.3} | {} | {} |",
            c.t,
            c.v,
            c.d,
            c.name(),
            r.row.gemm.p50,
            x(f.unwrap_or(0.0)),
            x(e.unwrap_or(0.0))
        );
        let bwd = match b {
            Some(b) => format!(" {} | {:.0} |", x(b), r.row.workspace_mib),
            None => " – | – |".into(),
        };
        let _ = writeln!(s, "{}", if with_bwd { bwd.as_str() } else { "" });
    }
    let _ = write!(s, "\n{}", footer(src, &rows));
    s
}

/// One row of the summary: a label and the records it covers.
fn summary_row(s: &mut String, label: &str, rows: &[&Record]) {
    let col = |k: usize| -> String {
        let xs: Vec<f64> = rows.iter().filter_map(|r| ratios(r)[k]).collect();
        median_range(&xs)
    };
    let _ = writeln!(s, "| {label} | {} | {} | {} | {} |", rows.len(), col(0), col(1), col(2));
}

fn summary(src: &Source, records: &[Record]) -> String {
    let rows = auto_by_size(records);
    let mut models: Vec<&str> = Vec::new();
    for r in &rows {
        if !models.contains(&r.row.case.model.as_str()) {
            models.push(&r.row.case.model);
        }
    }
    let mut s = String::new();
    let _ = writeln!(s, "| shapes | count | forward | forward + entropy | forward + backward |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|");
    for m in models {
        let of: Vec<&Record> = rows.iter().copied().filter(|r| r.row.case.model == m).collect();
        let c = &of[0].row.case;
        summary_row(&mut s, &format!("{m} (d {}, v {})", c.d, c.v * c.tp), &of);
    }
    let large: Vec<&Record> = rows.iter().copied().filter(|r| r.row.gemm.p50 >= LARGE_GEMM_MS).collect();
    if !large.is_empty() && large.len() < rows.len() {
        summary_row(&mut s, &format!("all with a GEMM ≥ {LARGE_GEMM_MS} ms"), &large);
    }
    summary_row(&mut s, "all", &rows);
    let _ = write!(s, "\nMedian (range) of the time over one GEMM's. {}", footer(src, &rows));
    s
}

fn versus_fixed(src: &Source, records: &[Record]) -> Result<String, String> {
    let all = pairs(records);
    if all.is_empty() {
        return Err(format!("suite `{}`: no shape was timed both autotuned and with fixed configs", src.suite));
    }
    let ps: Vec<_> = all.iter().collect();
    let mut s = String::new();
    reduction_table(&mut s, &ps);
    let auto: Vec<&Record> = all.iter().map(|p| &p.auto).collect();
    let kinds = counted(all.iter().map(|p| p.base.tuning.as_str()), "shape");
    let _ = write!(s, "\nLatency reduction `(fixed − auto) / fixed` of the medians against `{kinds}` configs. {}", footer(src, &auto));
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A results line; `ms` = (gemm, fwd, fwd_ent, fwd_bwd).
    fn line(
        tuning: &str,
        commit: &str,
        ts: u64,
        model: &str,
        (t, v, d): (usize, usize, usize),
        ms: (f64, f64, f64, Option<f64>),
    ) -> String {
        let timing = |x: f64| serde_json::json!({"p20": x, "p50": x, "p80": x});
        serde_json::json!({
            "gpu": "NVIDIA H200", "driver": 13000, "commit": commit, "suite": "sweep", "timestamp": ts, "tuning": tuning,
            "row": {
                "case": {"model": model, "tokens": t, "tp": 2, "cp": 1, "t": t, "v": v, "d": d, "backward": ms.3.is_some()},
                "gemm": timing(ms.0), "fwd": timing(ms.1), "fwd_ent": timing(ms.2), "fwd_bwd": ms.3.map(timing),
                "workspace_mib": 1.0, "check_max_abs": if commit == "b" { serde_json::json!(6.2e-5) } else { serde_json::Value::Null },
            }
        })
        .to_string()
    }

    fn source(texts: &[String]) -> Source {
        Source {
            suite: "sweep".into(),
            files: (0..texts.len()).map(|i| format!("docs/results/f{i}.jsonl")).collect(),
            texts: texts.to_vec(),
        }
    }

    #[test]
    fn shapes_sorted_by_size_latest_wins_across_files() {
        let a = [
            line("auto", "a", 10, "m", (8192, 1000, 512), (20.0, 21.0, 22.0, Some(84.0))),
            line("auto", "a", 10, "m", (4096, 1000, 512), (10.0, 10.2, 10.4, None)),
        ]
        .join("\n");
        // The second file re-measures the large shape later, with the check on.
        let b = line("auto", "b", 20, "m", (8192, 1000, 512), (20.0, 20.4, 20.6, Some(82.0)));
        let t = render(&source(&[a, b]), "").unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "| shape (t × v × d) | case | GEMM ms | forward | forward + entropy | forward + backward | workspace MiB |");
        assert_eq!(lines[2], "| 4096 × 1000 × 512 | m/tok4k/tp2cp1 | 10.000 | 1.02× | 1.04× | – | – |");
        assert_eq!(lines[3], "| 8192 × 1000 × 512 | m/tok8k/tp2cp1 | 20.000 | 1.02× | 1.03× | 4.10× | 1 |");
        assert_eq!(
            lines[5],
            "2 shapes on NVIDIA H200, driver CUDA 13.0, commits a (1 shape), b (1 shape); records `docs/results/f0.jsonl` and \
             `docs/results/f1.jsonl`. Timed log-probs checked against the f64 reference on sampled rows at 1 of them: largest error 6.2e-5."
        );
    }

    #[test]
    fn summary_per_model_large_and_all() {
        let text = [
            line("auto", "a", 1, "m1", (4096, 1000, 512), (10.0, 10.0, 10.0, Some(42.0))),
            line("auto", "a", 1, "m1", (8192, 1000, 512), (20.0, 22.0, 22.0, Some(80.0))),
            line("auto", "a", 1, "m2", (16384, 1000, 512), (40.0, 41.0, 42.0, Some(160.0))),
            // Fixed-config records do not enter the summary.
            line("fixed", "a", 1, "m2", (16384, 1000, 512), (40.0, 99.0, 99.0, Some(999.0))),
        ]
        .join("\n");
        let t = render(&source(&[text]), "summary").unwrap();
        assert!(t.contains("| m1 (d 512, v 2000) | 2 | 1.05× (1.00–1.10×) | 1.05× (1.00–1.10×) | 4.10× (4.00–4.20×) |"), "{t}");
        assert!(t.contains("| m2 (d 512, v 2000) | 1 | 1.02× (1.02–1.02×) |"), "{t}");
        assert!(t.contains("| all with a GEMM ≥ 12 ms | 2 | 1.06× (1.02–1.10×) |"), "{t}");
        assert!(t.contains("| all | 3 | 1.02× (1.00–1.10×) |"), "{t}");
        assert!(t.contains("3 shapes on NVIDIA H200, driver CUDA 13.0, commit a; records `docs/results/f0.jsonl`."), "{t}");
    }

    #[test]
    fn versus_fixed_needs_both_tunings() {
        let auto = line("auto", "a", 1, "m", (4096, 1000, 512), (10.0, 9.0, 18.0, Some(70.0)));
        let fixed = line("fixed", "a", 1, "m", (4096, 1000, 512), (10.0, 10.0, 20.0, Some(100.0)));
        let both = source(&[[auto.clone(), fixed].join("\n")]);
        let t = render(&both, "versus-fixed").unwrap();
        assert_eq!(render(&both, "").unwrap(), t, "the default view of both tunings");
        assert!(render(&both, "shapes").unwrap().contains("| 4096 × 1000 × 512 | m/tok4k/tp2cp1 | 10.000 | 0.90× | 1.80× | 7.00× | 1 |"));
        assert!(t.contains("| fwd | 1 | 10.0% | 10.0% | 10.0% | 10.0% | 1/1 | none |"), "{t}");
        assert!(t.contains("| fwd+bwd | 1 | 30.0% |"), "{t}");
        assert!(t.contains("against `fixed` configs"), "{t}");
        assert!(render(&source(std::slice::from_ref(&auto)), "versus-fixed").unwrap_err().contains("no shape was timed both"));
        assert!(render(&source(&[auto]), "plots").unwrap_err().contains("no view `plots`"));
    }
}
