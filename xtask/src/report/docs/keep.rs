//! The table of `lmhead-bench keep` (records under `keep_logits`): per case, one GEMM's time, the
//! training step (log-prob only, and with entropy) with the kept-logits mode off and on as
//! multiples of that GEMM, the rows kept and the device memory in use each way. Views: the
//! default (every case) and `summary` (median and largest multiple over the cases).

use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::Value;

use super::{counted, keyed_records, median, x, Source};

#[derive(Deserialize)]
struct Timing {
    p50: f64,
}

#[derive(Deserialize)]
struct KeepRow {
    case: String,
    t: usize,
    d: usize,
    v: usize,
    gemm: Timing,
    step_off: Timing,
    step_on: Timing,
    step_ent_off: Timing,
    step_ent_on: Timing,
    kept_rows: usize,
    /// A forced backward chunk width (`lmhead-bench keep --bwd-chunk`); the table shows only
    /// the library's own width (absent or null).
    #[serde(default)]
    bwd_chunk: Option<u64>,
    mem_off: u64,
    mem_on: u64,
}

/// The keep table (the latest record of a case at the library's chunk width wins).
pub fn render(src: &Source, view: &str) -> Result<String, String> {
    if !view.is_empty() && view != "summary" {
        return Err(format!("suite `{}`: no view `{view}` (views: the default, `summary`)", src.suite));
    }
    let mut recs = keyed_records(src, "keep_logits", "a keep record", |r: &KeepRow| (r.case.clone(), r.bwd_chunk))?;
    recs.retain(|(_, r)| r.bwd_chunk.is_none());
    if recs.is_empty() {
        return Err(format!("{}: no records at the library's chunk width", src.file_list()));
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut s = String::new();
    let xs = |f: &dyn Fn(&KeepRow) -> f64| recs.iter().map(|(_, r)| f(r)).collect::<Vec<f64>>();
    if view == "summary" {
        let _ = writeln!(s, "| step | mode off: median (largest) | mode on: median (largest) |");
        let _ = writeln!(s, "|---|---:|---:|");
        let mm = |v: Vec<f64>| format!("{} ({})", x(median(&v).unwrap_or(f64::NAN)), x(v.iter().copied().fold(0.0, f64::max)));
        let _ = writeln!(s, "| log-prob | {} | {} |", mm(xs(&|r| r.step_off.p50 / r.gemm.p50)), mm(xs(&|r| r.step_on.p50 / r.gemm.p50)));
        let _ = writeln!(
            s,
            "| log-prob and entropy | {} | {} |",
            mm(xs(&|r| r.step_ent_off.p50 / r.gemm.p50)),
            mm(xs(&|r| r.step_ent_on.p50 / r.gemm.p50))
        );
    } else {
        let _ = writeln!(
            s,
            "| case (t × v × d) | GEMM ms | step off | step on | step + entropy off | step + entropy on | kept rows | memory off / on GiB |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for (_, r) in &recs {
            let g = r.gemm.p50;
            let _ = writeln!(
                s,
                "| {} ({} × {} × {}) | {:.3} | {} | {} | {} | {} | {} | {:.2} / {:.2} |",
                r.case,
                r.t,
                r.v,
                r.d,
                g,
                x(r.step_off.p50 / g),
                x(r.step_on.p50 / g),
                x(r.step_ent_off.p50 / g),
                x(r.step_ent_on.p50 / g),
                r.kept_rows,
                gib(r.mem_off),
                gib(r.mem_on)
            );
        }
    }
    let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("not recorded").to_string();
    let gpus: Vec<String> = recs.iter().map(|(v, _)| text(v, "gpu")).collect();
    let commits: Vec<String> = recs.iter().map(|(v, _)| text(v, "commit")).collect();
    let n = recs.len();
    let _ = write!(
        s,
        "\nTime of the training step (forward, then the backward of its outputs, bf16 `dh` and `dW`) over one cuBLAS GEMM `h·Wᵀ` \
         of the same shape in the same rounds; on: `keep_logits` covering the rows that fit 80% of the free memory. Memory: \
         device memory in use after a warm-up step, inputs and workspace included. {n} case{} on {}, commit {}; records {}.",
        if n == 1 { "" } else { "s" },
        counted(gpus.iter().map(String::as_str), "case"),
        counted(commits.iter().map(String::as_str), "case"),
        src.file_list()
    );
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_table_gives_multiples_of_the_gemm() {
        let t = |x: f64| serde_json::json!({"p20": x, "p50": x, "p80": x});
        let line = serde_json::json!({"gpu": "NVIDIA H200", "commit": "c", "suite": "keep", "keep_logits": {
            "case": "m", "t": 8192, "d": 4096, "v": 1000, "gemm": t(10.0), "step_off": t(41.0), "step_on": t(32.0),
            "step_ent_off": t(42.0), "step_ent_on": t(33.0), "kept_rows": 8192, "mem_off": 1u64 << 30, "mem_on": 3u64 << 30}});
        // A later record of the same case with a forced chunk width does not replace it.
        let mut forced = line.clone();
        forced["keep_logits"]["bwd_chunk"] = serde_json::json!(1000);
        forced["keep_logits"]["step_on"] = t(99.0);
        let texts = vec![format!("{line}\n{forced}")];
        let src = Source { suite: "keep".into(), files: vec!["docs/results/keep.jsonl".into()], texts };
        let s = render(&src, "").unwrap();
        assert!(s.contains("| m (8192 × 1000 × 4096) | 10.000 | 4.10× | 3.20× | 4.20× | 3.30× | 8192 | 1.00 / 3.00 |"), "{s}");
        assert!(s.contains("1 case on NVIDIA H200, commit c;"), "{s}");
        let sm = render(&src, "summary").unwrap();
        assert!(sm.contains("| log-prob | 4.10× (4.10×) | 3.20× (3.20×) |"), "{sm}");
        assert!(render(&src, "nope").unwrap_err().contains("no view"));
    }
}
