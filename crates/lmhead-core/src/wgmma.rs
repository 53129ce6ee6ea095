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
//! The kernels keep every operand K-major with the 128-byte swizzle: a row of 64 bf16 is one
//! 128-byte line, 16-byte chunk `c` of row `r` lives at chunk `c ^ (r % 8)`, and eight rows form a
//! 1024-byte atom. One `k16` step reads 32 bytes of each row, so the K extent never crosses a
//! row: the leading-dimension offset is unused (1 by convention) and the stride between 8-row
//! atoms is 1024 bytes. Advancing to the next `k16` step adds 32 bytes to the start address.

/// Descriptor of a K-major, 128-byte-swizzled operand whose first row starts at `addr`
/// (must be 1024-byte aligned for the first k16 step; later steps add 32 bytes).
pub const fn desc_k_major_sw128(addr: u32) -> u64 {
    let start = ((addr as u64) >> 4) & 0x3FFF;
    let lbo = 1u64;
    let sbo = 1024u64 >> 4;
    start | (lbo << 16) | (sbo << 32) | (1u64 << 62)
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
    }
}
