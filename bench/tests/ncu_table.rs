//! `bench/scripts/ncu_table.py`, which turns ncu's per-kernel summaries into the per-shape account
//! of `docs/PERFORMANCE.md`, on one recorded case (`data/ncu-case.txt`: the 8192 × 248320 × 2048
//! case of `docs/results/ncu-sweep-2026-12-01.txt`, ncu's progress lines and the tensor-pipe
//! sub-metrics left out) and its sweep record (`data/sweep-case.jsonl`). Needs `python3`; without
//! it each test prints why it skips.

mod common;

use std::path::{Path, PathBuf};

use common::has;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// The script's standard output for `args`, or `None` (the reason printed) without `python3`.
fn table(args: &[&Path]) -> Option<String> {
    common::run_script("ncu_table.py", args)
}

#[test]
fn per_kernel_rows_wave_bound_and_step_sum() {
    let Some(text) = table(&[&data("ncu-case.txt"), &data("sweep-case.jsonl")]) else { return };
    // `dh`: 1.34 ms for 31232 of 248320 columns against the GEMM's 10.45 ms; clock, SMs and
    // tensor pipe against cuBLAS's 1.60 GHz, 99.8%, 93.2%.
    has(&text, "|  | dh | 1.34 | 1.02 | 1.02 | 1.54 | 95.7% | 98.6% | 77% (58%) | 41% | clock −4%, idle SMs −4.1%, DRAM |");
    has(&text, "| 8192 × 248320 × 2048 (31232) | 512 | 97.0% | 95.7% | 1952 | 98.6% | 97.8% |");
    has(&text, "| 8192 × 248320 × 2048, 31232 | 4.25 | 4.19 | 4.15 | -0.03 |");
}

/// The fixture's `dh` duration line, as ncu wrote it.
const DH_MS: &str = "ms    1.33    1.34    1.34";

/// A copy of the recorded case in a temporary file (`tag` names it) with its `dh` duration line
/// written as `dh_line`.
fn with_dh_line(tag: &str, dh_line: &str) -> PathBuf {
    let recorded = std::fs::read_to_string(data("ncu-case.txt")).unwrap();
    assert_eq!(recorded.matches(DH_MS).count(), 1, "the fixture's dh duration line");
    let path = std::env::temp_dir().join(format!("ncu-case-{tag}-{}.txt", std::process::id()));
    std::fs::write(&path, recorded.replace(DH_MS, dh_line)).unwrap();
    path
}

#[test]
fn durations_in_microseconds_read_as_milliseconds() {
    // ncu writes a short kernel's duration in `us`: the same `dh` group, so written.
    let path = with_dh_line("us", "us 1330.00 1340.00 1340.00");
    let got = table(&[&path, &data("sweep-case.jsonl")]);
    std::fs::remove_file(&path).unwrap();
    let (Some(got), Some(want)) = (got, table(&[&data("ncu-case.txt"), &data("sweep-case.jsonl")])) else { return };
    assert_eq!(got, want);
}

#[test]
fn cases_and_compact_rows() {
    let Some(cases) = table(&[Path::new("--cases"), &data("sweep-case.jsonl")]) else { return };
    assert_eq!(cases, "qwen3.6-35b-a3b/tok16k/tp1cp2\n");
    let Some(compact) = table(&[Path::new("--compact"), &data("ncu-case.txt"), &data("sweep-case.jsonl")]) else { return };
    has(&compact, "| 8192 × 248320 × 2048 (31232) | 10.4 | 1.03 | 1.02 · 1.008 · 1.017 | 14% | 1.05 | 1.12 | 1.02 | 1.06 | 4.19 | 4.15 |");
}

#[test]
fn a_later_profile_of_a_case_replaces_the_earlier() {
    // The same case profiled again, its `dh` slower: a re-profiled subset given after a whole run.
    let path = with_dh_line("again", "ms    1.45    1.46    1.46");
    let both = table(&[&data("ncu-case.txt"), &path, &data("sweep-case.jsonl")]);
    let alone = table(&[&path, &data("sweep-case.jsonl")]);
    std::fs::remove_file(&path).unwrap();
    let (Some(both), Some(alone)) = (both, alone) else { return };
    assert_eq!(both, alone, "one row per case, from the later profile");
    has(&both, "|  | dh | 1.46 | 1.11 | 1.02 | 1.54 | 95.7% | 98.6% | 77% (58%) | 41% | clock −4%, idle SMs −4.1%, DRAM |");
    let Some(twice) = table(&[&data("ncu-case.txt"), &data("ncu-case.txt"), &data("sweep-case.jsonl")]) else { return };
    let Some(once) = table(&[&data("ncu-case.txt"), &data("sweep-case.jsonl")]) else { return };
    assert_eq!(twice, once);
}
