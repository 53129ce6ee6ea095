//! The benchmark's result records: `lmhead-bench` writes one JSON object per measured shape
//! (`{gpu, driver, commit, suite, timestamp, tuning, row}`), `cargo xtask bench-report` reads
//! them back. These are the `row` part, shared so that writer and reader cannot drift apart.
//! Fields added after the first results were committed default when absent.

use serde::{Deserialize, Serialize};
use std::format;
use std::string::{String, ToString};
use std::vec::Vec;

/// One measured operation, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    #[serde(default)]
    pub p20: f64,
    /// The median: the figure every table uses.
    pub p50: f64,
    #[serde(default)]
    pub p80: f64,
}

/// The shape of one measurement: a rank-local shape of a logical case (`tokens` split over `cp`
/// ranks, the vocab over `tp`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Case {
    pub model: String,
    pub tokens: usize,
    pub tp: usize,
    pub cp: usize,
    pub t: usize,
    pub v: usize,
    pub d: usize,
    /// Whether forward+backward was timed too.
    #[serde(default)]
    pub backward: bool,
}

impl Case {
    /// `model/tok{k}k/tp{TP}cp{CP}` (`tok{n}` when `tokens` is not a multiple of 1024).
    pub fn name(&self) -> String {
        let tok = match self.tokens % 1024 {
            0 => format!("{}k", self.tokens / 1024),
            _ => self.tokens.to_string(),
        };
        format!("{}/tok{}/tp{}cp{}", self.model, tok, self.tp, self.cp)
    }

    /// FLOP of one logits GEMM, `2·t·v·d`.
    pub fn gemm_flop(&self) -> f64 {
        2.0 * self.t as f64 * self.v as f64 * self.d as f64
    }
}

/// Everything measured for one shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub case: Case,
    /// cuBLAS bf16 GEMM of the same `(t, v, d)`.
    pub gemm: Timing,
    pub fwd: Timing,
    pub fwd_ent: Timing,
    /// `null` when the case has no backward pass.
    pub fwd_bwd: Option<Timing>,
    /// The configs the forward, the forward with entropy and the backward ran with.
    #[serde(default)]
    pub fwd_cfg: String,
    #[serde(default)]
    pub fwd_ent_cfg: String,
    #[serde(default)]
    pub bwd_cfg: String,
    /// The launch plans the forward and the forward with entropy ran with (absent in records
    /// written before they were recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fwd_plan: Option<Plan>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fwd_ent_plan: Option<Plan>,
    pub workspace_mib: f64,
    /// Largest |Δ log-prob| of the timed forwards against the f64 reference on sampled rows
    /// (`null` with `--no-check`).
    #[serde(default)]
    pub check_max_abs: Option<f64>,
}

/// A forward's launch plan: vocab splits, token tiles per raster group (0 = plain order) and
/// tiles per filler block (0 = none); see `lmhead_core::split::SplitPlan`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub splits: u32,
    pub raster: u32,
    pub fill: u32,
}

/// One tensor-parallel measurement of `lmhead-bench tp`: a whole problem (`tokens × v_total × d`)
/// split by vocab over `tp` GPUs, one rank per GPU over NCCL (`tp = 1`: one GPU, no
/// communicator). Every timing is the slowest rank's (each rank's median over the rounds; the
/// step waits for the slowest rank).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TpRow {
    pub model: String,
    pub tokens: usize,
    pub v_total: usize,
    pub d: usize,
    pub tp: usize,
    /// The largest rank's vocab rows.
    pub v_local: usize,
    /// cuBLAS bf16 GEMM of the rank-local shape `(tokens, v_local, d)`.
    pub gemm: Timing,
    /// The TP forward with entropy through a communicator that reduces nothing: the rank's fused
    /// kernels (mainloop, split merge, finish) without communication.
    pub fused: Timing,
    /// End to end per rank: forward with entropy, forward log-prob only, forward with entropy
    /// + backward with `dh` all-reduced (bf16 `dh`, `dW`).
    pub fwd_ent: Timing,
    pub fwd_lp: Timing,
    pub fwd_bwd: Timing,
    /// Time inside the all-reduces (CUDA events around each on the rank's stream; includes
    /// waiting for the other ranks): of the forward with entropy, and of forward+backward.
    pub ar_fwd: Timing,
    pub ar_fwd_bwd: Timing,
    /// Every rank's median forward-with-entropy time, rank 0 first.
    pub per_rank_fwd_ent: Vec<f64>,
    /// Rank 0's forward-with-entropy config.
    pub fwd_ent_cfg: String,
    /// Largest |Δ log-prob| of rank 0's TP forward against the f64 reference on sampled rows.
    pub check_max_abs: Option<f64>,
}

/// One case of `lmhead-bench active`: a batch of `t` tokens whose mask (`layout`, `fraction`
/// of the rows active, `active` of them) leaves the other labels `ignore_index`, each operation
/// timed in the same rounds three ways, with the label check on: the dense call on all rows
/// (`Compaction::Off`), the library's call (`Compaction::Auto`: compacted where that pays), and
/// the dense call on only the active rows, compacted beforehand (the ideal); beside cuBLAS's GEMM
/// of the dense shape. The forward is log-prob only; the step is the forward with entropy and the
/// backward of both (bf16 `dh`, `dW`). Records are `{gpu, driver, commit, suite, timestamp,
/// tuning, active_row}`, in their own file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActiveRow {
    pub model: String,
    pub t: usize,
    pub v: usize,
    pub d: usize,
    /// `suffix` (one prompt, then one response) or `multi-turn` (8 packed turns).
    pub layout: String,
    pub fraction: f64,
    pub active: usize,
    pub gemm: Timing,
    pub fwd_dense: Timing,
    pub fwd_active: Timing,
    pub fwd_ideal: Timing,
    pub step_dense: Timing,
    pub step_active: Timing,
    pub step_ideal: Timing,
    /// Rows the library's calls ran (`FwdReport::rows`, `BwdReport::rows`).
    pub fwd_rows: usize,
    pub bwd_rows: usize,
    /// The library's forward config and backward configs.
    pub fwd_cfg: String,
    pub bwd_cfg: String,
    /// Largest |Δ log-prob| of the timed forwards against the f64 reference on sampled active
    /// rows (`null` with `--no-check`).
    #[serde(default)]
    pub check_max_abs: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let c = |tokens| Case { model: "m".into(), tokens, tp: 2, cp: 4, t: 1, v: 1, d: 1, backward: false };
        assert_eq!(c(16384).name(), "m/tok16k/tp2cp4");
        assert_eq!(c(20000).name(), "m/tok20000/tp2cp4");
    }
}
