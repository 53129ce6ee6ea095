//! Vocab-parallel tensor parallelism (TP) and context parallelism (CP).
//!
//! **Tensor parallelism.** Each of the `n` ranks holds the contiguous vocab rows
//! `[v_begin, v_begin + v_local)` of `W` (a [`Shard`]); every rank sees all tokens and the
//! *global* labels. [`LmHead::forward_tp`](crate::LmHead::forward_tp) runs the fused mainloop on
//! the local shard, merges its vocab splits into one row state per token
//! `(m_local, m_global, s, z_label, t)` (base-2 `(m, s, t)` of `lmhead_core::lse`), then:
//! 1. all-reduce **MAX** of `m_global` (every rank learns the true row maximum);
//! 2. each rank moves its `(s, t)` to that maximum (`rescale`, no communication);
//! 3. all-reduce **SUM** of `(s, z_label)` — and `t` when entropy is asked for; the label's logit
//!    is non-zero on exactly one rank;
//! 4. every rank finishes the same lse, log-prob and entropy as the unsharded computation.
//!
//! The log-prob-only path is its own specialisation: the mainloop without entropy arithmetic,
//! and a SUM over two slots instead of three.
//!
//! **Backward under TP.** With the global lse (and entropy) from the forward, each rank computes
//! `dW` for its own rows and a *partial* `dh` (its vocab rows' contribution).
//! [`LmHead::backward_tp`](crate::LmHead::backward_tp) either all-reduces `dh` (SUM, in f32, then
//! rounds to the output dtype) or leaves the partial sums to the caller, as Megatron-LM does
//! (`ReduceDh::Caller`), so the caller can fuse that reduction with its own.
//!
//! **Context parallelism.** Tokens split across ranks need no communication for these outputs:
//! each rank calls the ordinary [`forward`](crate::LmHead::forward) /
//! [`backward`](crate::LmHead::backward) on its local token slice (its `h` rows and their
//! labels; `ignore_index` rows work as usual). The `dW` of each CP rank is a partial sum over its
//! tokens and must be summed across CP ranks like any data-parallel weight gradient; `dh` rows are
//! complete. TP and CP compose: a rank with a token slice and a vocab shard calls the `_tp`
//! entry points with its TP group's communicator.
//!
//! **Communicators.** [`LocalComm`]: ranks are threads of one process (usually on one GPU,
//! for tests and for simulating TP); reductions go through host memory in rank order, so results
//! are deterministic. `NcclComm` (feature `nccl`): one process or thread per GPU over NCCL,
//! bootstrapped with the usual unique id.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::CudaStream;

use crate::borrowed::Borrowed;
use crate::device::Gpu;
use crate::error::{Context as _, Error, Result};
/// The checked device range a [`Communicator`] reduces in place.
pub use crate::launch::Dev;
use crate::launch::{self, MergeOuts, MergeRows, MergeStep};
use crate::{BwdInputs, BwdOptions, BwdReport, FwdInputs, FwdOptions, FwdOutputs, FwdReport, GradOut, LabelType, LmHead};

/// This rank's vocab range: rows `[v_begin, v_begin + problem.v)` of a vocabulary of `v_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub v_begin: usize,
    pub v_total: usize,
}

impl Shard {
    /// The whole vocabulary (no tensor parallelism).
    pub const fn whole(v: usize) -> Self {
        Self { v_begin: 0, v_total: v }
    }

    /// The `rank`-th of `n` contiguous shards of `v_total` rows (the first `v_total % n` shards
    /// get one row more): returns the shard and its row count.
    pub fn even(rank: usize, n: usize, v_total: usize) -> (Self, usize) {
        let base = v_total / n;
        let extra = v_total % n;
        let begin = rank * base + rank.min(extra);
        let len = base + usize::from(rank < extra);
        (Self { v_begin: begin, v_total }, len)
    }

