//! The `wgmma` side of the sm90 mainloop: the warpgroup accumulators ([`WgAcc`]), the shared-memory
//! operand descriptors (K-major, or MN-major in [`SLAB_BYTES`] slabs) and one k16 step of the
//! warpgroup's tile ([`wgmma_k16`]).

use crate::intrinsics::{self, SmemAddr};
use lmhead_core::wgmma::{desc_k_major_sw128, desc_mn_major_sw128};

/// Accumulators of one warp: `NW` blocks of 128 columns, each two halves of one m16 × eight n8
/// tiles (the `wgmma_m64n128k16_bf16` operand).
pub(crate) type WgAcc<const NW: usize> = [[[[f32; 4]; 8]; 2]; NW];

/// Bytes of one MN-major slab: 64 MN elements (one 128-byte line) × 64 K rows.
pub(super) const SLAB_BYTES: u32 = 64 * 128;

/// Bytes a k16 step advances an operand's shared-memory address: 16 bf16 along a K-major
/// operand's 128-byte rows, 16 rows of an MN-major operand's slabs.
pub(super) const fn k16_bytes(mn: bool) -> u32 {
    if mn {
        16 * 128
    } else {
        32
    }
}

/// The `wgmma` descriptor of a 128B-swizzled operand tile at `addr`, K-major or (`MN`) MN-major
/// in [`SLAB_BYTES`] slabs (`lmhead_core::wgmma`).
#[inline(always)]
fn operand_desc<const MN: bool>(addr: SmemAddr) -> u64 {
    if MN {
        desc_mn_major_sw128(addr, SLAB_BYTES)
    } else {
        desc_k_major_sw128(addr)
    }
}

/// One k16 step of the warpgroup's `64 × 128·NW` tile: a single `m64n256k16` for two column
/// blocks (A read once), else one `m64n128k16` per block. `AMN` / `BMN`: that operand is
/// MN-major ([`SLAB_BYTES`] slabs, read with `imm-trans`), else K-major.
///
/// # Safety
/// As [`intrinsics::wgmma_m64n128k16_bf16`]: `a_s`/`b_s` address the k16 slice of a loaded
/// 128B-swizzled A (64 rows) and B (`128·NW` rows) tile of the named layouts.
#[inline(always)]
pub(crate) unsafe fn wgmma_k16<const NW: usize, const AMN: bool, const BMN: bool>(
    acc: &mut WgAcc<NW>,
    a_s: SmemAddr,
    b_s: SmemAddr,
    accumulate: bool,
) {
    let ad = operand_desc::<AMN>(a_s);
    if NW == 2 {
        let pair: &mut [[[[f32; 4]; 8]; 2]; 2] = (&mut acc[..]).try_into().unwrap_or_else(|_| intrinsics::trap());
        // SAFETY: forwarded contract; B's 256 rows are consecutive 128-byte lines (K-major) or
        // four consecutive slabs (MN-major), 8-row atoms 1024 bytes apart either way.
        unsafe { intrinsics::wgmma_m64n256k16_bf16::<AMN, BMN>(pair, ad, operand_desc::<BMN>(b_s), accumulate) };
    } else {
        // SAFETY: forwarded contract.
        unsafe { wgmma_k16_n128::<NW, AMN, BMN>(acc, a_s, b_s, accumulate) };
    }
}

/// One k16 step as `NW` `m64n128k16` instructions, one per 128-column block.
///
/// # Safety
/// As [`wgmma_k16`].
#[inline(always)]
unsafe fn wgmma_k16_n128<const NW: usize, const AMN: bool, const BMN: bool>(
    acc: &mut WgAcc<NW>,
    a_s: SmemAddr,
    b_s: SmemAddr,
    accumulate: bool,
) {
    let ad = operand_desc::<AMN>(a_s);
    unroll!(NW, |nb| {
        // SAFETY: forwarded contract; block `nb` of B starts 16 KiB further in both layouts (128
        // lines, or two slabs).
        unsafe {
            intrinsics::wgmma_m64n128k16_bf16::<AMN, BMN>(&mut acc[nb], ad, operand_desc::<BMN>(b_s + (nb * 128 * 128) as u32), accumulate)
        };
    });
}
