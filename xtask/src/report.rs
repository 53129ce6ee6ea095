//! `cargo xtask bench-report <results.jsonl> [--out-dir DIR]`: turn the JSON lines that
//! `lmhead-bench` appends (one record per measured shape) into a markdown report and PNG plots.
//!
//! What it writes into the output directory (default `docs/bench` under the repository root; a
//! given `--out-dir` is relative to the current directory):
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
//! Plots use `plotters` with its pure-Rust `ab_glyph` text rendering; the font is a TTF read at
//! run time (`LMHEAD_PLOT_FONT`, then a list of common paths). Without one, the plots are still
//! written, without any text, and a note goes to stderr.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lmhead_core::record::Row;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;

// ---------------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------------

/// How the kernel configurations were chosen for a run (`lmhead-bench` vs `lmhead-bench --fallback`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tuning {
    /// The autotuner picked the configurations.
    Auto,
    /// The fixed fallback configurations.
    Fallback,
}

impl Tuning {
    fn as_str(self) -> &'static str {
        match self {
            Tuning::Auto => "auto",
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
        for tuning in [Tuning::Auto, Tuning::Fallback] {
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

/// One shape measured with both tuning modes in the same suite.
pub struct Pair {
    pub suite: String,
    pub auto: Record,
    pub fallback: Record,
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
        let (a, f) = (&self.auto.row, &self.fallback.row);
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

/// Pairs up deduplicated records: every auto record whose suite and shape also has a fallback
/// record, in the order of the auto tables of the report (suite by suite).
pub fn pairs(records: &[Record]) -> Vec<Pair> {
    let fallback: HashMap<(&str, (usize, usize, usize)), &Record> =
        records.iter().filter(|r| r.tuning == Tuning::Fallback).map(|r| ((r.suite.as_str(), r.shape()), r)).collect();
    groups(records)
        .into_iter()
        .filter(|g| g.tuning == Tuning::Auto)
        .flat_map(|g| g.rows)
        .filter_map(|auto| {
            let fallback = (*fallback.get(&(auto.suite.as_str(), auto.shape()))?).clone();
            Some(Pair { suite: auto.suite.clone(), auto, fallback })
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
// Markdown
// ---------------------------------------------------------------------------------------------

/// Distinct values in order of first appearance, joined with ", ".
fn distinct<'a>(values: impl Iterator<Item = &'a str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for v in values {
        if !seen.contains(&v) {
            seen.push(v);
        }
    }
    seen.join(", ")
}

/// `13000` → `13000 (CUDA 13.0)`; anything else as JSON prints it.
fn driver_text(v: &serde_json::Value) -> String {
    match v.as_u64() {
        Some(n) => format!("{n} (CUDA {}.{})", n / 1000, n % 1000 / 10),
        None => v.to_string(),
    }
}

/// `2026-11-29` or `2026-11-28 to 2026-11-30`.
fn date_range(records: &[Record]) -> String {
    let lo = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let hi = records.iter().map(|r| r.timestamp).max().unwrap_or(0);
    let (a, b) = (utc_date(lo), utc_date(hi));
    if a == b {
        a
    } else {
        format!("{a} to {b}")
    }
}

/// `12.760 (2.18x)`.
fn ms_and_ratio(ms: f64, gemm_ms: f64) -> String {
    format!("{ms:.3} ({:.2}x)", ms / gemm_ms)
}

fn pct(x: f64) -> String {
    format!("{x:.1}%")
}

/// The whole `report.md`. `source` names the input file; `read` is the number of records in it.
pub fn markdown(source: &str, read: usize, records: &[Record], plots: &[&str]) -> String {
    let mut s = String::new();
    // `write!` into a String cannot fail; the results are ignored with `let _`.
    let _ = writeln!(s, "# LM-head benchmark report\n");
    let _ = writeln!(
        s,
        "Generated by `cargo xtask bench-report` from `{source}`: {read} records, {} after keeping the latest per (suite, tuning, T, V, D).\n",
        records.len()
    );
    let _ = writeln!(s, "- GPU: {}", distinct(records.iter().map(|r| r.gpu.as_str())));
    let drivers: Vec<String> = records.iter().map(|r| driver_text(&r.driver)).collect();
    let _ = writeln!(s, "- Driver: {}", distinct(drivers.iter().map(String::as_str)));
    let _ = writeln!(s, "- Commit(s): {}", distinct(records.iter().map(|r| r.commit.as_str())));
    let _ = writeln!(s, "- Dates (UTC): {}\n", date_range(records));
    let _ = writeln!(
        s,
        "Times are medians (p50) in ms. \"x GEMM\" is the ratio to a cuBLAS bf16 GEMM of the same (T, V, D) measured in the \
         same run; one logits GEMM is 2·T·V·D FLOP. Forward+backward does four GEMMs' worth of work (8·T·V·D), so 4x is \
         parity there. fwd TFLOP/s counts 2·T·V·D per forward.\n"
    );

    // `#` numbers the shapes as the x axis of ratio.png does when there are too many to name.
    let mut shape_index = 0;
    for g in groups(records) {
        let _ = writeln!(s, "## Suite `{}`, tuning `{}` ({} shapes)\n", g.suite, g.tuning.as_str(), g.rows.len());
        let _ = writeln!(s, "Commit(s): {}; dates (UTC): {}.\n", distinct(g.rows.iter().map(|r| r.commit.as_str())), date_range(&g.rows));
        let _ = writeln!(
            s,
            "| # | case | T | V | D | GEMM ms | fwd ms (x GEMM) | fwd+ent ms (x GEMM) | fwd+bwd ms (x GEMM) | fwd TFLOP/s | workspace MiB |"
        );
        let _ = writeln!(s, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &g.rows {
            shape_index += 1;
            let (c, row) = (&r.row.case, &r.row);
            let g_ms = row.gemm.p50;
            let bwd = row.fwd_bwd.as_ref().map(|t| ms_and_ratio(t.p50, g_ms)).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "| {shape_index} | {} | {} | {} | {} | {:.3} | {} | {} | {} | {:.1} | {:.1} |",
                c.name(),
                c.t,
                c.v,
                c.d,
                g_ms,
                ms_and_ratio(row.fwd.p50, g_ms),
                ms_and_ratio(row.fwd_ent.p50, g_ms),
                bwd,
                c.gemm_flop() / (row.fwd.p50 * 1e-3) / 1e12,
                row.workspace_mib
            );
        }
        let _ = writeln!(s);
    }

    let _ = writeln!(s, "## Autotuned vs fixed fallback\n");
    let all = pairs(records);
    if all.is_empty() {
        let _ =
            writeln!(s, "No shape was measured with both tuning modes in the same suite (run the bench once more with `--fallback`).\n");
    } else {
        let _ = writeln!(
            s,
            "Latency reduction `(fallback − auto) / fallback` of the p50 times, per shape measured both ways in the same suite; \
             positive means the autotuned configuration is faster. p90 is the nearest-rank value (sorted index round(0.9·(n−1))).\n"
        );
        // `#` numbers the pairs as the x axis of autotune.png does when there are too many to name.
        let mut pair_index = 0;
        let mut suites: Vec<&str> = Vec::new();
        for p in &all {
            if !suites.contains(&p.suite.as_str()) {
                suites.push(&p.suite);
            }
        }
        for suite in suites {
            let ps: Vec<&Pair> = all.iter().filter(|p| p.suite == suite).collect();
            let _ = writeln!(s, "### Suite `{suite}`: {} shapes compared\n", ps.len());
            let _ = writeln!(s, "| op | shapes | mean | median | p90 | max | shapes faster | worst regression |");
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---|");
            for (op, sum) in OPS.iter().zip(summaries(&ps)) {
                match sum {
                    Some(m) => {
                        let worst = m.worst.as_ref().map(|(x, name)| format!("{} ({name})", pct(*x))).unwrap_or_else(|| "none".into());
                        let _ = writeln!(
                            s,
                            "| {op} | {} | {} | {} | {} | {} | {}/{} | {worst} |",
                            m.n,
                            pct(m.mean),
                            pct(m.median),
                            pct(m.p90),
                            pct(m.max),
                            m.faster,
                            m.n
                        );
                    }
                    None => {
                        let _ = writeln!(s, "| {op} | 0 | - | - | - | - | - | - |");
                    }
                }
            }
            let _ = writeln!(s, "\nPer shape (auto / fallback ms, reduction):\n");
            let _ = writeln!(s, "| # | case | T | V | D | fwd | fwd+ent | fwd+bwd |");
            let _ = writeln!(s, "|---:|---|---:|---:|---:|---:|---:|---:|");
            for p in &ps {
                pair_index += 1;
                let (a, f) = (&p.auto.row, &p.fallback.row);
                let cell = |a: f64, f: f64| format!("{a:.3} / {f:.3} ({})", pct(reduction(f, a)));
                let bwd = match (&a.fwd_bwd, &f.fwd_bwd) {
                    (Some(a), Some(f)) => cell(a.p50, f.p50),
                    _ => "-".into(),
                };
                let c = &a.case;
                let _ = writeln!(
                    s,
                    "| {pair_index} | {} | {} | {} | {} | {} | {} | {bwd} |",
                    c.name(),
                    c.t,
                    c.v,
                    c.d,
                    cell(a.fwd.p50, f.fwd.p50),
                    cell(a.fwd_ent.p50, f.fwd_ent.p50)
                );
            }
            let _ = writeln!(s);
        }
    }

    if !plots.is_empty() {
        let _ = writeln!(s, "## Plots\n");
        for p in plots {
            let _ = writeln!(s, "![{p}]({p})\n");
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Plots
// ---------------------------------------------------------------------------------------------

/// The font family name every text element of the plots uses.
const FONT: &str = "sans-serif";

/// Where to look for a TTF when `LMHEAD_PLOT_FONT` is not set or not readable.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Registers a font with plotters once per process; returns whether text can be drawn.
pub fn font_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let env = std::env::var("LMHEAD_PLOT_FONT").ok().filter(|p| !p.is_empty());
        for path in env.iter().map(String::as_str).chain(FONT_PATHS.iter().copied()) {
            let Ok(bytes) = std::fs::read(path) else {
                if env.as_deref() == Some(path) {
                    eprintln!("xtask: LMHEAD_PLOT_FONT={path} cannot be read; trying the usual font paths");
                }
                continue;
            };
            // plotters keeps `&'static` font data: leak this one buffer for the process lifetime.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                return true;
            }
            eprintln!("xtask: {path} is not a usable TrueType font");
        }
        eprintln!("xtask: no TrueType font found (set LMHEAD_PLOT_FONT=/path/to/font.ttf): plots are drawn without text");
        false
    })
}

/// One plotted series: a legend name, a colour and a y value per x position (`None`: no point).
struct Series {
    name: &'static str,
    color: RGBColor,
    ys: Vec<Option<f64>>,
}

/// Series colours (the usual blue, orange and green of plotting libraries).
const C_FWD: RGBColor = RGBColor(31, 119, 180);
const C_FWD_ENT: RGBColor = RGBColor(255, 127, 14);
const C_FWD_BWD: RGBColor = RGBColor(44, 160, 44);

/// Above this many shapes the x axis shows shape indices instead of names.
const MAX_NAMED_SHAPES: usize = 48;

/// Draws a per-shape chart into a PNG: one marker per value, lines between neighbouring values
/// of a series, a horizontal reference line at `reference`, and (with `text`) a caption, axis
/// labels and a legend. `labels` names the x positions.
fn draw_chart(
    path: &Path,
    caption: &str,
    y_desc: &str,
    labels: &[String],
    series: &[Series],
    reference: (f64, &str),
    text: bool,
) -> Result<(), String> {
    let n = labels.len().max(1);
    let named = labels.len() <= MAX_NAMED_SHAPES;
    // Room below the plot for the rotated shape names (about 7.5 px per character at 14 px).
    let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let x_area = if !text {
        0
    } else if named {
        (20.0 + 7.5 * longest as f64) as u32
    } else {
        40
    };
    let width = (160 + 36 * n as u32).clamp(900, 2400);
    let height = 560 + x_area;

    // Y range: every value and the reference line, with some headroom.
    let values = series.iter().flat_map(|s| s.ys.iter().flatten().copied()).chain([reference.0]);
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| (lo.min(y), hi.max(y)));
    // Extra headroom on top keeps the legend (upper right) clear of the points.
    let span = (hi - lo).max(0.1);
    let y_lo = if lo >= 0.0 { 0.0 } else { lo - 0.08 * span };
    let y_hi = hi + if text { 0.3 * (hi - y_lo).max(span) } else { 0.08 * span };

    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(16).margin_right(24);
    if text {
        builder.caption(caption, (FONT, 22)).x_label_area_size(x_area).y_label_area_size(70);
    }
    // Categorical x axis: shape i sits at the centre of segment i (plotters' integer ranges
    // include their end). A lone shape gets an empty segment either side, since plotters cannot
    // lay out a range of one value.
    let (x_first, x_last) = if labels.len() <= 1 { (-1, 1) } else { (0, labels.len() as i32 - 1) };
    let mut chart = builder.build_cartesian_2d((x_first..x_last).into_segmented(), y_lo..y_hi).map_err(|e| err(&e))?;

    // Tick labels on x: the shape index when there are too many names; the names themselves are
    // drawn below (plotters mis-anchors rotated tick labels, so they are placed by hand).
    let label_of = |v: &SegmentValue<i32>| -> String {
        match v {
            SegmentValue::CenterOf(i) if !named && *i >= 0 => (i + 1).to_string(),
            _ => String::new(),
        }
    };
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(235, 235, 235)).disable_x_mesh();
    if text {
        mesh.x_labels(if named { labels.len() } else { 24 })
            .x_label_formatter(&label_of)
            .y_desc(y_desc)
            .x_desc(if named { "" } else { "shape (# in the report tables)" })
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15));
    } else {
        // No font: keep the grid and axes but make every label transparent, which plotters
        // skips before it looks for a font.
        mesh.x_labels(1).y_labels(10).label_style((FONT, 14).into_font().color(&TRANSPARENT));
    }
    mesh.draw().map_err(|e| err(&e))?;
    if text && named {
        // Shape names read downwards from just below the x axis, centred on their position.
        let style = (FONT, 14).into_font().transform(FontTransform::Rotate90).color(&BLACK).pos(Pos::new(HPos::Left, VPos::Center));
        for (i, label) in labels.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(SegmentValue::CenterOf(i as i32), y_lo));
            root.draw(&Text::new(label.as_str(), (x, y + 10), style.clone())).map_err(|e| err(&e))?;
        }
    }

    // The reference line across the whole width.
    let (y_ref, ref_name) = reference;
    let ref_line = LineSeries::new([(SegmentValue::Exact(x_first), y_ref), (SegmentValue::Last, y_ref)], BLACK.stroke_width(1));
    let drawn = chart.draw_series(ref_line).map_err(|e| err(&e))?;
    if text {
        drawn.label(ref_name).legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    }

    for s in series {
        let color = s.color;
        let pts: Vec<(SegmentValue<i32>, f64)> =
            s.ys.iter().enumerate().filter_map(|(i, y)| y.map(|y| (SegmentValue::CenterOf(i as i32), y))).collect();
        // Lines only between neighbouring shapes that both have a value.
        for w in s.ys.windows(2).enumerate() {
            if let (i, [Some(a), Some(b)]) = w {
                let seg = [(SegmentValue::CenterOf(i as i32), *a), (SegmentValue::CenterOf(i as i32 + 1), *b)];
                chart.draw_series(LineSeries::new(seg, color.stroke_width(2))).map_err(|e| err(&e))?;
            }
        }
        let drawn = chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(|e| err(&e))?;
        if text {
            drawn.label(s.name).legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 14))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The x label of a record in a multi-group plot: its name, with the suite when there are