    pub(crate) fn check(&self, v_local: usize) -> Result<()> {
        if self.v_begin + v_local > self.v_total {
            return Err(Error::Invalid(format!(
                "shard [{}, {}) exceeds the vocabulary of {}",
                self.v_begin,
                self.v_begin + v_local,
                self.v_total
            )));
        }
        if self.v_total > lmhead_core::problem::MAX_DIM {
            return Err(Error::Shape(lmhead_core::ShapeError::TooLarge { what: "v_total", value: self.v_total }));
        }
        Ok(())
    }
}

/// What `backward_tp` does with the partial `dh` of each rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceDh {
    /// All-reduce (SUM) across the group: every rank ends with the full `dh`.
    AllReduce,
    /// Leave each rank's partial sum in its `dh` (the caller reduces, as Megatron-LM does).
    Caller,
}

/// This rank's part in a tensor-parallel backward ([`LmHead::backward_tp`]): its group, its
/// vocab shard, and what happens to its partial `dh`.
#[derive(Clone, Copy)]
pub struct TpBackward<'a> {
    pub comm: &'a dyn Communicator,
    pub shard: Shard,
    pub reduce: ReduceDh,
}

impl LmHead {
    /// The forward under vocab-parallel tensor parallelism: `x.w` is this rank's shard (rows
    /// `[shard.v_begin, shard.v_begin + x.problem.v)`), labels are global. Every rank of `comm`
    /// must call it; every rank ends with the full lse, log-prob and entropy (see the module
    /// docs; the steps after the mainloop are `merge_tp` here).
    pub fn forward_tp<L: LabelType>(
        &self,
        comm: &dyn Communicator,
        stream: &Arc<CudaStream>,
        x: &FwdInputs<'_, L>,
        shard: Shard,
        opts: &FwdOptions,
        out: FwdOutputs<'_>,
    ) -> Result<FwdReport> {
        self.forward_impl(stream, x, shard, Some(comm), opts, out)
    }

    /// The backward under vocab-parallel tensor parallelism: `x.w` is this rank's shard
    /// (`tp.shard`), `x.lse` and `x.entropy` the *global* values from [`LmHead::forward_tp`].
    /// `dw` receives this shard's rows; `dh` the full gradient (`ReduceDh::AllReduce`, a SUM over
    /// `tp.comm`, `reduce_dh` here) or this rank's partial sum (`ReduceDh::Caller`).
    pub fn backward_tp<L: LabelType>(
        &self,
        tp: TpBackward<'_>,
        stream: &Arc<CudaStream>,
        x: &BwdInputs<'_, L>,
        opts: &BwdOptions,
        dh: GradOut<'_>,
        dw: Option<GradOut<'_>>,
    ) -> Result<BwdReport> {
        self.backward_impl(stream, x, Some(tp), opts, dh, dw)
    }
}

/// The forward's merge under tensor parallelism, from this rank's partials (`rows.partials`) to
/// the outputs: the local row states into `rows.row_state` (`[5][t]`), all-reduce MAX of the
/// maxima, rescale, all-reduce SUM of `(s, z_label[, t])` (`t` only with entropy), finish.
pub(crate) fn merge_tp(gpu: &Gpu, stream: &Arc<CudaStream>, comm: &dyn Communicator, rows: &MergeRows, outs: MergeOuts) -> Result<()> {
    let t = rows.t;
    let rs = rows.row_state.ok_or_else(|| Error::Config("merge: row state missing".into()))?;
    let step = |s: MergeStep, o: Option<MergeOuts>| launch::merge(gpu, stream, s, rows, o);
    step(MergeStep::RowState, None)?;
    comm.all_reduce(stream, &rs.sub(t, t, 4)?, ReduceOp::Max)?;
    step(MergeStep::Rescale, None)?;
    let slots = if outs.entropy.is_some() { 3 } else { 2 };
    comm.all_reduce(stream, &rs.sub(2 * t, slots * t, 4)?, ReduceOp::Sum)?;
    step(MergeStep::Finish, Some(outs))
}

