//! Every PTX instruction the kernels use, each behind a small `unsafe fn` (or a safe one where no
//! precondition exists). This folder is the only place with `asm!`; each wrapper's `# Safety`
//! lists the exact conditions under which the instruction is undefined behaviour.
//!
//! One file per instruction family, all re-exported here (callers write `intrinsics::foo`):
//! `thread` (indices, barriers, shuffle, ballot, fences, `exit` / `trap`), `math` (`ex2` / `lg2`, `fma`,
//! packing conversions), `memory` (shared and global loads and stores, `cp.async`, reductions),
//! `mma` (`ldmatrix`, `mma.sync`, `stmatrix`), `wgmma` (the sm90 warpgroup MMA and
//! `setmaxnreg`), `tma` (mbarriers and the tensor memory accelerator's bulk copies).
//!
//! Shared-memory addresses are 32-bit offsets in the shared window (`SmemAddr`), as `ld.shared`,
//! `cp.async`, `ldmatrix` take them.

mod math;
mod memory;
mod mma;
mod thread;
mod tma;
mod wgmma;

pub use math::*;
pub use memory::*;
pub use mma::*;
pub use thread::*;
pub use tma::*;
pub use wgmma::*;

/// An address in the shared-memory window of the block (bytes).
pub type SmemAddr = u32;