/// several suites and a `[fallback]` tag for fallback runs.
fn plot_label(r: &Record, many_suites: bool) -> String {
    let mut l = if many_suites { format!("{}: {}", r.suite, r.name()) } else { r.name() };
    if r.tuning == Tuning::Fallback {
        l.push_str(" [fallback]");
    }
    l
}

/// `ratio.png`: time / GEMM time per shape, for every kept record (table order).
pub fn plot_ratio(path: &Path, records: &[Record], text: bool) -> Result<(), String> {
    let rows: Vec<Record> = groups(records).into_iter().flat_map(|g| g.rows).collect();
    let many_suites = distinct(rows.iter().map(|r| r.suite.as_str())).contains(", ");
    let labels: Vec<String> = rows.iter().map(|r| plot_label(r, many_suites)).collect();
    let ratio =
        |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<Option<f64>> { rows.iter().map(|r| f(&r.row).map(|ms| ms / r.row.gemm.p50)).collect() };
    let series = [
        Series { name: "fwd", color: C_FWD, ys: ratio(&|r| Some(r.fwd.p50)) },
        Series { name: "fwd+entropy", color: C_FWD_ENT, ys: ratio(&|r| Some(r.fwd_ent.p50)) },
        Series { name: "fwd+bwd / 4 (per GEMM-equivalent)", color: C_FWD_BWD, ys: ratio(&|r| r.fwd_bwd.as_ref().map(|t| t.p50 / 4.0)) },
    ];
    let gpu = distinct(rows.iter().map(|r| r.gpu.as_str()));
    draw_chart(
        path,
        &format!("LM head time / cuBLAS bf16 GEMM time, p50 ({gpu})"),
        "time / GEMM time",
        &labels,
        &series,
        (1.0, "cuBLAS GEMM = 1"),
        text,
    )
}