/// The backward's `dh` under tensor parallelism: every rank's partial sum in the f32 accumulator
/// `acc` (`n` elements), summed across `comm` in f32, then rounded into `bf16_out` when `dh` is
/// bf16 (an f32 `dh` is the accumulator itself).
pub(crate) fn reduce_dh(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    comm: &dyn Communicator,
    n: usize,
    acc: &Dev,
    bf16_out: Option<&Dev>,
) -> Result<()> {
    comm.all_reduce(stream, acc, ReduceOp::Sum)?;
    if let Some(out) = bf16_out {
        launch::cast_f32_bf16(gpu, stream, n, acc, out)?;
    }
    Ok(())
}

/// The reduction of an all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Max,
    Sum,
}

/// A group of ranks that can all-reduce f32 buffers.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// In-place all-reduce of `buf` (f32 elements), ordered after earlier work on `stream` and
    /// before later work on it. Every rank must call it with the same length and op.
    fn all_reduce(&self, stream: &Arc<CudaStream>, buf: &Dev, op: ReduceOp) -> Result<()>;
}

/// A checked [`Dev`] range as a [`Borrowed`] buffer, which cudarc's copy and NCCL calls accept.
/// Ordering is by stream: the range belongs to a buffer whose own guard (held by the caller's
/// `Dev`) already ordered it on the caller's stream; the communicators join their streams with it
/// explicitly.
fn raw(buf: &Dev, stream: &Arc<CudaStream>) -> Borrowed<f32> {
    // SAFETY: `buf` is a checked range of `buf.len` f32 of a live buffer in `stream`'s context,
    // kept alive (and ordered on the caller's stream) by the `Dev` for the length of the
    // all-reduce that uses this view.
    unsafe { Borrowed::new(buf.ptr, buf.len, stream) }
}

/// Shared state of a [`LocalComm`] group.
struct Group {
    n: usize,
    timeout: Duration,
    state: Mutex<GroupState>,
    cv: Condvar,
}

struct GroupState {
    /// Each rank's contribution to the current collective.
    slots: Vec<Option<Vec<f32>>>,
    /// Barrier bookkeeping: arrivals in the current phase, and the phase counter.
    arrived: usize,
    phase: u64,
}

impl Group {
    /// A barrier with a timeout, so that one failed rank cannot hang the others forever.
    fn barrier(&self) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        let phase = st.phase;
        st.arrived += 1;
        if st.arrived == self.n {
            st.arrived = 0;
            st.phase += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let (st, to) = self.cv.wait_timeout_while(st, self.timeout, |s| s.phase == phase).unwrap();
        if to.timed_out() && st.phase == phase {
            return Err(Error::Comm(format!("a rank did not reach the collective within {:?}", self.timeout)));
        }
        Ok(())
    }
}

/// An in-process communicator: one handle per rank, each used by its own thread (a thread that
/// drove several ranks would wait for itself). Reductions copy through host memory and add in
/// rank order, so they are deterministic; they are meant for tests and simulations, not speed.
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
}

impl LocalComm {
    /// `n` connected handles, rank 0 first. A collective that some rank does not reach within
    /// 60 s fails with [`Error::Comm`] on the others.
    pub fn group(n: usize) -> Vec<LocalComm> {
        Self::group_with_timeout(n, Duration::from_secs(60))
    }

    pub fn group_with_timeout(n: usize, timeout: Duration) -> Vec<LocalComm> {
        let g = Arc::new(Group {
            n,
            timeout,
            state: Mutex::new(GroupState { slots: vec![None; n], arrived: 0, phase: 0 }),
            cv: Condvar::new(),
        });
        (0..n).map(|rank| LocalComm { rank, group: g.clone() }).collect()
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.n
    }

