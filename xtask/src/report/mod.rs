//! `cargo xtask bench-report`: turn the JSON lines that `lmhead-bench` appends (one record per
//! measured shape) into a markdown report and PNG plots, or regenerate the docs' tables.
//!
//! `bench-report <results.jsonl> [--out-dir DIR]` writes into the output directory (default
//! `docs/bench` under the repository root; a given `--out-dir` is relative to the current
//! directory):
//!
//! - `report.md`: one table per (suite, tuning) with the p50 times, their ratio to the cuBLAS
//!   GEMM of the same shape, forward TFLOP/s and workspace; then an "autotuned vs fixed fallback"
//!   section that compares the shapes measured both ways in the same suite.
//! - `ratio.png`: time / GEMM time per shape for fwd, fwd+entropy and fwd+bwd / 4.
//! - `autotune.png` (only when some shape was measured both ways): latency reduction per shape.
//!
//! When a shape (suite, tuning, T, V, D) was measured more than once, the record with the latest
//! timestamp is used (the later line of the file on a tie). The markdown also goes to stdout.
//!
//! `bench-report --docs` regenerates the tables of README.md and docs/PERFORMANCE.md between
//! their markers from the results files that `docs/results/SUITES` lists; `bench-report --check`
//! fails where they differ, or where `docs/results/` holds other files (see [`docs`]). Both take
//! `--root DIR` (default: this repository).
//!
//! Plots use `plotters` with its pure-Rust `ab_glyph` text rendering; the font is a TTF read at
//! run time (`LMHEAD_PLOT_FONT`, then a list of common paths). Without one, the plots are still
//! written, without any text, and a note goes to stderr.
//!
//! Here: the records (parsing, latest per shape, groups, autotuned/fallback pairs, summaries)
//! and the task; `markdown` writes the report, `plot` the PNGs, `docs` the docs' tables.

mod docs;
mod markdown;
mod plot;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use lmhead_core::record::Row;
use serde::Deserialize;

use markdown::markdown;
use plot::{font_available, plot_autotune, plot_ratio};

// ---------------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------------

/// How the kernel configurations were chosen for a run (`lmhead-bench`, `lmhead-bench --fixed`,
/// `lmhead-bench --fallback`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tuning {
    /// The autotuner picked the configurations.
    Auto,
    /// Each family's best fixed configuration from the shipped table (`LMHEAD_AUTOTUNE=0`).
    Fixed,
    /// The `mma.sync` fallback configurations.
    Fallback,
}

impl Tuning {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Tuning::Auto => "auto",
            Tuning::Fixed => "fixed",
            Tuning::Fallback => "fallback",
        }
    }
}

/// One line of the results file.
#[derive(Clone, Debug, Deserialize)]
pub struct Record {
    pub gpu: String,
    /// The CUDA driver version as the driver reports it (an integer such as `13000`).
    pub driver: serde_json::Value,
    pub commit: String,
    pub suite: String,
    /// Seconds since the Unix epoch.
    pub timestamp: u64,
    pub tuning: Tuning,
    pub row: Row,
    /// 1-based line number in the file (filled in by [`parse`]).
    #[serde(skip)]
    pub line: usize,
}

impl Record {
    /// The shape key that duplicates are collapsed on (the suite and tuning are added by callers).
    fn shape(&self) -> (usize, usize, usize) {
        (self.row.case.t, self.row.case.v, self.row.case.d)
    }

    fn name(&self) -> String {
        self.row.case.name()
    }

    /// Checks what JSON cannot: sizes and times that later divisions rely on.
    fn validate(&self) -> Result<(), String> {
        let c = &self.row.case;
        if c.t == 0 || c.v == 0 || c.d == 0 {
            return Err(format!("shape T={} V={} D={} has a zero dimension", c.t, c.v, c.d));
        }
        let r = &self.row;
        let times = [("gemm", Some(&r.gemm)), ("fwd", Some(&r.fwd)), ("fwd_ent", Some(&r.fwd_ent)), ("fwd_bwd", r.fwd_bwd.as_ref())];
        for (what, t) in times {
            if let Some(t) = t {
                if !(t.p50.is_finite() && t.p50 > 0.0) {
                    return Err(format!("{what}.p50 = {} is not a positive time", t.p50));
                }
            }
        }
        Ok(())
    }
}