/// `autotune.png`: latency reduction of the autotuned run against the fallback, per pair.
pub fn plot_autotune(path: &Path, pairs: &[Pair], text: bool) -> Result<(), String> {
    let many_suites = distinct(pairs.iter().map(|p| p.suite.as_str())).contains(", ");
    let labels: Vec<String> = pairs.iter().map(|p| plot_label(&p.auto, many_suites)).collect();
    let op = |k: usize| -> Vec<Option<f64>> { pairs.iter().map(|p| p.reductions()[k]).collect() };
    let series = [
        Series { name: "fwd", color: C_FWD, ys: op(0) },
        Series { name: "fwd+entropy", color: C_FWD_ENT, ys: op(1) },
        Series { name: "fwd+bwd", color: C_FWD_BWD, ys: op(2) },
    ];
    draw_chart(
        path,
        "Autotuned vs fixed fallback configurations: latency reduction",
        "(fallback - auto) / fallback, %",
        &labels,
        &series,
        (0.0, "no change"),
        text,
    )
}

// ---------------------------------------------------------------------------------------------
// The task
// ---------------------------------------------------------------------------------------------

const USAGE: &str = "usage: cargo xtask bench-report <results.jsonl> [--out-dir DIR]   (DIR defaults to docs/bench)";

/// Runs the task with the arguments after `bench-report`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut input: Option<PathBuf> = None;
    let mut out_dir: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out-dir" => out_dir = Some(it.next().ok_or("--out-dir needs a value")?.into()),
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}\n{USAGE}")),
            s if input.is_none() => input = Some(s.into()),
            s => return Err(format!("unexpected argument {s}\n{USAGE}")),
        }
    }
    let input = input.ok_or(USAGE)?;
    // The default is docs/bench of this repository (xtask's parent directory), wherever it runs from.
    let out_dir =
        out_dir.unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).join("docs").join("bench"));

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

    const FIXTURE: &str = include_str!("../tests/fixtures/bench-sample.jsonl");

    #[test]
    fn parses_the_fixture() {
        let r = parse(FIXTURE).unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(r[0].row.case.name(), "llama-3.1-8b/tok4k/tp1cp1");
        assert_eq!(r[0].tuning, Tuning::Auto);
        assert!(r[3].row.fwd_bwd.is_none());
        assert_eq!(r[2].line, 3);
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