    fn all_reduce(&self, stream: &Arc<CudaStream>, buf: &Dev, op: ReduceOp) -> Result<()> {
        let mut host = vec![0.0f32; buf.len];
        stream.memcpy_dtoh(&raw(buf, stream), &mut host).during(|| "copying an all-reduce buffer to the host".into())?;
        stream.synchronize().during(|| "waiting for the all-reduce copy".into())?;
        self.group.state.lock().unwrap().slots[self.rank] = Some(host);
        self.group.barrier()?;
        let reduced = {
            let st = self.group.state.lock().unwrap();
            let mut acc: Option<Vec<f32>> = None;
            for (r, s) in st.slots.iter().enumerate() {
                let s = s.as_ref().ok_or_else(|| Error::Comm(format!("rank {r} contributed nothing")))?;
                if s.len() != buf.len {
                    return Err(Error::Comm(format!("rank {r} reduced {} elements, rank {} {}", s.len(), self.rank, buf.len)));
                }
                acc = Some(match acc {
                    None => s.clone(),
                    Some(mut a) => {
                        for (x, &y) in a.iter_mut().zip(s) {
                            *x = match op {
                                ReduceOp::Max => x.max(y),
                                ReduceOp::Sum => *x + y,
                            };
                        }
                        a
                    }
                });
            }
            acc.unwrap_or_default()
        };
        // Everyone has read every slot before anyone starts the next collective.
        self.group.barrier()?;
        stream.memcpy_htod(&reduced, &mut raw(buf, stream)).during(|| "copying an all-reduce result back".into())?;
        stream.synchronize().during(|| "waiting for the all-reduce result".into())?;
        Ok(())
    }
}

/// NCCL communicator (feature `nccl`): wraps a `cudarc::nccl::Comm`. Its stream is synchronised
/// with the caller's around every collective.
#[cfg(feature = "nccl")]
pub struct NcclComm {
    comm: cudarc::nccl::Comm,
}

#[cfg(feature = "nccl")]
impl NcclComm {
    /// Whether the NCCL library can be loaded.
    pub fn available() -> bool {
        // SAFETY: only tries to dlopen libnccl; no other effect.
        unsafe { cudarc::nccl::sys::is_culib_present() }
    }

    pub fn new(comm: cudarc::nccl::Comm) -> Self {
        Self { comm }
    }

    /// One communicator per stream (one process driving several GPUs, or a single rank).
    pub fn from_streams(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Self>> {
        if !Self::available() {
            return Err(Error::Comm("the NCCL library (libnccl.so) is not on the library path".into()));
        }
        let comms = cudarc::nccl::Comm::from_devices(streams).map_err(|e| Error::Comm(format!("ncclCommInitAll: {e:?}")))?;
        Ok(comms.into_iter().map(Self::new).collect())
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `Communicator` calls happen inside one `LmHead` call at a time (its workspace
// lock), which serialises them.
#[cfg(feature = "nccl")]
unsafe impl Sync for NcclComm {}
// SAFETY: as above; the handle is not tied to the creating thread.
#[cfg(feature = "nccl")]
unsafe impl Send for NcclComm {}

#[cfg(feature = "nccl")]
impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce(&self, stream: &Arc<CudaStream>, buf: &Dev, op: ReduceOp) -> Result<()> {
        let cs = self.comm.stream();
        cs.join(stream).during(|| "ordering the NCCL stream after the caller's".into())?;
        let op = match op {
            ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
            ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        };
        self.comm.all_reduce_in_place(&mut raw(buf, &cs), &op).map_err(|e| Error::Comm(format!("ncclAllReduce: {e:?}")))?;
        stream.join(&cs).during(|| "ordering the caller's stream after NCCL".into())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_shards_cover_the_vocab() {
        for n in [1, 2, 3, 4, 8] {
            for v in [1usize, 7, 1000, 151_936] {
                let mut next = 0;
                for r in 0..n {
                    let (s, len) = Shard::even(r, n, v);
                    assert_eq!(s.v_begin, next);
                    next += len;
                    assert!(s.check(len).is_ok());
                }
                assert_eq!(next, v);
            }
        }
        assert!(Shard { v_begin: 10, v_total: 12 }.check(3).is_err());
    }

    #[test]
    fn local_barrier_times_out_instead_of_hanging() {
        let g = LocalComm::group_with_timeout(2, Duration::from_millis(50));
        let r = g[0].group.barrier();
        assert!(matches!(r, Err(Error::Comm(_))));
    }
}
