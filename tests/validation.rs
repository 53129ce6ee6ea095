//! Validation without a GPU: every bad buffer and option of a forward or backward call is its
//! typed error from `lmhead::validate`, the checks `LmHead::forward`/`backward` run first,
//! before the label check, the tuner or any launch (the GPU side of this, on a cold tuning
//! cache, is `gpu_reliability::cold_cache_bad_inputs_are_refused_before_tuning`). Also the CPU
//! backend's tensor-parallel path against the unsharded one.

use lmhead::cpu::{self, HostComm};
use lmhead::tp::ReduceOp;
use lmhead::tp::Shard;
use lmhead::validate::{self, Buf, BwdCall, FwdCall};
use lmhead::{bf16, BwdConfigs, BwdOptions, Choice, Error, Family, FwdOptions, Problem};

const T: usize = 33;
const V: usize = 257;
const D: usize = 64;

/// Disjoint, aligned buffers for a valid call (addresses 1 MiB apart).
fn good_fwd() -> FwdCall {
    let at = |i: u64| 0x1000_0000 + (i << 20);
    FwdCall {
        problem: Problem::new(T, V, D),
        shard: Shard::whole(V),
        tp: false,
        h: Buf::new("h", at(0), T * D, 2),
        w: Buf::new("W", at(1), V * D, 2),
        labels: Buf::new("labels", at(2), T, 8),
        logprob: Buf::new("logprob", at(3), T, 4),
        lse: Buf::new("lse", at(4), T, 4),
        entropy: Some(Buf::new("entropy", at(5), T, 4)),
        kept: None,
    }
}

fn good_bwd() -> BwdCall {
    let at = |i: u64| 0x1000_0000 + (i << 20);
    BwdCall {
        problem: Problem::new(T, V, D),
        shard: Shard::whole(V),
        h: Buf::new("h", at(0), T * D, 2),
        w: Buf::new("W", at(1), V * D, 2),
        labels: Buf::new("labels", at(2), T, 8),
        lse: Buf::new("lse", at(3), T, 4),
        entropy: Some(Buf::new("entropy", at(4), T, 4)),
        grad_logprob: Some(Buf::new("grad_logprob", at(5), T, 4)),
        grad_entropy: Some(Buf::new("grad_entropy", at(6), T, 4)),
        dh: Buf::new("dh", at(7), T * D, 2),
        dw: Some(Buf::new("dW", at(8), V * D, 2)),
        kept: None,
    }
}

/// A well-formed tile config that no family compiles.
fn not_compiled() -> lmhead::TileConfig {
    let c = lmhead::TileConfig { bm: 96, bn: 96, bk: 32, stages: 2, warps_m: 2, warps_n: 2, mainloop: lmhead::Mainloop::MmaSync };
    assert!(Family::ALL.iter().all(|f| !f.candidates().contains(&c)));
    c
}

#[track_caller]
fn length(r: lmhead::Result<f32>, which: &str) {
    assert!(matches!(r, Err(Error::Length { what, .. }) if what == which), "{which}: {r:?}");
}

#[track_caller]
fn misaligned(r: lmhead::Result<f32>, which: &str) {
    assert!(matches!(r, Err(Error::Misaligned { what, .. }) if what == which), "{which}: {r:?}");
}

