//! Pure logic shared by the device kernels (`kernels-gpu`, built `no_std` for nvptx64), the host
//! library and the CPU reference: problem shapes, tile configurations and the candidate tables,
//! the `#[repr(C)]` kernel parameter structs (the device ABI), token buckets, vocab-split planning,
//! every launch decision as a function of the problem and the device (`heuristics`), and the
//! online log-sum-exp / entropy merge.
//!
//! This crate has no `unsafe` and no dependency on a GPU. With the `std` feature (host side) the
//! configs also derive `serde` traits and kernel names can be formatted.
#![no_std]
#![forbid(unsafe_code)]

#[cfg(feature = "std")]
extern crate std;

pub mod bucket;
pub mod compact;
pub mod config;
pub mod heuristics;
pub mod kept;
pub mod lse;
pub mod params;
pub mod problem;
#[cfg(feature = "std")]
pub mod record;
pub mod split;
pub mod wgmma;

pub use bucket::TokenBucket;
pub use config::{Family, TileConfig};
pub use lse::Lse2;
pub use problem::{Problem, ShapeError};