/// Parses the results file: one JSON record per line; blank lines are skipped. An error names
/// the 1-based line number.
pub fn parse(text: &str) -> Result<Vec<Record>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let n = i + 1;
        let mut r: Record = serde_json::from_str(line).map_err(|e| format!("line {n}: malformed benchmark record: {e}"))?;
        r.validate().map_err(|e| format!("line {n}: {e}"))?;
        r.line = n;
        out.push(r);
    }
    Ok(out)
}

/// Keeps the latest record per (suite, tuning, T, V, D): the largest timestamp, the later line
/// on a tie. The kept records stay in the order in which their key first appears in the file.
pub fn latest(records: &[Record]) -> Vec<Record> {
    type Key = (String, Tuning, (usize, usize, usize));
    let mut order: Vec<Key> = Vec::new();
    let mut best: HashMap<Key, &Record> = HashMap::new();
    for r in records {
        let key = (r.suite.clone(), r.tuning, r.shape());
        match best.get(&key) {
            None => {
                order.push(key.clone());
                best.insert(key, r);
            }
            Some(old) if (r.timestamp, r.line) >= (old.timestamp, old.line) => {
                best.insert(key, r);
            }
            Some(_) => {}
        }
    }
    order.iter().map(|k| best[k].clone()).collect()
}

/// The records of one (suite, tuning), in file order.
pub struct Group {
    pub suite: String,
    pub tuning: Tuning,
    pub rows: Vec<Record>,
}