/// The kept-logits mode (`lmhead::keep`): a budget that keeps rows needs a buffer of at least
/// `keep::len` elements, 16-byte aligned, overlapping nothing; a budget below one row keeps
/// nothing and needs none; the backward's kept rows are all rows or whole tiles, within `t`.
#[test]
fn kept_logits_are_checked_in_both_passes() {
    let at = |i: u64| 0x1000_0000 + (i << 20);
    assert_eq!(lmhead::keep::stride(V), 288);
    let all = FwdOptions { keep_logits: usize::MAX, ..FwdOptions::default() };
    let need = lmhead::keep::rows_len(T, V);
    assert_eq!(need, T * (288 / 2 + 288 / 32 + 1));
    let with = |len: usize, ptr: u64| FwdCall { kept: Some(Buf::new("kept logits", ptr, len, 4)), ..good_fwd() };
    assert_eq!(validate::kept_rows(&with(need, at(9)), &all).unwrap(), T);
    validate::fwd(&with(need, at(9)), &all).unwrap();
    validate::fwd(&with(need + 100, at(9)), &all).unwrap();
    length(validate::fwd(&with(need - 1, at(9)), &all), "kept logits");
    misaligned(validate::fwd(&with(need, at(9) + 4), &all), "kept logits");
    assert!(matches!(validate::fwd(&good_fwd(), &all), Err(Error::Invalid(_))), "keep without a buffer");
    assert!(matches!(validate::fwd(&with(need, at(0) + 64), &all), Err(Error::Invalid(_))), "over h");
    assert!(matches!(validate::fwd(&with(need, at(3)), &all), Err(Error::Invalid(_))), "over logprob");
    assert!(matches!(validate::fwd(&with(need, at(9)), &FwdOptions { naive: true, ..all.clone() }), Err(Error::Invalid(_))));
    // A budget below the call's rows keeps whole 128-row tiles: none of 33 rows.
    let some = FwdOptions { keep_logits: 4 * need - 1, ..FwdOptions::default() };
    assert_eq!(validate::kept_rows(&good_fwd(), &some).unwrap(), 0);
    validate::fwd(&good_fwd(), &some).unwrap();
    assert_eq!(validate::kept_rows(&with(need, at(9)), &FwdOptions::default()).unwrap(), 0);
    // Backward.
    let o = BwdOptions::default();
    let bwd = |rows: usize, len: usize, ptr: u64| BwdCall { kept: Some((Buf::new("kept logits", ptr, len, 4), rows)), ..good_bwd() };
    validate::bwd(&bwd(T, need, at(9)), &o).unwrap();
    validate::bwd(&bwd(0, 0, at(9)), &o).unwrap();
    length(validate::bwd(&bwd(T, need - 1, at(9)), &o), "kept logits");
    misaligned(validate::bwd(&bwd(T, need, at(9) + 8), &o), "kept logits");
    assert!(matches!(validate::bwd(&bwd(T + 1, lmhead::keep::rows_len(T + 1, V), at(9)), &o), Err(Error::Invalid(_))), "more rows than t");
    assert!(matches!(validate::bwd(&bwd(T - 1, need, at(9)), &o), Err(Error::Invalid(_))), "not whole tiles");
    assert!(matches!(validate::bwd(&bwd(T, need, at(7)), &o), Err(Error::Invalid(_))), "under dh");
    let big = |rows: usize| BwdCall {
        problem: Problem::new(300, V, D),
        h: Buf::new("h", at(0), 300 * D, 2),
        labels: Buf::new("labels", at(2), 300, 8),
        lse: Buf::new("lse", at(3), 300, 4),
        entropy: None,
        grad_entropy: None,
        grad_logprob: Some(Buf::new("grad_logprob", at(5), 300, 4)),
        dh: Buf::new("dh", at(7), 300 * D, 2),
        kept: Some((Buf::new("kept logits", at(40), lmhead::keep::rows_len(rows, V), 4), rows)),
        ..good_bwd()
    };
    validate::bwd(&big(256), &o).unwrap();
    validate::bwd(&big(300), &o).unwrap();
    assert!(matches!(validate::bwd(&big(200), &o), Err(Error::Invalid(_))));
}

#[test]
fn forward_checks_every_buffer_and_option() {
    let o = FwdOptions::default();
    assert_eq!(validate::fwd(&good_fwd(), &o).unwrap(), 1.0);
    type Edit = fn(&mut FwdCall);
    let lengths: [(&str, Edit); 6] = [
        ("h", |c| c.h.len -= 1),
        ("W", |c| c.w.len += D),
        ("labels", |c| c.labels.len -= 1),
        ("logprob", |c| c.logprob.len += 1),
        ("lse", |c| c.lse.len = 0),
        ("entropy", |c| c.entropy.as_mut().unwrap().len -= 1),
    ];
    for (which, edit) in lengths {
        let mut c = good_fwd();
        edit(&mut c);
        length(validate::fwd(&c, &o), which);
    }
    let aligns: [(&str, Edit); 6] = [
        ("h", |c| c.h.ptr += 2),
        ("W", |c| c.w.ptr += 8),
        ("labels", |c| c.labels.ptr += 4),
        ("logprob", |c| c.logprob.ptr += 2),
        ("lse", |c| c.lse.ptr += 1),
        ("entropy", |c| c.entropy.as_mut().unwrap().ptr += 2),
    ];
    for (which, edit) in aligns {
        let mut c = good_fwd();
        edit(&mut c);
        misaligned(validate::fwd(&c, &o), which);
    }
    // Labels may be i32: 4-byte alignment is then enough.
    let mut c = good_fwd();
    c.labels = Buf::new("labels", c.labels.ptr + 4, T, 4);
    validate::fwd(&c, &o).unwrap();
    // Options.
    for t in [0.0f32, -2.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(validate::fwd(&good_fwd(), &FwdOptions { temperature: t, ..o.clone() }), Err(Error::Temperature(_))));
    }
    let r = validate::fwd(&good_fwd(), &FwdOptions { config: Choice::Fixed(not_compiled()), ..o.clone() });
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    let mut c = good_fwd();
    c.tp = true;
    assert!(matches!(validate::fwd(&c, &FwdOptions { naive: true, ..o.clone() }), Err(Error::Invalid(_))));
    // Shapes and shards.
    let mut c = good_fwd();
    c.problem = Problem::new(T, V, 60);
    assert!(matches!(validate::fwd(&c, &o), Err(Error::Shape(_))));
    let mut c = good_fwd();
    c.shard = Shard { v_begin: 10, v_total: V };
    assert!(matches!(validate::fwd(&c, &o), Err(Error::Invalid(_))));
    // Overlaps: an output over an input or over another output.
    let mut c = good_fwd();
    c.lse.ptr = c.logprob.ptr + 4 * (T as u64 - 1);
    assert!(matches!(validate::fwd(&c, &o), Err(Error::Invalid(m)) if m.contains("overlaps")));
    let mut c = good_fwd();
    c.entropy.as_mut().unwrap().ptr = c.h.ptr + 16;
    assert!(matches!(validate::fwd(&c, &o), Err(Error::Invalid(m)) if m.contains("overlaps")));
}

