//! Shared test harness: run seeds (printed, replayable with `LMHEAD_SEED`), GPU detection that
//! skips with a printed reason, uploads, and the one `check` that compares an output with its
//! reference and reports the first bad indices.

use std::sync::Arc;

use lmhead::cudarc::driver::CudaStream;
use lmhead::LmHead;
use lmhead_reference::metrics::{compare, Compare};

pub use lmhead_reference::rng::seed_from_env;

/// Whether this run forces the portable module (`LMHEAD_TEST_MODULE=portable`, read by the
/// library only in its `testing` builds): the sm_80 PTX JIT-compiled on the H200, holding the
/// `MmaSync` kernels only. `docs/run-gpu.sh portable` sets it.
pub fn portable() -> bool {
    std::env::var("LMHEAD_TEST_MODULE").is_ok_and(|v| v.trim() == "portable")
}

/// Whether the module under test holds `c` (the portable one has no `Sm90` kernel).
pub fn held(c: &lmhead::TileConfig) -> bool {
    !(portable() && c.is_sm90())
}

/// `Choice::Fixed(c)` where the module under test holds `c`; else (an `Sm90` config under the
/// portable module) `Choice::Auto`, the portable rules' pick, so the case still runs.
pub fn fixed_or_auto(c: lmhead::TileConfig) -> lmhead::Choice {
    if held(&c) {
        lmhead::Choice::Fixed(c)
    } else {
        lmhead::Choice::Auto
    }
}

/// Prints a SKIP line and returns true where a test exercises only `Sm90` kernels and the
/// portable module is under test.
pub fn skip_sm90_only(test: &str) -> bool {
    if portable() {
        println!("SKIP {test}: LMHEAD_TEST_MODULE=portable (the portable module has no Sm90 kernels)");
    }
    portable()
}

/// The run seed of a test, printed so a failure can be replayed with `LMHEAD_SEED=<seed>`.
pub fn run_seed(test: &str) -> u64 {
    let s = seed_from_env();
    println!("[{test}] seed {s} (replay: LMHEAD_SEED={s})");
    s
}