/// Splits deduplicated records into groups: suites in order of first appearance, `auto` before
/// `fallback` within a suite.
pub fn groups(records: &[Record]) -> Vec<Group> {
    let mut suites: Vec<&str> = Vec::new();
    for r in records {
        if !suites.contains(&r.suite.as_str()) {
            suites.push(&r.suite);
        }
    }
    let mut out = Vec::new();
    for s in suites {
        for tuning in [Tuning::Auto, Tuning::Fixed, Tuning::Fallback] {
            let rows: Vec<Record> = records.iter().filter(|r| r.suite == s && r.tuning == tuning).cloned().collect();
            if !rows.is_empty() {
                out.push(Group { suite: s.to_string(), tuning, rows });
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Autotuned vs fallback
// ---------------------------------------------------------------------------------------------

/// One shape measured autotuned and with fixed configs (the table's best fixed configs when
/// measured, else the `mma.sync` fallback) in the same suite.
pub struct Pair {
    pub suite: String,
    pub auto: Record,
    /// The fixed-config run it is compared with (`base.tuning` says which kind).
    pub base: Record,
}

/// `(fallback − auto) / fallback` in percent: positive when the autotuned run is faster.
pub fn reduction(fallback_ms: f64, auto_ms: f64) -> f64 {
    100.0 * (fallback_ms - auto_ms) / fallback_ms
}

impl Pair {
    pub fn name(&self) -> String {
        self.auto.name()
    }

    /// Latency reductions for fwd, fwd+ent and fwd+bwd (the last only when both runs have it).
    pub fn reductions(&self) -> [Option<f64>; 3] {
        let (a, f) = (&self.auto.row, &self.base.row);
        [
            Some(reduction(f.fwd.p50, a.fwd.p50)),
            Some(reduction(f.fwd_ent.p50, a.fwd_ent.p50)),
            match (&f.fwd_bwd, &a.fwd_bwd) {
                (Some(f), Some(a)) => Some(reduction(f.p50, a.p50)),
                _ => None,
            },
        ]
    }
}

/// Names of the three compared operations, in the order of [`Pair::reductions`].
const OPS: [&str; 3] = ["fwd", "fwd+ent", "fwd+bwd"];

/// Pairs up deduplicated records: every auto record whose suite and shape also has a fixed
/// record (preferred) or a fallback record, in the order of the auto tables of the report
/// (suite by suite).
pub fn pairs(records: &[Record]) -> Vec<Pair> {
    let by = |t: Tuning| -> HashMap<(&str, (usize, usize, usize)), &Record> {
        records.iter().filter(|r| r.tuning == t).map(|r| ((r.suite.as_str(), r.shape()), r)).collect()
    };
    let (fixed, fallback) = (by(Tuning::Fixed), by(Tuning::Fallback));
    groups(records)
        .into_iter()
        .filter(|g| g.tuning == Tuning::Auto)
        .flat_map(|g| g.rows)
        .filter_map(|auto| {
            let k = (auto.suite.as_str(), auto.shape());
            let base = (*fixed.get(&k).or_else(|| fallback.get(&k))?).clone();
            Some(Pair { suite: auto.suite.clone(), auto, base })
        })
        .collect()
}

/// Summary of the latency reductions of one operation over a set of shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// Number of shapes compared.
    pub n: usize,
    pub mean: f64,
    pub median: f64,
    /// Nearest-rank p90: the sorted value at index `round(0.9·(n−1))`, the convention of
    /// `lmhead::tune::bench::percentile`.
    pub p90: f64,
    pub max: f64,
    /// Shapes where the autotuned run is faster (reduction > 0).
    pub faster: usize,
    /// The most negative reduction and its shape's name; `None` when nothing got slower.
    pub worst: Option<(f64, String)>,
}

/// Summarises `(reduction %, shape name)` values; `None` for an empty list.
pub fn summarize(values: &[(f64, String)]) -> Option<Summary> {
    if values.is_empty() {
        return None;
    }
    let mut xs: Vec<f64> = values.iter().map(|v| v.0).collect();
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let median = if n % 2 == 1 { xs[n / 2] } else { 0.5 * (xs[n / 2 - 1] + xs[n / 2]) };
    let p90 = xs[((n - 1) as f64 * 0.9).round() as usize];
    let worst = values.iter().filter(|v| v.0 < 0.0).min_by(|a, b| a.0.total_cmp(&b.0)).cloned();
    Some(Summary {
        n,
        mean: xs.iter().sum::<f64>() / n as f64,
        median,
        p90,
        max: xs[n - 1],
        faster: xs.iter().filter(|&&x| x > 0.0).count(),
        worst,
    })
}

/// Summaries for fwd, fwd+ent and fwd+bwd over a set of pairs.
pub fn summaries(pairs: &[&Pair]) -> [Option<Summary>; 3] {
    let per_op = |k: usize| -> Vec<(f64, String)> { pairs.iter().filter_map(|p| p.reductions()[k].map(|r| (r, p.name()))).collect() };
    [summarize(&per_op(0)), summarize(&per_op(1)), summarize(&per_op(2))]
}

// ---------------------------------------------------------------------------------------------
// Dates (no chrono): days since 1970-01-01 to a proleptic Gregorian date, after H. Hinnant's
// `civil_from_days`.
// ---------------------------------------------------------------------------------------------

/// `(year, month 1..=12, day 1..=31)` of a day count since 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so that the leap day ends a (March-based) year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097); // 400-year eras
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year, 0..=365
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A Unix timestamp as a UTC date, `YYYY-MM-DD`.
pub fn utc_date(timestamp: u64) -> String {
    let (y, m, d) = civil_from_days((timestamp / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

// ---------------------------------------------------------------------------------------------
// The task
// ---------------------------------------------------------------------------------------------

const USAGE: &str = "usage: cargo xtask bench-report <results.jsonl> [--out-dir DIR]   (DIR defaults to docs/bench)\n       \
                     cargo xtask bench-report --docs|--check [--root DIR]   (the docs' tables from docs/results/SUITES)";

/// The repository root: xtask's parent directory, wherever the task runs from.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).to_path_buf()
}

/// Runs the task with the arguments after `bench-report`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut input: Option<PathBuf> = None;
    let mut out_dir: Option<PathBuf> = None;
    let mut docs_mode: Option<bool> = None;
    let mut root: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out-dir" => out_dir = Some(it.next().ok_or("--out-dir needs a value")?.into()),
            "--docs" | "--check" if docs_mode.is_some_and(|c| c != (a == "--check")) => {
                return Err(format!("--docs and --check exclude each other\n{USAGE}"))
            }
            "--docs" => docs_mode = Some(false),
            "--check" => docs_mode = Some(true),
            "--root" => root = Some(it.next().ok_or("--root needs a value")?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{USAGE}")),
            s if input.is_none() => input = Some(s.into()),
            s => return Err(format!("unexpected argument {s}\n{USAGE}")),
        }
    }
    if let Some(check) = docs_mode {
        if input.is_some() || out_dir.is_some() {
            return Err(format!("--docs and --check read docs/results/SUITES: no results file or --out-dir\n{USAGE}"));
        }
        return docs::run(&root.unwrap_or_else(repo_root), check);
    }
    if root.is_some() {
        return Err(format!("--root goes with --docs or --check\n{USAGE}"));
    }
    let input = input.ok_or(USAGE)?;
    let out_dir = out_dir.unwrap_or_else(|| repo_root().join("docs").join("bench"));

    let text = std::fs::read_to_string(&input).map_err(|e| format!("cannot read {}: {e}", input.display()))?;
    let all = parse(&text).map_err(|e| format!("{}: {e}", input.display()))?;
    if all.is_empty() {
        return Err(format!("{}: no benchmark records", input.display()));
    }
    let records = latest(&all);
    let pairs = pairs(&records);

    std::fs::create_dir_all(&out_dir).map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let mut plots = vec!["ratio.png"];
    if !pairs.is_empty() {
        plots.push("autotune.png");
    }
    let md = markdown(&input.display().to_string(), all.len(), &records, &plots);
    let md_path = out_dir.join("report.md");
    std::fs::write(&md_path, &md).map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;

    let text_ok = font_available();
    let mut written = vec![md_path];
    let ratio_path = out_dir.join("ratio.png");
    plot_ratio(&ratio_path, &records, text_ok)?;
    written.push(ratio_path);
    let autotune_path = out_dir.join("autotune.png");
    if !pairs.is_empty() {
        plot_autotune(&autotune_path, &pairs, text_ok)?;
        written.push(autotune_path);
    } else if autotune_path.exists() {
        // An autotune.png of an earlier report would not match this one.
        std::fs::remove_file(&autotune_path).map_err(|e| format!("cannot remove stale {}: {e}", autotune_path.display()))?;
        eprintln!("xtask: removed stale {} (no shape was measured both ways)", autotune_path.display());
    }

    print!("{md}");
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = include_str!("../../tests/fixtures/bench-sample.jsonl");

    #[test]
    fn parses_the_fixture() {
        let r = parse(FIXTURE).unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(r[0].row.case.name(), "llama-3.1-8b/tok4k/tp1cp1");
        assert_eq!(r[0].tuning, Tuning::Auto);
        assert!(r[3].row.fwd_bwd.is_none());
        assert_eq!(r[2].line, 3);
        // Records from before the plans were kept have none; newer ones read back.
        assert_eq!(r[0].row.fwd_plan, None);
        let mut v: serde_json::Value = serde_json::from_str(FIXTURE.lines().next().unwrap()).unwrap();
        v["row"]["fwd_plan"] = serde_json::json!({"splits": 12, "raster": 11, "fill": 0});
        let r = parse(&v.to_string()).unwrap();
        assert_eq!(r[0].row.fwd_plan, Some(lmhead_core::record::Plan { splits: 12, raster: 11, fill: 0 }));
        assert_eq!(r[0].row.fwd_ent_plan, None);
    }

    #[test]
    fn pairs_prefer_the_fixed_run_to_the_fallback() {
        let line = |tuning: &str, fwd: f64| {
            let mut v: serde_json::Value = serde_json::from_str(FIXTURE.lines().next().unwrap()).unwrap();
            v["tuning"] = tuning.into();
            v["row"]["fwd"]["p50"] = fwd.into();
            v.to_string()
        };
        let text = [line("auto", 9.0), line("fallback", 20.0), line("fixed", 10.0)].join("\n");
        let recs = latest(&parse(&text).unwrap());
        let ps = pairs(&recs);
        assert_eq!(ps.len(), 1);
        assert_eq!(ps[0].base.tuning, Tuning::Fixed);
        assert!((ps[0].reductions()[0].unwrap() - 10.0).abs() < 1e-9);
        // Without a fixed run, the fallback is the baseline.
        let text = [line("auto", 9.0), line("fallback", 20.0)].join("\n");
        let ps = pairs(&latest(&parse(&text).unwrap()));
        assert_eq!(ps[0].base.tuning, Tuning::Fallback);
    }

    #[test]
    fn dates() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
        assert_eq!(utc_date(951_868_799), "2000-02-29");
        assert_eq!(utc_date(951_868_800), "2000-03-01");
        assert_eq!(utc_date(1_709_164_800), "2024-02-29");
        assert_eq!(utc_date(4_102_444_800), "2100-01-01");
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn summary_statistics() {
        let v = |xs: &[f64]| xs.iter().enumerate().map(|(i, &x)| (x, format!("s{i}"))).collect::<Vec<_>>();
        let s = summarize(&v(&[10.0, 20.0, -4.0, 50.0])).unwrap();
        assert_eq!((s.n, s.faster), (4, 3));
        assert!((s.mean - 19.0).abs() < 1e-12 && (s.median - 15.0).abs() < 1e-12);
        assert_eq!((s.p90, s.max), (50.0, 50.0));
        assert_eq!(s.worst, Some((-4.0, "s2".to_string())));
        // Odd count, nothing slower; p90 index round(0.9·4) = 4 of the sorted values.
        let s = summarize(&v(&[1.0, 2.0, 3.0, 4.0, 5.0])).unwrap();
        assert_eq!((s.median, s.p90, s.worst), (3.0, 5.0, None));
        assert!(summarize(&[]).is_none());
    }

    #[test]
    fn malformed_line_is_named() {
        let lines: Vec<&str> = FIXTURE.lines().collect();
        let text = format!("{}\n\n{}\n{{\"gpu\": 1}}\n", lines[0], lines[1]);
        let e = parse(&text).unwrap_err();
        assert!(e.starts_with("line 4:"), "{e}");
        let e = parse(&lines[0].replace("\"tuning\":\"auto\"", "\"tuning\":\"tuned\"")).unwrap_err();
        assert!(e.starts_with("line 1:"), "{e}");
        let e = parse(&lines[0].replace("\"p50\":5.859375953674316", "\"p50\":0")).unwrap_err();
        assert!(e.contains("line 1: gemm.p50"), "{e}");
    }

    #[test]
    fn keeps_the_latest_duplicate() {
        let first = FIXTURE.lines().next().unwrap();
        let newer = first.replace("1795948460", "1795948999").replace("\"p50\":12.760416030883789", "\"p50\":11.0");
        let older = first.replace("1795948460", "1795940000").replace("\"p50\":12.760416030883789", "\"p50\":99.0");
        let r = latest(&parse(&format!("{first}\n{newer}\n{older}\n")).unwrap());
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].row.fwd.p50, 11.0);
    }

    #[test]
    fn plots_with_and_without_text() {
        let dir = std::env::temp_dir().join(format!("xtask-report-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let records = parse(FIXTURE).unwrap();
        let p = dir.join("ratio.png");
        plot_ratio(&p, &records, false).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        // A single shape (one x segment), with text when this machine has a font.
        plot_ratio(&p, &records[3..], font_available()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
