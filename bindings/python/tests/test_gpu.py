"""The op on CUDA tensors (H100/H200) against float64 references computed from the same inputs
(bf16 inputs are exact in float64), skipped with the reason without such a GPU.

Thresholds, per output (those of the Rust crate's tests/gpu_fwd.rs and tests/gpu_bwd.rs, whose
derivations they reuse; see refs.py):
- log-prob (and lse), per row: ``1e-4 + mag·2⁻²²·(d/16 + 4)``, ``mag = max(|lse|, |z_label|)``
  (tensor-core f32 accumulation rounds toward zero each k16 step);
- entropy, per row: ``1e-4·max(1, H) + |lse|·2⁻²²·(d/16 + 4)·(1 + spread)``;
- ``d hidden``, ``d weight`` in bf16: ``‖Δ‖ ≤ 6e-3·max(‖ref‖, ‖rss‖)`` (d-logits staged in bf16,
  relative ≤ 2⁻⁸ per term, and the output rounded once more); ignored rows exactly 0;
- fp32 operands, ``precision="split"`` (hi+lo split, hidden size 2H or 3H for the kernels): the
  forward bounds at that hidden size plus ``2⁻¹⁵·max Σ|h_i·w_i|`` for the split; fp32 gradients
  ``2e-5`` relative L2 (that backward runs in fp32 torch over vocabulary chunks, see
  lmhead_torch/_impl.py: fp32 accumulation over ``t`` or ``V`` terms, ~1e-6; TF32 off, torch's
  default); a bf16 gradient of a mixed call the bf16 bound;
- fp32 operands, the default ``precision="bf16"``: the bf16 bounds against the float64 of the
  operands' bf16 roundings (the f32 gradients, not rounded to bf16, within the bf16-staging
  bound ``6e-3``), and the log-probs bitwise equal to the call on the rounded operands.
"""

import os
import subprocess
import sys
import threading

import pytest
import torch

import lmhead_torch as L
from lmhead_torch import _native
from refs import BF16_REL_L2, IGNORE, check_forward_gpu, reference, rel_l2
from tp_workers import run_tp_cases

GPU = L.gpu_supported()
REASON = "needs a CUDA GPU" if not torch.cuda.is_available() else "the library does not support this CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason=REASON)]

# (t, v, d): H % 128 != 0 and V % 64 != 0 in all but the last.
SHAPES = [(37, 300, 64), (257, 1000, 200), (1000, 4099, 1032), (3000, 32001, 2056), (2048, 32000, 4096)]


