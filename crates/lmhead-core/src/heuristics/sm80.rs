//! The portable rules (`Mainloop::MmaSync`): every device of compute capability 8.0 or later
//! that is not sm_90, and an sm_90 device whose Hopper kernels do not load.
//!
//! Each family's `mma.sync` candidates are ranked by the H200's exhaustive trials, where every
//! candidate ran, these included (`docs/results/exhaustive-2026-11-30.jsonl`, `bash
//! .gpu/run-gpu.sh tune-table`, now `exhaustive`): geometric-mean slowdown against the fastest
//! `mma.sync` config of each key, and wins, over the keys of up to 16384 tokens (78 forward keys
//! with and without entropy, 36 d-logits, 18 `dh`, 18 `dW`) and beyond (52, 24, 12, 12); the
//! backward GEMMs' rankings change between the two. A device takes the first configs of the
//! ranking that its shared memory per block holds. Every `mma.sync` candidate needs at most
//! 96 KiB, within both sm_80's 163 KiB and the 99 KiB of sm_86, sm_89 and sm_120, so on those
//! devices the ranking alone decides; a device with less takes the next that fits. Not measured
//! on an sm_80-class device, whose occupancy differs (two 72 KiB blocks fit an sm_80 SM, one an
//! sm_86 SM): the tuner, on by default there, times the short list.
//! (The portable kernels take the plain makespan plan and no fillers: [`super::fwd_plan`].)
//!
//! The device limits these rules read, per architecture the portable module runs on:
//!
//! | compute capability | devices | shared memory per block (opt-in) | registers per block |
//! |---|---|---|---|
//! | 8.0, 8.7 | A100, A30, Jetson Orin | 163 KiB | 64 Ki |
//! | 8.6, 8.9 | A10, A40, RTX 30, L4, L40S, RTX 40 | 99 KiB | 64 Ki |
//! | 9.0 (forced by a test) | H100, H200 | 227 KiB | 64 Ki |
//! | 10.x, 12.x (JIT of the sm_80 PTX) | B200, B300, RTX 50 | 227 KiB (10.x), 99 KiB (12.x) | 64 Ki |
//!
//! Shared memory decides through [`Device::fits`] (the ranking's first configs that fit).
//! Registers never exclude a config: every portable entry carries `.maxntid` of its block size
//! (`lmhead-build`), so ptxas (and the driver's JIT) keep `threads × registers` within the 64 Ki
//! registers a block may hold on every architecture from 8.0 on ([`fits_registers`], checked for
//! every candidate in the tests), spilling rather than failing to launch (`cargo xtask build-ptx`
//! shows 0 spills for sm_80).

use crate::config::{tc, Family, TileConfig};
use crate::Problem;

use super::{Device, Shortlist};

/// Token counts up to which the "few tokens" rankings apply (a bucket boundary).
pub const FEW_TOKENS: usize = 16384;

/// The forwards' ranking (with and without entropy, every `t`): 128 × 256 × 32 s3 (1.013 / 40
/// wins up to 16384 tokens, 1.002 / 46 beyond), 256 × 128 × 32 s3 (1.024 / 35, 1.087 / 3),
/// 128 × 128 × 64 s3 (1.070, 1.078), then the 64-row and 64-column tiles (1.17–1.29), the
/// 4-stage 128 × 128 × 32 (1.23) and 64 × 64 × 64 s4 (1.39–1.43).
pub const FWD: [TileConfig; 7] = [
    tc(128, 256, 32, 3, 2, 4),
    tc(256, 128, 32, 3, 4, 2),
    tc(128, 128, 64, 3, 2, 4),
    tc(64, 128, 64, 3, 2, 2),
    tc(128, 64, 64, 3, 2, 2),
    tc(128, 128, 32, 4, 2, 4),
    tc(64, 64, 64, 4, 2, 2),
];

/// The d-logits' ranking (with and without entropy) up to 16384 tokens: 64 × 128 × 64 s3
/// (1.015, 29 of 36 wins), 256 × 128 × 32 s3 (1.081), 128 × 256 × 32 s3 (1.112), 128 × 64 × 64
/// s3 (1.134), 128 × 128 × 64 s3 (1.180), 64 × 64 × 64 s4 (1.280), 128 × 128 × 32 s4 (1.607).
pub const DLOGITS_FEW: [TileConfig; 7] = [
    tc(64, 128, 64, 3, 2, 2),
    tc(256, 128, 32, 3, 4, 2),
    tc(128, 256, 32, 3, 2, 4),
    tc(128, 64, 64, 3, 2, 2),
    tc(128, 128, 64, 3, 2, 4),
    tc(64, 64, 64, 4, 2, 2),
    tc(128, 128, 32, 4, 2, 4),
];

/// The d-logits' ranking beyond 16384 tokens: 128 × 256 × 32 s3 (1.018, 18 of 24 wins),
/// 64 × 128 × 64 s3 (1.088), 128 × 128 × 64 s3 (1.120), 256 × 128 × 32 s3 (1.163), 128 × 64 × 64
/// s3 (1.324), 64 × 64 × 64 s4 (1.384), 128 × 128 × 32 s4 (1.414).
pub const DLOGITS_MANY: [TileConfig; 7] = [
    tc(128, 256, 32, 3, 2, 4),
    tc(64, 128, 64, 3, 2, 2),
    tc(128, 128, 64, 3, 2, 4),
    tc(256, 128, 32, 3, 4, 2),
    tc(128, 64, 64, 3, 2, 2),
    tc(64, 64, 64, 4, 2, 2),
    tc(128, 128, 32, 4, 2, 4),
];