#[test]
fn backward_checks_every_buffer_and_option() {
    let o = BwdOptions::default();
    validate::bwd(&good_bwd(), &o).unwrap();
    type Edit = fn(&mut BwdCall);
    let lengths: [(&str, Edit); 9] = [
        ("h", |c| c.h.len -= 1),
        ("W", |c| c.w.len -= D),
        ("labels", |c| c.labels.len += 1),
        ("lse", |c| c.lse.len -= 1),
        ("entropy", |c| c.entropy.as_mut().unwrap().len -= 1),
        ("grad_logprob", |c| c.grad_logprob.as_mut().unwrap().len += 1),
        ("grad_entropy", |c| c.grad_entropy.as_mut().unwrap().len -= 1),
        ("dh", |c| c.dh.len -= 2),
        ("dW", |c| c.dw.as_mut().unwrap().len += 2),
    ];
    for (which, edit) in lengths {
        let mut c = good_bwd();
        edit(&mut c);
        length(validate::bwd(&c, &o), which);
    }
    let aligns: [(&str, Edit); 5] = [
        ("h", |c| c.h.ptr += 8),
        ("lse", |c| c.lse.ptr += 2),
        ("grad_entropy", |c| c.grad_entropy.as_mut().unwrap().ptr += 2),
        ("dh", |c| c.dh.ptr += 2),
        ("dW", |c| c.dw.as_mut().unwrap().ptr += 2),
    ];
    for (which, edit) in aligns {
        let mut c = good_bwd();
        edit(&mut c);
        misaligned(validate::bwd(&c, &o), which);
    }
    // f32 gradients are written in pairs: 8-byte alignment.
    let mut c = good_bwd();
    c.dh = Buf::new("dh", c.dh.ptr + 4, T * D, 4);
    misaligned(validate::bwd(&c, &o), "dh");
    // Frozen W: no dW buffer at all is valid.
    let mut c = good_bwd();
    c.dw = None;
    validate::bwd(&c, &o).unwrap();
    // Options.
    let mut c = good_bwd();
    c.entropy = None;
    assert!(matches!(validate::bwd(&c, &o), Err(Error::Invalid(_))), "entropy gradient without entropy");
    assert!(matches!(validate::bwd(&good_bwd(), &BwdOptions { chunk: Some(0), ..o.clone() }), Err(Error::Invalid(_))));
    assert!(matches!(validate::bwd(&good_bwd(), &BwdOptions { temperature: 0.0, ..o.clone() }), Err(Error::Temperature(_))));
    for configs in [
        BwdConfigs { dlogits: Choice::Fixed(not_compiled()), ..BwdConfigs::all(Choice::Auto) },
        BwdConfigs { dh: Choice::Fixed(not_compiled()), ..BwdConfigs::all(Choice::Auto) },
        BwdConfigs { dw: Choice::Fixed(not_compiled()), ..BwdConfigs::all(Choice::Auto) },
    ] {
        assert!(matches!(validate::bwd(&good_bwd(), &BwdOptions { config: configs, ..o.clone() }), Err(Error::Config(_))), "{configs:?}");
    }
    // dW over an input.
    let mut c = good_bwd();
    c.dw.as_mut().unwrap().ptr = c.w.ptr;
    assert!(matches!(validate::bwd(&c, &o), Err(Error::Invalid(m)) if m.contains("overlaps")));
}