def _inputs(t, v, d, seed, dtype=torch.bfloat16, logit_std=2.0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(t, d, generator=g)
    w = torch.randn(v, d, generator=g) * (logit_std / d**0.5)
    labels = torch.randint(0, v, (t,), generator=g)
    return h.to(device, dtype), w.to(device, dtype), labels.to(device)


def _grads(t, seed, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    return torch.randn(t, generator=g).to(device), torch.randn(t, generator=g).to(device)


def _run(h, w, labels, temperature=1.0, g_lp=None, g_ent=None, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels, temperature, **kw)
    outs, grads = [], []
    if g_lp is not None:
        outs.append(lp)
        grads.append(g_lp)
    if g_ent is not None and ent is not None:
        outs.append(ent)
        grads.append(g_ent)
    if outs:
        torch.autograd.backward(outs, grads)
    torch.cuda.synchronize()
    return lp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


def _check_grads(dh, dw, r, lim=BF16_REL_L2, what=""):
    e_h = rel_l2(dh, r.dh, r.rss_dh)
    e_w = rel_l2(dw, r.dw, r.rss_dw)
    print(f"{what} dh rel_l2 {e_h:.2e}, dW rel_l2 {e_w:.2e} (limit {lim:.0e})")
    assert e_h <= lim, f"{what} dh rel_l2 {e_h:.3e} > {lim}"
    assert e_w <= lim, f"{what} dW rel_l2 {e_w:.3e} > {lim}"
    assert bool(torch.isfinite(dh).all()) and bool(torch.isfinite(dw).all())


@pytest.mark.parametrize("t,v,d", SHAPES, ids=[f"t{t}_v{v}_d{d}" for t, v, d in SHAPES])
def test_values_and_gradients(t, v, d):
    h, w, labels = _inputs(t, v, d, seed=t + v + d)
    g_lp, g_ent = _grads(t, t)
    lp, ent, dh, dw = _run(h, w, labels, 1.0, g_lp, g_ent)
    assert lp.dtype == torch.float32 and dh.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    r = reference(h, w, labels, 1.0, g_lp=g_lp, g_ent=g_ent, rss=True)
    check_forward_gpu(lp, ent, r, d, f"t{t} v{v} d{d}")
    _check_grads(dh, dw, r, what=f"t{t} v{v} d{d}")


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_ignore_index_and_temperature(temperature):
    t, v, d = 513, 3000, 264
    h, w, labels = _inputs(t, v, d, seed=11)
    labels[::7] = IGNORE
    g_lp, g_ent = _grads(t, 11)
    lp, ent, dh, dw = _run(h, w, labels, temperature, g_lp, g_ent)
    ign = labels == IGNORE
    assert bool((lp[ign] == 0).all()) and bool((ent[ign] == 0).all()) and bool((dh[ign] == 0).all())
    r = reference(h, w, labels, temperature, g_lp=g_lp, g_ent=g_ent, rss=True)
    check_forward_gpu(lp, ent, r, d, f"T={temperature}")
    _check_grads(dh, dw, r, what=f"T={temperature}")


@pytest.mark.parametrize("which", ["logprob", "entropy"])
def test_one_upstream_gradient(which):
    t, v, d = 300, 2000, 136
    h, w, labels = _inputs(t, v, d, seed=12)
    g_lp, g_ent = _grads(t, 12)
    g_lp = g_lp if which == "logprob" else None
    g_ent = g_ent if which == "entropy" else None
    lp, ent, dh, dw = _run(h, w, labels, 1.0, g_lp, g_ent)
    r = reference(h, w, labels, 1.0, g_lp=g_lp, g_ent=g_ent, rss=True)
    _check_grads(dh, dw, r, what=which)


def test_no_entropy_output():
    t, v, d = 200, 1000, 128
    h, w, labels = _inputs(t, v, d, seed=13)
    g_lp, _ = _grads(t, 13)
    lp, ent, dh, dw = _run(h, w, labels, 1.0, g_lp, None, return_entropy=False)
    assert ent is None
    r = reference(h, w, labels, 1.0, g_lp=g_lp, rss=True)
    check_forward_gpu(lp, None, r, d)
    _check_grads(dh, dw, r)


def test_frozen_weight_skips_dw(monkeypatch):
    t, v, d = 128, 1000, 64
    h, w, labels = _inputs(t, v, d, seed=14)
    seen = {}
    real = _native.gpu_backward

    def spy(*args):
        # gpu_backward(target, (operands, saved, (dh, dh_f32, dw, dw_f32)), scalars, reduce, comm)
        seen["dw"] = args[1][2][2]
        return real(*args)

    monkeypatch.setattr(_native, "gpu_backward", spy)
    hh = h.clone().requires_grad_(True)
    lp, ent = L.fused_linear_logprob(hh, w, labels)
    (lp.sum() + ent.sum()).backward()
    assert seen["dw"] == 0 and w.grad is None
    r = reference(h, w, labels, g_lp=torch.ones(t, device="cuda"), g_ent=torch.ones(t, device="cuda"), rss=True)
    e = rel_l2(hh.grad, r.dh, r.rss_dh)
    assert e <= BF16_REL_L2, e


def test_int32_labels_and_leading_dims():
    h, w, labels = _inputs(96, 777, 72, seed=15)
    lp64, ent64 = L.fused_linear_logprob(h.view(4, 24, 72), w, labels.view(4, 24))
    lp32, ent32 = L.fused_linear_logprob(h.view(4, 24, 72), w, labels.view(4, 24).int())
    assert lp64.shape == (4, 24)
    torch.testing.assert_close(lp64, lp32, rtol=0, atol=0)
    torch.testing.assert_close(ent64, ent32, rtol=0, atol=0)


def test_non_default_stream(monkeypatch):
    """The call is queued on the current stream: inputs produced on a side stream just before
    are read after they are written, and the stream passed down is that stream."""
    t, v, d = 2048, 8192, 1024
    _, w, labels = _inputs(t, v, d, seed=16)
    streams = []
    real = _native.gpu_forward

    def spy(*args):
        # gpu_forward((device, stream), buffers, scalars, comm)
        streams.append(args[0][1])
        return real(*args)

    monkeypatch.setattr(_native, "gpu_forward", spy)
    a = torch.randn(8192, 8192, device="cuda")
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        # A long matmul on s, then hidden derived from it: a call on any other stream would race.
        big = a @ a
        h = (big[:t, :d] / 100.0).to(torch.bfloat16).requires_grad_(True)
        lp, ent = L.fused_linear_logprob(h, w, labels)
        lp.sum().backward()
        out_lp, out_dh = lp.detach().clone(), h.grad.clone()
    s.synchronize()
    assert streams and streams[-1] == s.cuda_stream != torch.cuda.default_stream().cuda_stream
    h_ref = (big[:t, :d] / 100.0).to(torch.bfloat16)
    r = reference(h_ref, w, labels, g_lp=torch.ones(t, device="cuda"), rss=True)
    check_forward_gpu(out_lp, None, r, d, "side stream")
    assert rel_l2(out_dh, r.dh, r.rss_dh) <= BF16_REL_L2


def test_two_threads_two_streams():
    t, v, d = 512, 4096, 256
    data = [_inputs(t, v, d, seed=20 + i) for i in range(2)]
    out = [None, None]
    errors = []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                h, w, labels = data[i]
                for _ in range(5):
                    lp, ent = L.fused_linear_logprob(h, w, labels)
                out[i] = lp.clone()
            s.synchronize()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for i in range(2):
        h, w, labels = data[i]
        check_forward_gpu(out[i], None, reference(h, w, labels), d, f"thread {i}")


def test_workspace_comes_from_torch():
    """With the default allocator the workspace is PyTorch memory: the backward's staging (t·S
    bf16) shows in torch's peak and is back in torch's cache when the call returns; the
    forward's small buffers stay held (counted by torch and by the library alike) until
    release_workspace() hands them back."""
    if os.environ.get("LMHEAD_TORCH_ALLOCATOR", "1") == "0":
        pytest.skip("LMHEAD_TORCH_ALLOCATOR=0")
    from lmhead_torch import _core

    dev = torch.cuda.current_device()
    t, v, d = 4096, 32000, 1024
    h, w, labels = _inputs(t, v, d, seed=21)
    h.requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels)  # tunes (outside the measurement)
    lp.sum().backward()
    h.grad = None
    del lp, ent
    L.release_workspace()
    scratch = _core._devices[dev]
    assert scratch.held_bytes() == 0 and _native.workspace_bytes(dev) == 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = L.fused_linear_logprob(h, w, labels)
    lp.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    staging = t * min(v, 32768) * 2
    assert peak >= staging, f"peak {peak} < staging {staging}: the workspace is not allocated through torch"
    held = scratch.held_bytes()
    assert 0 < held < staging, f"held {held}: only the forward's small buffers stay"
    assert _native.workspace_bytes(dev) == held
    del lp, ent
    h.grad = None
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base + held + (1 << 20)
    L.release_workspace()
    assert scratch.held_bytes() == 0 and _native.workspace_bytes(dev) == 0
    assert torch.cuda.memory_allocated() <= base + (1 << 20)


def test_kept_workspace_across_streams():
    """The forward's kept buffers are used by calls on different streams back to back, without
    a synchronisation between them: each call waits for the previous one's use."""
    cases = [_inputs(6000, 40000, 1024, seed=40 + i) for i in range(2)]
    refs = [reference(h, w, labels) for h, w, labels in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for _ in range(2):
        outs = []
        for (h, w, labels), s in zip(cases, streams):
            with torch.cuda.stream(s):
                outs.append(L.fused_linear_logprob(h, w, labels))
        torch.cuda.synchronize()
        for (lp, ent), r in zip(outs, refs):
            check_forward_gpu(lp, ent, r, 1024, "kept workspace, two streams")


def test_fp32_operands():
    t, v, d = 700, 3001, 192
    h, w, labels = _inputs(t, v, d, seed=22, dtype=torch.float32, logit_std=1.0)
    g_lp, g_ent = _grads(t, 22)
    lp, ent, dh, dw = _run(h, w, labels, 1.0, g_lp, g_ent, precision="split")
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    r = reference(h, w, labels, 1.0, g_lp=g_lp, g_ent=g_ent, rss=True)
    split = float(2.0**-15 * (h.abs().double() @ w.abs().double().T).max())
    check_forward_gpu(lp, ent, r, 3 * d, "fp32", slack=split)
    _check_grads(dh, dw, r, lim=2e-5, what="fp32")


def test_mixed_bf16_hidden_fp32_weight():
    t, v, d = 500, 2000, 128
    h, w, labels = _inputs(t, v, d, seed=23, dtype=torch.float32, logit_std=1.0)
    h = h.to(torch.bfloat16)
    g_lp, _ = _grads(t, 23)
    lp, ent, dh, dw = _run(h, w, labels, 1.0, g_lp, None, precision="split")
    assert dh.dtype == torch.bfloat16 and dw.dtype == torch.float32
    r = reference(h, w, labels, 1.0, g_lp=g_lp, rss=True)
    split = float(2.0**-15 * (h.abs().double() @ w.abs().double().T).max())
    check_forward_gpu(lp, ent, r, 2 * d, "bf16 x fp32", slack=split)
    assert rel_l2(dh, r.dh, r.rss_dh) <= BF16_REL_L2
    assert rel_l2(dw, r.dw, r.rss_dw) <= 2e-5


@pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float32])
def test_fp32_weight_default_is_the_bf16_path(h_dtype):
    """``precision="bf16"`` (the default): an fp32 weight (and hidden) rounded once to bf16, the
    fused kernels, f32 gradients for the fp32 operands."""
    t, v, d = 600, 3001, 256
    h, w, labels = _inputs(t, v, d, seed=25, dtype=torch.float32, logit_std=1.0)
    h = h.to(h_dtype)
    g_lp, g_ent = _grads(t, 25)
    lp, ent, dh, dw = _run(h, w, labels, 1.0, g_lp, g_ent)
    assert dh.dtype == h_dtype and dw.dtype == torch.float32
    hb, wb = h.to(torch.bfloat16), w.to(torch.bfloat16)
    lp_b, ent_b, _, _ = _run(hb, wb, labels, 1.0, g_lp, g_ent)
    assert torch.equal(lp, lp_b) and torch.equal(ent, ent_b), "the default must be the bf16 call on the rounded operands"
    r = reference(hb, wb, labels, 1.0, g_lp=g_lp, g_ent=g_ent, rss=True)
    check_forward_gpu(lp, ent, r, d, "fp32 weight, default")
    assert rel_l2(dh, r.dh, r.rss_dh) <= BF16_REL_L2
    assert rel_l2(dw, r.dw, r.rss_dw) <= BF16_REL_L2


