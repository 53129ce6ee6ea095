//! The f64 CPU reference of the fused LM head, and the backend on machines without a GPU.
//!
//! Inputs are bf16 bit patterns (`u16`); every product of two bf16 values is exact in f32 (8 + 8
//! significand bits ≤ 24), and the sums are accumulated in f64, so the dot products equal f64
//! arithmetic on the quantised inputs. Rows are spread over rayon threads; each thread walks the
//! vocab for a small block of tokens so one `W` row serves several tokens while it is in cache.
//!
//! Large checks use the row-subset entry points ([`forward_rows`], [`backward_dh_rows`],
//! [`backward_dw_rows`]), which cost `rows · v · d` instead of `t · v · d`.

pub mod bf16;
pub mod bwd;
pub mod fwd;
pub mod inputs;
pub mod masks;
pub mod metrics;
pub mod rng;

pub use bwd::{backward, backward_dh_rows, backward_dh_rows_rss, backward_dw_rows, backward_dw_rows_rss, dlogit, BwdRef, Grads};
pub use fwd::{bad_labels, forward, forward_rows, merge_shards, shard_partials, FwdRef, RowOut, ShardPartial};
pub use inputs::{Case, Inputs, Structure};

/// The default `ignore_index` (PyTorch's): rows with this label report 0 and get no gradient.
pub const IGNORE_INDEX: i64 = -100;
