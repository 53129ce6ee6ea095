//! Shared-memory matrix descriptors of Hopper's `wgmma` (PTX ISA, "matrix descriptor format"),
//! built by a small pure function so that the bit layout is tested on the CPU.
//!
//! ```text
//! bits  0–13  start address >> 4        (shared window, 16-byte units)
//! bits 16–29  leading-dimension byte offset >> 4
//! bits 32–45  stride-dimension byte offset >> 4
//! bits 49–51  matrix base offset (0: swizzle atoms 1024-byte aligned)
//! bits 62–63  swizzle: 0 none, 1 128B, 2 64B, 3 32B
//! ```
//!
//! Most operands are K-major with the 128-byte swizzle: a row of 64 bf16 is one
//! 128-byte line, 16-byte chunk `c` of row `r` lives at chunk `c ^ (r % 8)`, and eight rows form a
//! 1024-byte atom. One `k16` step reads 32 bytes of each row, so the K extent never crosses a
//! row: the leading-dimension offset is unused (1 by convention) and the stride between 8-row
//! atoms is 1024 bytes. Advancing to the next `k16` step adds 32 bytes to the start address.
//! The MN-major form ([`desc_mn_major_sw128`]) describes the backward GEMMs' in-place operands
//! (the `W` chunk, the staging buffer and `h` read as stored, `imm-trans-a/b = 1`).

/// A 128-byte-swizzle descriptor with explicit leading- and stride-dimension byte offsets.
pub const fn desc_sw128(addr: u32, lbo_bytes: u32, sbo_bytes: u32) -> u64 {
    let start = ((addr as u64) >> 4) & 0x3FFF;
    let lbo = ((lbo_bytes as u64) >> 4) & 0x3FFF;
    let sbo = ((sbo_bytes as u64) >> 4) & 0x3FFF;
    start | (lbo << 16) | (sbo << 32) | (1u64 << 62)
}

/// Descriptor of a K-major, 128-byte-swizzled operand whose first row starts at `addr`
/// (must be 1024-byte aligned for the first k16 step; later steps add 32 bytes).
pub const fn desc_k_major_sw128(addr: u32) -> u64 {
    desc_sw128(addr, 16, 1024)
}

/// Descriptor of an MN-major, 128-byte-swizzled operand (for `imm-trans-a/b = 1`): the operand
/// is stored as slabs of 64 MN elements, each slab `slab_bytes` apart and made of 128-byte K
/// rows (8-row swizzle atoms of 1024 bytes, as a TMA box of 64 × K rows lands). `addr` is the
/// k16 step's first K row in slab 0 (a step is 16 rows: +2048 bytes). The offsets follow the
/// canonical MN-major layout `((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO))` in elements:
/// the leading offset steps between MN slabs, the stride offset between 8-row K atoms. Checked
/// against an f64 product by `tests/gpu_units.rs::wgmma_mn_major_b_matches_f64`, which also
/// tries the two offsets the other way round.
pub const fn desc_mn_major_sw128(addr: u32, slab_bytes: u32) -> u64 {
    desc_sw128(addr, slab_bytes, 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_land_where_the_isa_puts_them() {
        let d = desc_k_major_sw128(0x1_2340);
        assert_eq!(d & 0x3FFF, 0x1234);
        assert_eq!((d >> 16) & 0x3FFF, 1);
        assert_eq!((d >> 32) & 0x3FFF, 64);
        assert_eq!((d >> 49) & 0x7, 0);
        assert_eq!(d >> 62, 1);
        // The next k16 step: +32 bytes = +2 in the address field, nothing else moves.
        assert_eq!(desc_k_major_sw128(0x1_2340 + 32), d + 2);
        let m = desc_mn_major_sw128(0x400, 8192);
        assert_eq!(m & 0x3FFF, 0x40);
        assert_eq!((m >> 16) & 0x3FFF, 512);
        assert_eq!((m >> 32) & 0x3FFF, 64);
        assert_eq!(m >> 62, 1);
    }
}