def test_bad_inputs_on_gpu():
    h, w, labels = _inputs(16, 40, 16, seed=24)
    labels[3] = 40
    with pytest.raises(ValueError) as ei:
        L.fused_linear_logprob(h, w, labels)
    assert ei.value.kind == "bad_label" and ei.value.row == 3
    hh = torch.empty(16 * 16 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(16, 16)
    with pytest.raises(ValueError, match="aligned"):
        L.fused_linear_logprob(hh, w, torch.zeros(16, dtype=torch.long, device="cuda"))
    with pytest.raises(ValueError, match="one device"):
        L.fused_linear_logprob(h, w.cpu(), labels)


def test_warm_up_and_device_info():
    info = L.device_info()
    assert tuple(info["cc"]) == torch.cuda.get_device_capability()
    assert info["module"] == ("hopper" if tuple(info["cc"]) == (9, 0) else "portable")
    print(info, _native.kernel_report(torch.cuda.current_device()))
    L.warm_up([100, 3000], 4096, 256, entropy=True, backward=True)
    h, w, labels = _inputs(3000, 4096, 256, seed=25)
    lp, ent = L.fused_linear_logprob(h, w, labels)
    check_forward_gpu(lp, ent, reference(h, w, labels), 256)
    L.release_workspace()


_OOM_SCRIPT = r"""
import os, torch
os.environ["LMHEAD_AUTOTUNE"] = "0"
import lmhead_torch as L
t, v, d = 4096, 32000, 1024
h = torch.randn(t, d, device="cuda").bfloat16().requires_grad_()
w = (torch.randn(v, d, device="cuda") * 0.03).bfloat16()
labels = torch.randint(0, v, (t,), device="cuda")
lp, _ = L.fused_linear_logprob(h, w, labels, return_entropy=False)
torch.cuda.synchronize()
total = torch.cuda.get_device_properties(0).total_memory
# Room for dh (8 MiB) but not for the backward's staging (t x 32000 bf16 = 250 MiB).
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (64 << 20)) / total)
try:
    lp.sum().backward()
except torch.cuda.OutOfMemoryError as e:
    assert isinstance(e.__cause__, L._native.DeviceMemoryError), repr(e.__cause__)
    print("OOM-MAPPED", e)
else:
    print("NO-OOM")
"""


def test_out_of_memory_is_torch_oom():
    env = dict(os.environ, LMHEAD_AUTOTUNE="0")
    r = subprocess.run([sys.executable, "-c", _OOM_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert "OOM-MAPPED" in r.stdout, r.stdout + r.stderr


def test_tp2_gloo_one_gpu():
    run_tp_cases(
        2,
        [
            ("core_tp", dict(t=300, v=5003, d=264, sizes=[2000, 3003], gpu_tol=True, temperature=0.9)),
            ("core_tp", dict(t=300, v=5003, d=264, sizes=[2000, 3003], gpu_tol=True, reduce=False)),
            ("label_error_tp", {}),
        ],
        "cuda0",
        "gloo",
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_tp2_nccl_two_gpus():
    run_tp_cases(
        2,
        [
            ("core_tp", dict(t=1000, v=32003, d=1024, sizes=[16000, 16003], gpu_tol=True)),
            ("core_tp", dict(t=1000, v=32003, d=1024, sizes=[16000, 16003], gpu_tol=True, reduce=False)),
        ],
        "cuda",
        "nccl",
    )


def test_bench_overhead_path_runs():
    """The benchmark's overhead measurement (paired binding and Rust calls) on a small shape:
    every field present and finite, the paired medians positive."""
    import math

    from lmhead_torch import bench

    h, w, labels = _inputs(512, 4096, 256, seed=41)
    res = bench._overhead(h, w, labels, 5, True)
    for k in ("rust_fwd_us", "binding_fwd_us", "rust_bwd_us", "binding_bwd_us", "overhead_fwd_us", "overhead_bwd_us", "noop_call_us"):
        assert k in res and math.isfinite(res[k]), (k, res)
    assert res["rust_fwd_us"] > 0 and res["binding_fwd_us"] > 0 and res["rust_torch_ws_bwd_us"] > 0
    print({k: round(v, 1) for k, v in res.items()})


@pytest.mark.parametrize("keep", [True, 4 * 256 * 3000, 1], ids=["all", "256 rows", "none fit"])
def test_keep_logits(keep):
    """``keep_logits``: the same log-probs bit for bit, gradients within the usual bound of the
    float64 reference and of the call without the mode (every row, whole tiles, none kept); under
    ``torch.no_grad`` nothing is allocated for it."""
    t, v, d = 700, 2997, 136
    h, w, labels = _inputs(t, v, d, seed=41)
    labels[::7] = IGNORE
    g_lp, g_ent = _grads(t, 41)
    lp0, ent0, dh0, dw0 = _run(h, w, labels, 0.9, g_lp, g_ent)
    lp1, ent1, dh1, dw1 = _run(h, w, labels, 0.9, g_lp, g_ent, keep_logits=keep)
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    r = reference(h, w, labels, 0.9, g_lp=g_lp, g_ent=g_ent, rss=True)
    _check_grads(dh1, dw1, r, what=f"keep={keep}")
    assert rel_l2(dh1, dh0, r.rss_dh) <= BF16_REL_L2 and rel_l2(dw1, dw0, r.rss_dw) <= BF16_REL_L2
    with torch.no_grad():
        torch.cuda.reset_peak_memory_stats()
        L.fused_linear_logprob(h, w, labels, 0.9)
        plain = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp2, _ = L.fused_linear_logprob(h, w, labels, 0.9, keep_logits=True)
        kept_bytes = 4 * t * ((v + 7) // 8 * 8)
        assert torch.cuda.max_memory_allocated() - plain < kept_bytes // 4, "no_grad kept logits"
    assert torch.equal(lp2, lp0)
