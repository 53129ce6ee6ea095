//! The order in which the active-row kernels place rows (`kernels-gpu/src/compact.rs`), as a CPU
//! model: the same blocks, steps and warps, so that a test can check the order and
//! completeness of the compaction without a GPU.
//!
//! The rows `[0, t)` are cut into blocks of [`ROWS_PER_BLOCK`]; block `b`'s thread `x` (of
//! [`THREADS`]) looks at the rows `b·ROWS_PER_BLOCK + k·THREADS + x` for steps `k < STEPS`.
//! `ACTIVE_COUNT` writes each block's count of active rows; `ACTIVE_PLACE` gives block `b` the
//! offset `Σ counts[0..b)` and ranks its active rows step by step, warp by warp, lane by lane:
//! rows in ascending order. So the compact index list is the active rows in row order, written
//! without atomics (the only atomic is the addition of the block counts into the total, whose
//! result does not depend on the order), and identical across runs.

/// Threads per block of the active-row kernels (`config::fixed::THREADS`).
pub const THREADS: u32 = crate::config::fixed::THREADS;
/// Rows each thread looks at, one per step.
pub const STEPS: u32 = 8;
/// Rows per block.
pub const ROWS_PER_BLOCK: u32 = THREADS * STEPS;
/// The row → slot map's value for an inactive row.
pub const NO_SLOT: u32 = u32::MAX;

/// Blocks of the count and place kernels over `t` rows.
pub const fn blocks(t: usize) -> usize {
    t.div_ceil(ROWS_PER_BLOCK as usize)
}

/// Row `x` of step `k` of block `b`.
pub const fn row_of(b: u32, k: u32, x: u32) -> u64 {
    b as u64 * ROWS_PER_BLOCK as u64 + (k * THREADS + x) as u64
}

/// The placement of [`ROWS_PER_BLOCK`]-row blocks as the kernels do it: `idx[slot] = row` for the
/// active rows, `slot_of[row]` = the slot or [`NO_SLOT`], `counts[b]` = block `b`'s active rows.
/// `active.len()` rows; `counts` holds [`blocks`] entries, `slot_of` `active.len()`, `idx` at
/// least the active count. Returns the active count.
pub fn place(active: &[bool], counts: &mut [u32], idx: &mut [u32], slot_of: &mut [u32]) -> u32 {
    let t = active.len() as u64;
    let is_active = |r: u64| r < t && active[r as usize];
    // ACTIVE_COUNT: one count per block.
    for (b, c) in counts.iter_mut().enumerate().take(blocks(active.len())) {
        *c = (0..STEPS).flat_map(|k| (0..THREADS).map(move |x| row_of(b as u32, k, x))).filter(|&r| is_active(r)).count() as u32;
    }
    // ACTIVE_PLACE: the block's offset, then per step the warps' counts before this warp and the
    // lanes' before this lane.
    let mut total = 0;
    for b in 0..blocks(active.len()) as u32 {
        let offset: u32 = counts[..b as usize].iter().sum();
        let mut base = 0;
        for k in 0..STEPS {
            for x in 0..THREADS {
                let r = row_of(b, k, x);
                if r >= t {
                    continue;
                }
                let (warp, lane) = (x / 32, x % 32);
                let before_warp = (0..warp * 32).filter(|&y| is_active(row_of(b, k, y))).count() as u32;
                let before_lane = (0..lane).filter(|&l| is_active(row_of(b, k, warp * 32 + l))).count() as u32;
                if is_active(r) {
                    let s = offset + base + before_warp + before_lane;
                    idx[s as usize] = r as u32;
                    slot_of[r as usize] = s;
                } else {
                    slot_of[r as usize] = NO_SLOT;
                }
            }
            base += (0..THREADS).filter(|&x| is_active(row_of(b, k, x))).count() as u32;
        }
        total = offset + base;
    }
    total
}

#[cfg(all(test, feature = "std"))]
mod tests {
    use super::*;
    use std::vec;
    use std::vec::Vec;

    /// A small deterministic generator (the reference's RNG is not a dependency of this crate).
    fn lcg(s: &mut u64) -> u64 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *s >> 33
    }

    fn check(active: &[bool]) {
        let t = active.len();
        let mut counts = vec![0u32; blocks(t)];
        let mut idx = vec![NO_SLOT; t];
        let mut slot = vec![7u32; t];
        let n = place(active, &mut counts, &mut idx, &mut slot);
        let want: Vec<u32> = (0..t as u32).filter(|&r| active[r as usize]).collect();
        assert_eq!(n as usize, want.len());
        assert_eq!(&idx[..want.len()], &want[..], "the active rows in row order");
        for r in 0..t {
            match want.binary_search(&(r as u32)) {
                Ok(s) => assert_eq!(slot[r], s as u32),
                Err(_) => assert_eq!(slot[r], NO_SLOT),
            }
        }
        assert_eq!(counts.iter().sum::<u32>(), n);
    }

    #[test]
    fn placement_is_the_active_rows_in_order() {
        let mut s = 5;
        for t in [0usize, 1, 2, 31, 32, 33, 255, 256, 257, 2047, 2048, 2049, 5000, 3 * 2048 + 129] {
            check(&vec![true; t]);
            check(&vec![false; t]);
            for p in [1u64, 10, 50, 90] {
                let a: Vec<bool> = (0..t).map(|_| lcg(&mut s) % 100 < p).collect();
                check(&a);
            }
            // Spans: a suffix, and runs crossing warp, step and block edges.
            check(&(0..t).map(|r| r >= t / 3).collect::<Vec<_>>());
            check(&(0..t).map(|r| (r / 100) % 2 == 1).collect::<Vec<_>>());
        }
    }

    #[test]
    fn rows_of_a_block_cover_it_once() {
        let mut seen = vec![false; ROWS_PER_BLOCK as usize];
        for k in 0..STEPS {
            for x in 0..THREADS {
                let r = row_of(0, k, x) as usize;
                assert!(!seen[r]);
                seen[r] = true;
            }
        }
        assert!(seen.iter().all(|&x| x));
        assert_eq!(row_of(2, 0, 0), 2 * ROWS_PER_BLOCK as u64);
        assert_eq!(blocks(0), 0);
        assert_eq!(blocks(2049), 2);
    }
}