#[test]
fn warm_up_shapes_are_checked_before_any_is_tuned() {
    validate::warm_up(&[1, 100, 5000], V, D).unwrap();
    assert!(matches!(validate::warm_up(&[100, 0], V, D), Err(Error::Shape(_))));
    assert!(matches!(validate::warm_up(&[100], V, D + 3), Err(Error::Shape(_))));
}

/// Each rank's contribution to the current collective, and the barrier around it.
type Slots = std::sync::Arc<(std::sync::Mutex<Vec<Option<Vec<f64>>>>, std::sync::Barrier)>;

/// An in-process host communicator over threads (each rank adds its slice in rank order).
struct Threads {
    rank: usize,
    shared: Slots,
}

impl HostComm for Threads {
    fn all_reduce(&self, buf: &mut [f64], op: ReduceOp) -> lmhead::Result<()> {
        let (slots, barrier) = &*self.shared;
        slots.lock().unwrap()[self.rank] = Some(buf.to_vec());
        barrier.wait();
        {
            let all = slots.lock().unwrap();
            for (i, x) in buf.iter_mut().enumerate() {
                let vals = all.iter().map(|s| s.as_ref().unwrap()[i]);
                *x = match op {
                    ReduceOp::Sum => vals.sum(),
                    ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
                };
            }
        }
        barrier.wait();
        Ok(())
    }
}

/// The CPU backend's tensor-parallel forward and backward (three uneven shards) give the
/// unsharded results: the protocol the Python package uses on CPU tensors with gloo.
#[test]
fn cpu_tensor_parallel_matches_unsharded() {
    let case = lmhead_reference::Case::generate(7, 19, 101, 32, &lmhead_reference::Structure::default());
    let (t, v, d) = (case.t, case.v, case.d);
    let h: Vec<bf16> = case.h.iter().map(|&b| bf16::from_bits(b)).collect();
    let w: Vec<bf16> = case.w.iter().map(|&b| bf16::from_bits(b)).collect();
    let fo = FwdOptions { temperature: case.temperature as f32, ..Default::default() };
    let bo = BwdOptions { temperature: case.temperature as f32, ..Default::default() };
    let whole = cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &case.labels, problem: Problem::new(t, v, d) }, &fo, true).unwrap();
    let g: Vec<f32> = (0..t).map(|i| 0.5 + (i % 3) as f32).collect();
    let ge: Vec<f32> = (0..t).map(|i| (i % 2) as f32 - 0.25).collect();
    let ent = whole.entropy.clone().unwrap();
    let (dh, dw) = cpu::backward(
        &cpu::CpuInputs { h: &h, w: &w, labels: &case.labels, problem: Problem::new(t, v, d) },
        &cpu::CpuGrads { lse: &whole.lse, entropy: Some(&ent), grad_logprob: Some(&g), grad_entropy: Some(&ge), kept: None },
        &bo,
    )
    .unwrap();
    let n = 3;
    let shared = std::sync::Arc::new((std::sync::Mutex::new(vec![None; n]), std::sync::Barrier::new(n)));
    let outs: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let comm = Threads { rank, shared: shared.clone() };
                let (h, w, labels, fo, bo, g, ge) = (&h, &w, &case.labels, &fo, &bo, &g, &ge);
                s.spawn(move || {
                    let (shard, vl) = Shard::even(rank, n, v);
                    let ws = &w[shard.v_begin * d..(shard.v_begin + vl) * d];
                    let p = Problem::new(t, vl, d);
                    let f = cpu::forward_tp(&comm, &cpu::CpuInputs { h, w: ws, labels, problem: p }, shard, fo, true).unwrap();
                    let e = f.entropy.clone().unwrap();
                    let (dh, dw) = cpu::backward_tp(
                        &comm,
                        &cpu::CpuInputs { h, w: ws, labels, problem: p },
                        shard,
                        &cpu::CpuGrads { lse: &f.lse, entropy: Some(&e), grad_logprob: Some(g), grad_entropy: Some(ge), kept: None },
                        bo,
                        true,
                    )
                    .unwrap();
                    (f, dh, dw, shard.v_begin, vl)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let close = |a: &[f32], b: &[f32], what: &str| {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0) || (x.is_nan() && y.is_nan()), "{what}[{i}]: {x} vs {y}");
        }
    };
    for (f, dh_r, dw_r, v0, vl) in &outs {
        close(&f.logprob, &whole.logprob, "logprob");
        close(&f.lse, &whole.lse, "lse");
        close(f.entropy.as_ref().unwrap(), &ent, "entropy");
        close(dh_r, &dh, "dh");
        close(dw_r, &dw[v0 * d..(v0 + vl) * d], "dW shard");
    }
}

