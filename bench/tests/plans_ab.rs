//! `bench/scripts/plans_ab.py`, which puts the records of `run-gpu.sh plans` side by side
//! (docs/PERFORMANCE.md quotes its summaries), on made-up records (`data/plans-ab.jsonl`): a
//! 10 ms GEMM case with two library runs (step 4.2× and 4.3×), one `LMHEAD_BWD_OVERLAP=0` run and
//! two `=1` runs (4.0×, 4.1×); a 1 ms case with one library run (4.0×), one `=1` run (4.4×) and one
//! with a forced chunk (3.9×). Needs `python3`; without it the test prints why it skips.

mod common;

use common::has;

/// The script's standard output for `args`, or `None` (the reason printed) without `python3`.
fn table(args: &[&str]) -> Option<String> {
    common::run_script("plans_ab.py", args)
}

#[test]
fn variants_against_the_library_per_case_and_summed() {
    let Some(text) = table(&["tests/data/plans-ab.jsonl"]) else { return };
    // Medians over the runs; changes against the library's median, in × GEMM and in time.
    has(&text, "| big/tok16k/tp1cp1 (16384 × 1000 × 512) | library | 2 | 1.010 | 1.030 | 4.250 | 42.5 | – | – |");
    has(&text, "| big/tok16k/tp1cp1 (16384 × 1000 × 512) | BWD_OVERLAP=1 | 2 | 1.010 | 1.030 | 4.050 | 40.5 | -0.200 | -4.7% |");
    has(&text, "| small/tok8k/tp1cp1 (8192 × 500 × 256) | chunk=8448 | 1 | 1.000 | 1.000 | 3.900 | 3.9 | -0.100 | -2.5% |");
    has(&text, "| BWD_OVERLAP=1 | 2 | +0.100 (-0.200 … +0.400) | +2.6% (-4.7% … +10.0%) | 1 of 2 |");
    has(&text, "| BWD_OVERLAP=0 | 1 | +0.050 (+0.050 … +0.050) | +1.2% (+1.2% … +1.2%) | 0 of 1 |");
}

#[test]
fn the_summary_leaves_out_small_steps_when_asked() {
    let Some(text) = table(&["--min-step-ms", "15", "tests/data/plans-ab.jsonl"]) else { return };
    has(&text, "| BWD_OVERLAP=1 | 1 | -0.200 (-0.200 … -0.200) | -4.7% (-4.7% … -4.7%) | 1 of 1 |");
    assert!(!text.lines().any(|l| l.starts_with("| chunk=8448 |")), "the 4 ms case's chunk variant is left out of the summary:\n{text}");
    // The per-case rows stay.
    has(&text, "| small/tok8k/tp1cp1 (8192 × 500 × 256) | chunk=8448 | 1 | 1.000 | 1.000 | 3.900 | 3.9 | -0.100 | -2.5% |");
}