/// Seed of case `i` of a run.
pub fn case_seed(run: u64, i: usize) -> u64 {
    lmhead_reference::rng::Rng::new(run ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

/// The GPU, or `None` with the reason printed. GPU tests run whenever a CUDA driver is present
/// (set `LMHEAD_GPU_TESTS=0` to skip them); with `LMHEAD_GPU_TESTS=1` a missing GPU is a failure,
/// so a run on the device cannot pass by skipping. The launch plans' measurement overrides
/// (`LMHEAD_FWD_*`, `LMHEAD_BWD_*`: `lmhead::testing::PLAN_OVERRIDE_VARS`) are read here and set
/// for the process, so that `run-gpu.sh fills` can force plans on the tests.
pub fn gpu_or_skip(test: &str) -> Option<(LmHead, Arc<CudaStream>)> {
    let want = std::env::var("LMHEAD_GPU_TESTS").ok();
    if want.as_deref() == Some("0") {
        println!("SKIP {test}: LMHEAD_GPU_TESTS=0");
        return None;
    }
    if !lmhead::driver_present() {
        assert!(want.as_deref() != Some("1"), "{test}: LMHEAD_GPU_TESTS=1 but no CUDA driver is present");
        println!("SKIP {test}: no CUDA driver on this machine (GPU tests need an H100/H200)");
        return None;
    }
    let overrides = lmhead::testing::PlanOverrides::from_env();
    if overrides != lmhead::testing::PlanOverrides::default() {
        println!("[{test}] plan overrides from the environment: {overrides:?}");
    }
    lmhead::testing::set_plan_overrides(overrides);
    match LmHead::new(0) {
        Ok(head) => {
            let stream = head.gpu().context().default_stream();
            println!("[{test}] device: {:?}; kernels: {}", head.gpu().info(), head.gpu().loader());
            Some((head, stream))
        }
        Err(e) => {
            assert!(want.as_deref() != Some("1"), "{test}: LMHEAD_GPU_TESTS=1 but the GPU could not be opened: {e}");
            println!("SKIP {test}: {e}");
            None
        }
    }
}

/// The forward's accumulation tolerance of a row whose relevant logits have magnitude `mag`, at
/// hidden size `d`: `mag·2⁻²²·(d/16 + 4)` (the tensor cores' f32 sums round toward zero, ~2 ulp per
/// k16 step; derivation in `tests/gpu_fwd.rs`).
pub fn fwd_acc_tol(mag: f64, d: usize) -> f64 {
    mag * f64::powi(2.0, -22) * (d as f64 / 16.0 + 4.0)
}

/// Tolerance of one element: `|x − r| ≤ tol(r, i)`.
pub type Tol<'a> = &'a dyn Fn(usize, f64) -> f64;

/// Compare `x` with `r` element-wise under `tol`, plus the global guards (no NaN where the
/// reference is finite, a non-zero reference). Returns the summary; panics with the first bad
/// indices, the case description and the seed.
#[track_caller]
pub fn check(what: &str, case: &str, x: &[f64], r: &[f64], tol: Tol) -> Compare {
    assert_eq!(x.len(), r.len(), "{what} [{case}]: length");
    let c = compare(x, r, 1e-6);
    let mut bad = Vec::new();
    for (i, (&a, &b)) in x.iter().zip(r).enumerate() {
        let ok = if b.is_nan() {
            a.is_nan()
        } else if b.is_infinite() {
            a == b
        } else {
            a.is_finite() && (a - b).abs() <= tol(i, b)
        };
        if !ok {
            bad.push(i);
        }
    }
    if !bad.is_empty() || c.nonfinite > 0 {
        let lines: Vec<String> =
            bad.iter().take(8).map(|&i| format!("  [{i}] got {:.9e} want {:.9e} (tol {:.3e})", x[i], r[i], tol(i, r[i]))).collect();
        panic!("{what} [{case}]: {} of {} elements out of tolerance; {c:?}\n{}", bad.len(), x.len(), lines.join("\n"));
    }
    c
}

/// Relative-L2 check with a norm guard (an all-zero reference proves nothing).
#[track_caller]
pub fn check_rel_l2(what: &str, case: &str, x: &[f64], r: &[f64], max_rel_l2: f64) -> Compare {
    let c = compare_nonzero_finite(what, case, x, r);
    if c.rel_l2 > max_rel_l2 {
        panic!(
            "{what} [{case}]: rel_l2 {:.3e} > {max_rel_l2:.1e}; worst [{}] got {:.6e} want {:.6e}; {c:?}",
            c.rel_l2, c.worst, x[c.worst], r[c.worst]
        );
    }
    c
}

/// [`check_rel_l2`] for a sum whose terms were rounded (the backward's bf16-staged d-logits):
/// `‖x − r‖ ≤ max_rel · max(‖r‖, ‖rss‖)`, where `rss` is the root sum of squares of each
/// element's terms (`backward_dh_rows_rss`). Rounding each term moves an element by a fraction of
/// its terms' scale, not of the element: when the terms cancel, `‖r‖` alone would call an exact
/// kernel wrong. Returns the comparison and the norm used.
#[track_caller]
pub fn check_rel_l2_terms(what: &str, case: &str, x: &[f64], r: &[f64], rss: &[f64], max_rel: f64) -> (Compare, f64) {
    assert_eq!(r.len(), rss.len(), "{what} [{case}]: rss length");
    let c = compare_nonzero_finite(what, case, x, r);
    let scale = c.ref_norm.max(rss.iter().map(|v| v * v).sum::<f64>().sqrt());
    let err = c.rel_l2 * c.ref_norm;
    if err > max_rel * scale {
        panic!(
            "{what} [{case}]: ‖Δ‖ {err:.3e} > {max_rel:.1e} · max(‖ref‖ {:.3e}, ‖rss‖ {scale:.3e}); worst [{}] got {:.6e} want {:.6e}; {c:?}",
            c.ref_norm, c.worst, x[c.worst], r[c.worst]
        );
    }
    (c, scale)
}

/// [`compare`] with the guards both L2 checks need: a non-zero reference (an all-zero one proves
/// nothing) and no non-finite element.
#[track_caller]
fn compare_nonzero_finite(what: &str, case: &str, x: &[f64], r: &[f64]) -> Compare {
    let c = compare(x, r, 1e-6);
    assert!(c.ref_norm > 0.0, "{what} [{case}]: reference is all zeros, the check would prove nothing");
    assert_eq!(c.nonfinite, 0, "{what} [{case}]: {} non-finite elements; {c:?}", c.nonfinite);
    c
}
