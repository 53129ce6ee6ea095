//! The problem shape and the checks every entry point runs before anything is launched.

/// One LM-head problem on one device: `t` tokens, a local vocab shard of `v` rows, hidden `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct Problem {
    pub t: usize,
    pub v: usize,
    pub d: usize,
}

/// Why a shape cannot be run. Every entry point answers bad shapes with one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapeError {
    /// No tokens.
    NoTokens,
    /// No vocab rows.
    NoVocab,
    /// `d` is 0 or not a multiple of 8: rows of `h` and `W` must be whole 16-byte chunks.
    Hidden { d: usize },
    /// A dimension passes what the kernels index (`t`, `v` and `d` each below 2^31).
    TooLarge { what: &'static str, value: usize },
}

impl core::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ShapeError::NoTokens => write!(f, "no tokens (t = 0)"),
            ShapeError::NoVocab => write!(f, "empty vocab (v = 0)"),
            ShapeError::Hidden { d } => {
                write!(f, "hidden size d = {d} must be a positive multiple of 8 (16-byte bf16 rows)")
            }
            ShapeError::TooLarge { what, value } => write!(f, "{what} = {value} is not below 2^31"),
        }
    }
}

/// Dimensions must stay below this: the kernels keep row and column indices in 32 bits (products
/// of two dimensions are formed in 64 bits).
pub const MAX_DIM: usize = (1 << 31) - 1;

impl Problem {
    pub const fn new(t: usize, v: usize, d: usize) -> Self {
        Self { t, v, d }
    }

    pub fn check(&self) -> Result<(), ShapeError> {
        if self.t == 0 {
            return Err(ShapeError::NoTokens);
        }
        if self.v == 0 {
            return Err(ShapeError::NoVocab);
        }
        if self.d == 0 || !self.d.is_multiple_of(8) {
            return Err(ShapeError::Hidden { d: self.d });
        }
        for (what, value) in [("t", self.t), ("v", self.v), ("d", self.d)] {
            if value > MAX_DIM {
                return Err(ShapeError::TooLarge { what, value });
            }
        }
        Ok(())
    }

    /// Floating-point operations of one logits GEMM: `2·t·v·d`.
    pub const fn gemm_flops(&self) -> f64 {
        2.0 * self.t as f64 * self.v as f64 * self.d as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks() {
        assert_eq!(Problem::new(1, 1, 8).check(), Ok(()));
        assert_eq!(Problem::new(0, 1, 8).check(), Err(ShapeError::NoTokens));
        assert_eq!(Problem::new(1, 0, 8).check(), Err(ShapeError::NoVocab));
        assert_eq!(Problem::new(1, 1, 12).check(), Err(ShapeError::Hidden { d: 12 }));
        assert_eq!(Problem::new(1, 1, 0).check(), Err(ShapeError::Hidden { d: 0 }));
        assert!(matches!(Problem::new(1usize << 31, 1, 8).check(), Err(ShapeError::TooLarge { what: "t", .. })));
    }
}