/// The `dh` GEMM's ranking up to 16384 tokens: 128 × 128 × 64 s3 (1.006, 14 of 18 wins),
/// 64 × 128 × 32 s4 (1.120), 256 × 128 × 32 s3 (1.166), 128 × 128 × 32 s4 (1.172),
/// 128 × 256 × 32 s3 (1.181), 64 × 64 × 64 s4 (1.526).
pub const DH_FEW: [TileConfig; 6] = [
    tc(128, 128, 64, 3, 2, 4),
    tc(64, 128, 32, 4, 2, 2),
    tc(256, 128, 32, 3, 4, 2),
    tc(128, 128, 32, 4, 2, 4),
    tc(128, 256, 32, 3, 2, 4),
    tc(64, 64, 64, 4, 2, 2),
];

/// The `dh` GEMM's ranking beyond 16384 tokens: 128 × 256 × 32 s3 (1.055, 8 of 12 wins),
/// 128 × 128 × 64 s3 (1.065), 128 × 128 × 32 s4 (1.147), 64 × 128 × 32 s4 (1.188),
/// 256 × 128 × 32 s3 (1.214), 64 × 64 × 64 s4 (1.581).
pub const DH_MANY: [TileConfig; 6] = [
    tc(128, 256, 32, 3, 2, 4),
    tc(128, 128, 64, 3, 2, 4),
    tc(128, 128, 32, 4, 2, 4),
    tc(64, 128, 32, 4, 2, 2),
    tc(256, 128, 32, 3, 4, 2),
    tc(64, 64, 64, 4, 2, 2),
];

/// The `dW` GEMM's ranking up to 16384 tokens: 256 × 128 × 32 s3 and 64 × 128 × 32 s4 (both
/// 1.041, 8 wins of 18 each; the first also leads beyond), 128 × 128 × 64 s3 (1.070),
/// 128 × 256 × 32 s3 (1.079), 128 × 128 × 32 s4 (1.151), 64 × 64 × 64 s4 (1.410).
pub const DW_FEW: [TileConfig; 6] = [
    tc(256, 128, 32, 3, 4, 2),
    tc(64, 128, 32, 4, 2, 2),
    tc(128, 128, 64, 3, 2, 4),
    tc(128, 256, 32, 3, 2, 4),
    tc(128, 128, 32, 4, 2, 4),
    tc(64, 64, 64, 4, 2, 2),
];

/// The `dW` GEMM's ranking beyond 16384 tokens: 256 × 128 × 32 s3 (1.005, 10 of 12 wins),
/// 128 × 256 × 32 s3 (1.035), 128 × 128 × 64 s3 (1.102), 128 × 128 × 32 s4 (1.187),
/// 64 × 128 × 32 s4 (1.251), 64 × 64 × 64 s4 (1.619).
pub const DW_MANY: [TileConfig; 6] = [
    tc(256, 128, 32, 3, 4, 2),
    tc(128, 256, 32, 3, 2, 4),
    tc(128, 128, 64, 3, 2, 4),
    tc(128, 128, 32, 4, 2, 4),
    tc(64, 128, 32, 4, 2, 2),
    tc(64, 64, 64, 4, 2, 2),
];

/// The ranking of `family`'s `mma.sync` candidates at `t` tokens, fastest first.
pub const fn ranking(family: Family, t: usize) -> &'static [TileConfig] {
    let few = t <= FEW_TOKENS;
    match family {
        Family::Fwd | Family::FwdEnt => &FWD,
        Family::BwdDlogits | Family::BwdDlogitsEnt if few => &DLOGITS_FEW,
        Family::BwdDlogits | Family::BwdDlogitsEnt => &DLOGITS_MANY,
        Family::BwdDh if few => &DH_FEW,
        Family::BwdDh => &DH_MANY,
        Family::BwdDw if few => &DW_FEW,
        Family::BwdDw => &DW_MANY,
    }
}

/// Registers one block may hold on every architecture from 8.0 on.
pub const REGISTERS_PER_BLOCK: u32 = 65_536;
/// Registers one thread may use (ptxas's ceiling).
pub const MAX_REGISTERS_PER_THREAD: u32 = 255;

/// Whether `c`'s block fits the register file at any register count ptxas may choose under its
/// `.maxntid` (at most [`MAX_REGISTERS_PER_THREAD`], and at most `REGISTERS_PER_BLOCK / threads`).
pub const fn fits_registers(c: TileConfig) -> bool {
    let per_thread = REGISTERS_PER_BLOCK / c.threads();
    per_thread >= 32 && c.threads() <= 1024
}

/// What the tuner may time for `family` at `p` on `dev`: the first configs of [`ranking`] that
/// fit its shared memory and registers, the rule's pick first.
pub fn shortlist(family: Family, p: Problem, dev: &Device) -> Shortlist {
    let mut ranked = [family.fallback(); 8];
    let mut n = 0;
    for &c in ranking(family, p.t) {
        if fits_registers(c) && n < ranked.len() {
            ranked[n] = c;
            n += 1;
        }
    }
    Shortlist::of(family, &ranked[..n], dev)
}
