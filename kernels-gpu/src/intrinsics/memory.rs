//! Memory accesses: `cp.async` global-to-shared copies and their groups, vector loads and stores
//! of shared and global memory, and the global reductions (`red.global`).

use super::SmemAddr;
use core::arch::asm;

/// `cp.async.cg.shared.global` of 16 bytes, zero-filling when `valid` is false.
///
/// # Safety
/// `dst` must be a 16-byte aligned address inside the block's shared memory. When `valid`,
/// `src` must point to 16 readable, 16-byte aligned bytes of global memory; when not, nothing is
/// read from `src` (source size 0), but it must still be a global address.
#[inline(always)]
pub unsafe fn cp_async_16(dst: SmemAddr, src: *const u8, valid: bool) {
    let size: u32 = if valid { 16 } else { 0 };
    // SAFETY: the caller guarantees both addresses; `size` ≤ 16.
    unsafe {
        asm!(
            "cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
            d = in(reg32) dst,
            s = in(reg64) src,
            n = in(reg32) size,
            options(nostack)
        )
    };
}

/// `cp.async.commit_group`: closes the group of `cp.async` issued by this thread so far.
#[inline(always)]
pub fn cp_async_commit() {
    // SAFETY: committing a (possibly empty) group has no preconditions.
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

/// `cp.async.wait_group N`: waits until at most `N` of this thread's groups are pending.
#[inline(always)]
pub fn cp_async_wait<const N: usize>() {
    // SAFETY: waiting has no preconditions.
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) };
}

/// `st.shared.v4.f32`.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_v4(addr: SmemAddr, v: [f32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.shared.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `st.shared.v2.f32`.
///
/// # Safety
/// `addr` must be an 8-byte aligned shared address with 8 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_v2(addr: SmemAddr, a: f32, b: f32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.shared.v2.f32 [{p}], {{{a}, {b}}};", p = in(reg32) addr, a = in(reg32) a, b = in(reg32) b, options(nostack)) };
}

/// `ld.shared.v4.f32`.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_shared_v4(addr: SmemAddr) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg32) addr, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `st.shared.u16`.
///
/// # Safety
/// `addr` must be a 2-byte aligned shared address with 2 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_u16(addr: SmemAddr, v: u16) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.shared.u16 [{p}], {v};", p = in(reg32) addr, v = in(reg16) v, options(nostack)) };
}

/// `ld.shared.u16`.
///
/// # Safety
/// `addr` must be a 2-byte aligned shared address with 2 readable bytes.
#[inline(always)]
pub unsafe fn ld_shared_u16(addr: SmemAddr) -> u16 {
    let v: u16;
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("ld.shared.u16 {v}, [{p}];", p = in(reg32) addr, v = out(reg16) v, options(nostack, readonly)) };
    v
}

/// `st.global.v4.f32`.
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_global_v4(p: *mut f32, v: [f32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.global.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `ld.global.v4.f32`.
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_v4(p: *const f32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.global.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `ld.global.v4.b32`: 16 bytes as four raw 32-bit words (bit patterns kept as they are).
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_v4_b32(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.global.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `st.global.v4.b32`: four raw 32-bit words.
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_global_v4_b32(p: *mut u32, v: [u32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `st.shared.v4.b32`: four raw 32-bit words.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_v4_b32(addr: SmemAddr, v: [u32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.shared.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `st.global.v2.f32`.
///
/// # Safety
/// `p` must be an 8-byte aligned global address with 8 writable bytes.
#[inline(always)]
pub unsafe fn st_global_v2(p: *mut f32, a: f32, b: f32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.global.v2.f32 [{p}], {{{a}, {b}}};", p = in(reg64) p, a = in(reg32) a, b = in(reg32) b, options(nostack)) };
}

/// `ld.global.v2.f32`.
///
/// # Safety
/// `p` must be an 8-byte aligned global address with 8 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_v2(p: *const f32) -> (f32, f32) {
    let (a, b): (f32, f32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!("ld.global.v2.f32 {{{a}, {b}}}, [{p}];", p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, options(nostack, readonly))
    };
    (a, b)
}

/// `atom.global.or.b32`.
///
/// # Safety
/// `p` must be a 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atomic_or(p: *mut u32, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("red.global.or.b32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) };
}

/// `red.global.min.u32`: atomically lowers the `u32` at `p` to `v` if `v` is smaller.
///
/// # Safety
/// `p` is a valid, 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atomic_min(p: *mut u32, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("red.global.min.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) };
}

/// `red.global.add.u32`: atomically adds `v` to the `u32` at `p` (wrapping).
///
/// # Safety
/// `p` is a valid, 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atomic_add(p: *mut u32, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("red.global.add.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) };
}

/// `st.shared.u32`.
///
/// # Safety
/// `addr` must be a 4-byte aligned shared address with 4 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_u32(addr: SmemAddr, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.shared.u32 [{p}], {v};", p = in(reg32) addr, v = in(reg32) v, options(nostack)) };
}

/// `ld.shared.u32`.
///
/// # Safety
/// `addr` must be a 4-byte aligned shared address with 4 readable bytes.
#[inline(always)]
pub unsafe fn ld_shared_u32(addr: SmemAddr) -> u32 {
    let v: u32;
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("ld.shared.u32 {v}, [{p}];", p = in(reg32) addr, v = out(reg32) v, options(nostack, readonly)) };
    v
}

/// `st.global.cs.b32`: a streaming store of 4 bytes (evict first: data written once and read
/// back much later, which should not push the operands out of L2).
///
/// # Safety
/// `p` must be a 4-byte aligned global address with 4 writable bytes.
#[inline(always)]
pub unsafe fn st_global_cs_b32(p: *mut u32, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.global.cs.b32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) };
}

/// `ld.global.cs.v4.b32`: a streaming load of 16 bytes (data read once).
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_cs_v4_b32(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.global.cs.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}
