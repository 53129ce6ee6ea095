//! The table of `lmhead-bench active` (`lmhead_core::record::ActiveRow`): per head, mask layout
//! and active fraction, the forward and the step on all rows, on the compacted rows alone (the
//! ideal) and as the library runs them, with the library's time over the ideal's and its fixed
//! cost (the library's time less the ideal's, also as a share of the call on all rows): the
//! default view. `summary`: one line per active fraction, over heads and layouts (README).

use std::fmt::Write as _;

use lmhead_core::record::ActiveRow;
use serde_json::Value;

use super::{counted, keyed_records, x, Source};

/// The active-rows table, records in the suite's order (the latest record of a case wins).
pub fn render(src: &Source, view: &str) -> Result<String, String> {
    if !view.is_empty() && view != "summary" {
        return Err(format!("suite `{}`: no view `{view}` (views: the default, `summary`)", src.suite));
    }
    let recs = keyed_records(src, "active_row", "an active record", |a: &ActiveRow| {
        (a.model.clone(), a.t, a.layout.clone(), a.fraction.to_bits())
    })?;
    if view == "summary" {
        return Ok(summary(src, &recs));
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| head (t × v × d) | mask | active | fwd ms: all rows / compacted / library | library × compacted | fixed ms (% of all rows) | step ms: all rows / compacted / library | library × compacted | fixed ms (% of all rows) |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let (mut worst_x, mut worst_fixed) = (0.0f64, 0.0f64);
    for (_, r) in &recs {
        let three = |a: f64, b: f64, c: f64| format!("{a:.3} / {b:.3} / {c:.3}");
        let fixed = |lib: f64, ideal: f64, all: f64| format!("{:.3} ({:.1}%)", lib - ideal, 100.0 * (lib - ideal) / all);
        for (lib, ideal, all) in
            [(r.fwd_active.p50, r.fwd_ideal.p50, r.fwd_dense.p50), (r.step_active.p50, r.step_ideal.p50, r.step_dense.p50)]
        {
            worst_x = worst_x.max(lib / ideal);
            worst_fixed = worst_fixed.max((lib - ideal) / all);
        }
        let _ = writeln!(
            s,
            "| {} ({} × {} × {}) | {} {:.0}% | {} | {} | {} | {} | {} | {} | {} |",
            r.model,
            r.t,
            r.v,
            r.d,
            r.layout,
            100.0 * r.fraction,
            r.active,
            three(r.fwd_dense.p50, r.fwd_ideal.p50, r.fwd_active.p50),
            x(r.fwd_active.p50 / r.fwd_ideal.p50),
            fixed(r.fwd_active.p50, r.fwd_ideal.p50, r.fwd_dense.p50),
            three(r.step_dense.p50, r.step_ideal.p50, r.step_active.p50),
            x(r.step_active.p50 / r.step_ideal.p50),
            fixed(r.step_active.p50, r.step_ideal.p50, r.step_dense.p50),
        );
    }
    let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("not recorded").to_string();
    let gpus: Vec<String> = recs.iter().map(|(v, _)| text(v, "gpu")).collect();
    let commits: Vec<String> = recs.iter().map(|(v, _)| text(v, "commit")).collect();
    let _ = write!(
        s,
        "\nMedians of the rounds, the label check on in every call. All rows: the masked labels `ignore_index`, every row computed \
         (`Compaction::Off`); compacted: the dense call on only the active rows, gathered beforehand; library: the default \
         (`Compaction::Auto`). At most {} the compacted call; fixed cost at most {:.1}% of the call on all rows. {} on {}, commit {}; \
         records {}.",
        x(worst_x),
        100.0 * worst_fixed,
        cases(recs.len()),
        counted(gpus.iter().map(String::as_str), "case"),
        counted(commits.iter().map(String::as_str), "case"),
        src.file_list()
    );
    Ok(s)
}

/// `1 case`, `27 cases`.
fn cases(n: usize) -> String {
    format!("{n} case{}", if n == 1 { "" } else { "s" })
}

/// Per active fraction (highest first), over every head and layout: the forward's and the step's
/// time as a share of the call on all rows, and the library's time over the compacted call's
/// (median, worst).
fn summary(src: &Source, recs: &[(Value, ActiveRow)]) -> String {
    let mut fractions: Vec<f64> = recs.iter().map(|(_, r)| r.fraction).collect();
    fractions.sort_by(|a, b| b.total_cmp(a));
    fractions.dedup();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| active rows | cases | forward: time of all rows | × compacted (worst) | step: time of all rows | × compacted (worst) |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|");
    let med = |v: Vec<f64>| super::median(&v).unwrap_or(f64::NAN);
    for f in fractions {
        let rs: Vec<&ActiveRow> = recs.iter().map(|(_, r)| r).filter(|r| r.fraction == f).collect();
        let share = |g: &dyn Fn(&ActiveRow) -> f64| med(rs.iter().map(|r| g(r)).collect());
        let worst = |g: &dyn Fn(&ActiveRow) -> f64| rs.iter().map(|r| g(r)).fold(0.0f64, f64::max);
        let fwd_share = share(&|r| r.fwd_active.p50 / r.fwd_dense.p50);
        let step_share = share(&|r| r.step_active.p50 / r.step_dense.p50);
        let fwd_x = |r: &ActiveRow| r.fwd_active.p50 / r.fwd_ideal.p50;
        let step_x = |r: &ActiveRow| r.step_active.p50 / r.step_ideal.p50;
        let _ = writeln!(
            s,
            "| {:.0}% | {} | {:.0}% | {} ({}) | {:.0}% | {} ({}) |",
            100.0 * f,
            rs.len(),
            100.0 * fwd_share,
            x(share(&fwd_x)),
            x(worst(&fwd_x)),
            100.0 * step_share,
            x(share(&step_x)),
            x(worst(&step_x)),
        );
    }
    let heads: Vec<String> = recs.iter().map(|(_, r)| format!("{} (d {})", r.model, r.d)).collect();
    let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("not recorded").to_string();
    let gpus: Vec<String> = recs.iter().map(|(v, _)| text(v, "gpu")).collect();
    let _ = write!(
        s,
        "\nMedians over the heads and mask layouts at {} tokens: {}. Compacted: the dense call on only the active rows, gathered \
         beforehand (the ideal). {} on {}; records {}.",
        recs[0].1.t,
        super::counted(heads.iter().map(String::as_str), "case"),
        cases(recs.len()),
        counted(gpus.iter().map(String::as_str), "case"),
        src.file_list()
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(x: f64) -> Value {
        serde_json::json!({"p20": x, "p50": x, "p80": x})
    }

    fn line(fraction: f64, fwd: (f64, f64, f64), step: (f64, f64, f64)) -> String {
        serde_json::json!({"gpu": "NVIDIA H200", "commit": "c", "suite": "active", "active_row": {
            "model": "m", "t": 8192, "v": 1000, "d": 512, "layout": "suffix", "fraction": fraction, "active": (8192.0 * fraction) as usize,
            "gemm": timing(1.0), "fwd_dense": timing(fwd.0), "fwd_ideal": timing(fwd.1), "fwd_active": timing(fwd.2),
            "step_dense": timing(step.0), "step_ideal": timing(step.1), "step_active": timing(step.2),
            "fwd_rows": 4096, "bwd_rows": 4096, "fwd_cfg": "x", "bwd_cfg": "y", "check_max_abs": 1e-6}})
        .to_string()
    }

    #[test]
    fn active_table_gives_ratios_and_fixed_costs() {
        let text = [line(0.5, (9.0, 9.0, 9.0), (1.0, 1.0, 1.0)), line(0.5, (10.0, 5.0, 5.1), (40.0, 20.0, 20.4))].join("\n");
        let src = Source { suite: "active".into(), files: vec!["docs/results/active.jsonl".into()], texts: vec![text] };
        let t = render(&src, "").unwrap();
        assert_eq!(t.lines().filter(|l| l.starts_with("| m ")).count(), 1, "the latest record of a case wins: {t}");
        assert!(
            t.contains("| m (8192 × 1000 × 512) | suffix 50% | 4096 | 10.000 / 5.000 / 5.100 | 1.02× | 0.100 (1.0%) | 40.000 / 20.000 / 20.400 | 1.02× | 0.400 (1.0%) |"),
            "{t}"
        );
        assert!(
            t.contains(
                "At most 1.02× the compacted call; fixed cost at most 1.0% of the call on all rows. 1 case on NVIDIA H200, commit c;"
            ),
            "{t}"
        );
        let sm = render(&src, "summary").unwrap();
        assert!(sm.contains("| 50% | 1 | 51% | 1.02× (1.02×) | 51% | 1.02× (1.02×) |"), "{sm}");
        assert!(render(&src, "nope").unwrap_err().contains("no view"));
    }
}
