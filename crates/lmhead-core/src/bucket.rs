//! Power-of-two token buckets: nearby token counts share one tuning result and one set of loaded
//! kernels; crossing into the next bucket retunes, because the winning geometry can change.

/// Smallest bucket: below this, every count shares one bucket (the grid is tiny anyway).
pub const MIN_BUCKET: u32 = 64;
/// Largest bucket: counts beyond it share the last bucket.
pub const MAX_BUCKET: u32 = 1 << 24;

/// A token count rounded up to a power of two and clamped to `[MIN_BUCKET, MAX_BUCKET]`, so 3000
/// tokens map to the 4096 bucket and 20,000 and 20,001 both map to 32,768.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct TokenBucket(u32);

impl TokenBucket {
    pub fn of(tokens: usize) -> Self {
        let t = tokens.clamp(1, MAX_BUCKET as usize) as u32;
        Self(t.next_power_of_two().clamp(MIN_BUCKET, MAX_BUCKET))
    }

    /// The bucket's upper bound: the largest token count it holds.
    pub const fn tokens(self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples() {
        assert_eq!(TokenBucket::of(3000).tokens(), 4096);
        assert_eq!(TokenBucket::of(20_000), TokenBucket::of(20_001));
        assert_eq!(TokenBucket::of(20_000).tokens(), 32_768);
        assert_eq!(TokenBucket::of(0).tokens(), MIN_BUCKET);
        assert_eq!(TokenBucket::of(1).tokens(), MIN_BUCKET);
        assert_eq!(TokenBucket::of(usize::MAX).tokens(), MAX_BUCKET);
    }

    #[test]
    fn monotone_and_boundaries_retune() {
        let mut prev = TokenBucket::of(1);
        for t in 1..70_000usize {
            let b = TokenBucket::of(t);
            assert!(b >= prev);
            assert!(b.tokens() as usize >= t.min(MAX_BUCKET as usize));
            // A power of two is the last count of its bucket; one more starts the next.
            if t.is_power_of_two() && t >= MIN_BUCKET as usize {
                assert_eq!(b.tokens() as usize, t);
                assert_ne!(TokenBucket::of(t + 1), b);
            }
            prev = b;
        }
    }
}