/// The CPU backend's kept-logits mode: the budget keeps the rows `keep::rows` says (all, whole
/// 128-row tiles, none), the kept values are the raw dot products in the kept format
/// (`keep::decode`: `q · 2^g` within fp16's rounding of `2^y`; the label's logit as f32), and
/// the backward with them
/// gives exactly the backward without them; a bad kept argument is the GPU's typed error.
#[test]
fn cpu_keeps_the_rows_the_budget_says_and_checks_them_as_the_gpu_does() {
    let s = lmhead_reference::Structure { ignored: 0.1, ..Default::default() };
    let case = lmhead_reference::Case::generate(13, 300, 61, 16, &s);
    let (t, v, d) = (case.t, case.v, case.d);
    let h: Vec<bf16> = case.h.iter().map(|&b| bf16::from_bits(b)).collect();
    let w: Vec<bf16> = case.w.iter().map(|&b| bf16::from_bits(b)).collect();
    let x = cpu::CpuInputs { h: &h, w: &w, labels: &case.labels, problem: Problem::new(t, v, d) };
    let row_bytes = lmhead::keep::row_bytes(v);
    for (budget, rows) in [(0, 0), (row_bytes * 127, 0), (row_bytes * 200, 128), (row_bytes * 299, 256), (usize::MAX, t)] {
        let fo = FwdOptions { keep_logits: budget, temperature: case.temperature as f32, ..Default::default() };
        let f = cpu::forward(&x, &fo, true).unwrap();
        assert_eq!(f.kept_rows, rows, "budget {budget}");
        assert_eq!(f.kept.len(), lmhead::keep::rows_len(rows, v));
        let off = cpu::forward(&x, &FwdOptions { keep_logits: 0, ..fo.clone() }, true).unwrap();
        assert_eq!((&f.logprob, &f.lse, &f.entropy), (&off.logprob, &off.lse, &off.entropy), "outputs unchanged");
        if rows > 0 {
            let scale2 = (std::f32::consts::LOG2_E * (1.0 / case.temperature as f32)) as f64;
            let dot = |r: usize, j: usize| (0..d).map(|k| h[r * d + k].to_f64() * w[j * d + k].to_f64()).sum::<f64>();
            let r = rows - 1;
            for j in 0..v {
                let (q, g) = lmhead::keep::decode(&f.kept, rows, v, r, j);
                let (got, want) = (q as f64 * (g as f64).exp2(), (dot(r, j) as f32 as f64 * scale2).exp2());
                assert!((got - want).abs() <= want * 1e-3 + (g as f64 - 24.0).exp2(), "kept [{r}][{j}]: {got:e}, want {want:e}");
            }
            let r = (0..rows).find(|&r| case.labels[r] >= 0).unwrap();
            assert_eq!(lmhead::keep::label_logit(&f.kept, rows, v, r), dot(r, case.labels[r] as usize) as f32);
        }
        let g: Vec<f32> = (0..t).map(|i| 1.0 - (i % 3) as f32).collect();
        let bo = BwdOptions { temperature: case.temperature as f32, ..Default::default() };
        let grads =
            cpu::CpuGrads { lse: &f.lse, entropy: f.entropy.as_deref(), grad_logprob: Some(&g), grad_entropy: Some(&g), kept: None };
        let plain = cpu::backward(&x, &grads, &bo).unwrap();
        let kept = cpu::backward(&x, &cpu::CpuGrads { kept: Some((&f.kept, rows)), ..grads }, &bo).unwrap();
        assert_eq!(plain, kept);
    }
    let f = cpu::forward(&x, &FwdOptions { keep_logits: usize::MAX, ..Default::default() }, false).unwrap();
    let grads = cpu::CpuGrads { lse: &f.lse, entropy: None, grad_logprob: Some(&f.lse), grad_entropy: None, kept: None };
    let bo = BwdOptions::default();
    let bad = |k: &[f32], rows: usize| cpu::backward(&x, &cpu::CpuGrads { kept: Some((k, rows)), ..grads }, &bo);
    assert!(matches!(bad(&f.kept[..f.kept.len() - 1], t), Err(Error::Length { what: "kept logits", .. })));
    assert!(matches!(bad(&f.kept, t + 1), Err(Error::Invalid(_))));
    assert!(matches!(bad(&f.kept, 200), Err(Error::Invalid(_))));
    bad(&f.kept, 256).unwrap();
    assert!(matches!(
        cpu::forward(&x, &FwdOptions { keep_logits: usize::MAX, naive: true, ..Default::default() }, false),
        Err(Error::Invalid(_))
    ));
}
