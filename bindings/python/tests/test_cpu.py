"""The API on CPU tensors (the exact float64 backend) against float64 torch: values, gradients,
ignore_index, temperature, absent upstream gradients, frozen weights, fp32/fp16 operands, and
bad inputs. Runs in CI without a GPU.

Tolerances: the CPU backend computes in float64 and returns float32 log-prob/entropy (relative
error ~6e-8, so ``atol 2e-6`` at these magnitudes) and float32 gradients that are then cast to
the input's dtype: bf16 gradients are exact up to that one rounding (relative ≤ 2⁻⁸), fp32 ones
to ~1e-6 relative.
"""

import pytest
import torch

import lmhead_torch as L
from lmhead_torch import _core, _impl, _native, _tp
from refs import IGNORE, close, reference, rel_l2

BF16_RTOL = 2.0**-8 + 1e-6


def _inputs(t=37, v=300, d=72, dtype=torch.bfloat16, lead=None, seed=0, scale=1.0, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=g) * scale
    w = torch.randn(v, d, generator=g) * (d**-0.5) * 2.0
    labels = torch.randint(0, v, (t,), generator=g)
    if lead is not None:
        h = h.reshape(*lead, d)
        labels = labels.reshape(lead)
    return h.to(dtype), w.to(w_dtype or dtype), labels


@pytest.mark.parametrize(
    "t,v,d,lead",
    [(37, 300, 64, None), (37, 300, 72, None), (1, 1, 8, None), (5, 7, 8, None), (24, 129, 136, (4, 6)), (1, 300, 64, (1, 1))],
)
def test_forward_matches_float64(t, v, d, lead):
    h, w, labels = _inputs(t, v, d, lead=lead)
    lp, ent = L.fused_linear_logprob(h, w, labels)
    r = reference(h, w, labels)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert lp.shape == labels.shape and ent.shape == labels.shape
    close(lp.reshape(-1), r.logprob, 1e-6, 2e-6, "logprob")
    close(ent.reshape(-1), r.entropy, 1e-6, 2e-6, "entropy")
    assert bool((lp <= 0).all())


@pytest.mark.parametrize("which", ["both", "logprob", "entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_gradients_match_float64(which, temperature):
    h, w, labels = _inputs(37, 300, 72, seed=1)
    h.requires_grad_(True)
    w.requires_grad_(True)
    g = torch.Generator().manual_seed(5)
    g_lp = torch.randn(37, generator=g) if which in ("both", "logprob") else None
    g_ent = torch.randn(37, generator=g) if which in ("both", "entropy") else None
    lp, ent = L.fused_linear_logprob(h, w, labels, temperature)
    outs, grads = [], []
    if g_lp is not None:
        outs.append(lp)
        grads.append(g_lp)
    if g_ent is not None:
        outs.append(ent)
        grads.append(g_ent)
    torch.autograd.backward(outs, grads)
    r = reference(h, w, labels, temperature, g_lp=g_lp, g_ent=g_ent)
    close(lp, r.logprob, 1e-6, 2e-6, "logprob")
    close(ent, r.entropy, 1e-6, 2e-6, "entropy")
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    close(h.grad, r.dh, BF16_RTOL, 1e-7, "dh")
    close(w.grad, r.dw, BF16_RTOL, 1e-7, "dW")
    assert float(h.grad.float().abs().sum()) > 0 and float(w.grad.float().abs().sum()) > 0


def test_ignore_index_rows_are_zero_with_no_gradient():
    h, w, labels = _inputs(37, 300, 64, seed=2)
    labels[::4] = IGNORE
    h.requires_grad_(True)
    w.requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels)
    (lp.sum() + 0.5 * ent.sum()).backward()
    r = reference(h, w, labels, g_lp=torch.ones(37), g_ent=torch.full((37,), 0.5))
    ign = labels == IGNORE
    assert bool((lp[ign] == 0).all()) and bool((ent[ign] == 0).all())
    assert bool((h.grad[ign] == 0).all())
    close(lp, r.logprob, 1e-6, 2e-6, "logprob")
    close(h.grad, r.dh, BF16_RTOL, 1e-7, "dh")
    close(w.grad, r.dw, BF16_RTOL, 1e-7, "dW")


def test_custom_ignore_index():
    h, w, labels = _inputs(20, 50, 16, seed=3)
    labels[:5] = 7  # a valid vocab id used as ignore_index: those rows are ignored
    lp, ent = L.fused_linear_logprob(h, w, labels, ignore_index=7)
    assert bool((lp[labels == 7] == 0).all()) and bool((ent[labels == 7] == 0).all())
    r = reference(h, w, labels, ignore_index=7)
    close(lp, r.logprob, 1e-6, 2e-6, "logprob")


def test_no_entropy_and_absent_gradients():
    h, w, labels = _inputs(16, 40, 16, seed=4)
    h.requires_grad_(True)
    w.requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels, return_entropy=False)
    assert ent is None
    lp.sum().backward()
    r = reference(h, w, labels, g_lp=torch.ones(16))
    close(h.grad, r.dh, BF16_RTOL, 1e-7, "dh")
    # Outputs that are not used: no gradient flows and nothing fails.
    h2 = h.detach().clone().requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h2, w, labels)
    (ent.sum() * 0).backward()
    assert h2.grad is not None and float(h2.grad.float().abs().max()) == 0.0


def test_frozen_weight_skips_dw(monkeypatch):
    h, w, labels = _inputs(16, 40, 16, seed=5)
    h.requires_grad_(True)
    seen = {}
    real = _native.cpu_backward

    def spy(bufs, *rest):
        seen["dw"] = bufs[2][2]  # BwdBufs: (operands, saved, (dh, dh_f32, dw, dw_f32))
        return real(bufs, *rest)

    monkeypatch.setattr(_native, "cpu_backward", spy)
    lp, ent = L.fused_linear_logprob(h, w, labels)
    (lp.sum() + ent.sum()).backward()
    assert seen["dw"] == 0, "dW must not be computed for a frozen weight"
    assert w.grad is None
    r = reference(h, w, labels, g_lp=torch.ones(16), g_ent=torch.ones(16))
    close(h.grad, r.dh, BF16_RTOL, 1e-7, "dh")
    # And it is computed when the weight needs it.
    w.requires_grad_(True)
    lp, _ = L.fused_linear_logprob(h, w, labels)
    lp.sum().backward()
    assert seen["dw"] != 0 and w.grad is not None


def test_only_weight_needs_grad():
    h, w, labels = _inputs(16, 40, 16, seed=6)
    w.requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels)
    lp.sum().backward()
    r = reference(h, w, labels, g_lp=torch.ones(16))
    close(w.grad, r.dw, BF16_RTOL, 1e-7, "dW")


@pytest.mark.parametrize(
    "h_dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_fp32_operands_are_split_accurately(h_dtype, w_dtype):
    """fp32/fp16 operands through the bf16 hi+lo split (``precision="split"``). Measured here (CPU, exact arithmetic on
    the parts): log-prob within 3e-5 of float64 (the split's logit error is ~2^-18·Σ|h_i·w_i|,
    Σ ≈ 10 at these scales), fp32 gradients at ~6e-6 relative L2. Bounds: 1e-4 absolute on
    log-prob/entropy, 5e-5 relative L2 on fp32 gradients (against max(‖ref‖, ‖rss‖), rss = each
    element's root sum of squared terms), 6e-4 on fp16 and 4e-3 on bf16 ones (their rounding)."""
    h, w, labels = _inputs(37, 300, 64, seed=7, dtype=torch.float32)
    h, w = h.to(h_dtype), w.to(w_dtype)
    h.requires_grad_(True)
    w.requires_grad_(True)
    g = torch.Generator().manual_seed(8)
    g_lp, g_ent = torch.randn(37, generator=g), torch.randn(37, generator=g)
    lp, ent = L.fused_linear_logprob(h, w, labels, 0.9, precision="split")
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    r = reference(h, w, labels, 0.9, g_lp=g_lp, g_ent=g_ent, rss=True)
    close(lp, r.logprob, 0.0, 1e-4, "logprob")
    close(ent, r.entropy, 0.0, 1e-4, "entropy")
    assert h.grad.dtype == h_dtype and w.grad.dtype == w_dtype
    lim = lambda dt: {torch.bfloat16: 4e-3, torch.float16: 6e-4}.get(dt, 5e-5)  # noqa: E731
    assert rel_l2(h.grad, r.dh, r.rss_dh) <= lim(h_dtype), rel_l2(h.grad, r.dh, r.rss_dh)
    assert rel_l2(w.grad, r.dw, r.rss_dw) <= lim(w_dtype), rel_l2(w.grad, r.dw, r.rss_dw)
    # And elementwise, loosely (the output dtype's rounding plus 1e-3).
    rt = lambda dt: {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(dt, 0.0) + 1e-3  # noqa: E731
    close(h.grad, r.dh, rt(h_dtype), 1e-4, "dh")
    close(w.grad, r.dw, rt(w_dtype), 1e-4, "dW")


def test_fp32_split_is_not_a_rounding():
    """``precision="split"`` must not just round to bf16: this input's bf16 rounding moves the
    log-probs by far more than the tolerance the split is held to."""
    h, w, labels = _inputs(37, 300, 64, seed=7, dtype=torch.float32, scale=3.0)
    lp, _ = L.fused_linear_logprob(h, w, labels, precision="split")
    r = reference(h, w, labels)
    r16 = reference(h.bfloat16(), w.bfloat16(), labels)
    assert float((r16.logprob - r.logprob).abs().max()) > 1e-3
    close(lp, r.logprob, 0.0, 1e-4, "logprob")


@pytest.mark.parametrize(
    "h_dtype,w_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_fp32_default_rounds_once_to_bf16(h_dtype, w_dtype):
    """The default contract (``precision="bf16"``): fp32/fp16 operands give what their bf16
    roundings give — the same log-probs and entropies bitwise, the same gradients up to the
    gradient's own dtype (f32 from the backend, not rounded through bf16) — and the gradients
    come back in the operands' dtypes."""
    h, w, labels = _inputs(37, 300, 64, seed=11, dtype=torch.float32)
    h, w = h.to(h_dtype), w.to(w_dtype)
    g = torch.Generator().manual_seed(12)
    g_lp, g_ent = torch.randn(37, generator=g), torch.randn(37, generator=g)
    hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = L.fused_linear_logprob(hx, wx, labels, 0.9)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    lp_b, ent_b = L.fused_linear_logprob(hb, wb, labels, 0.9)
    assert torch.equal(lp, lp_b) and torch.equal(ent, ent_b)
    assert hx.grad.dtype == h_dtype and wx.grad.dtype == w_dtype
    r = reference(hb.detach(), wb.detach(), labels, 0.9, g_lp=g_lp, g_ent=g_ent)
    # (f32 gradients: the float64 backend's, rounded once to f32; bf16/fp16 ones once more.)
    rt = lambda dt: {torch.bfloat16: BF16_RTOL, torch.float16: 2.0**-10}.get(dt, 1e-5)  # noqa: E731
    close(hx.grad, r.dh, rt(h_dtype), 1e-6, "dh")
    close(wx.grad, r.dw, rt(w_dtype), 1e-6, "dW")


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("temperature,grads", [(1.0, "both"), (0.7, "lp"), (1.3, "ent")])
def test_fp32_chunked_backward_matches_float64(chunk, temperature, grads):
    """The GPU's backward for fp32/fp16 operands (fp32 torch over vocabulary chunks, see the
    module docs) on CPU tensors: peaked rows (the label dominates), diffuse rows, ignored rows,
    either upstream gradient, temperature, a chunk width that does not divide V, held to the
    fp32 tolerance of SkyRL's tests (1e-4)."""
    t, v, d = 24, 64, 32
    g = torch.Generator().manual_seed(9)
    w = torch.randn(v, d, generator=g) * d**-0.5
    labels = torch.randint(0, v, (t,), generator=g)
    h = torch.randn(t, d, generator=g) * 0.3
    h[: t // 2] += 12.0 * w[labels[: t // 2]]  # peaked rows: the label's logit (~12) dominates
    labels[3] = IGNORE
    labels[20] = IGNORE
    g_lp = torch.randn(t, generator=g) if grads in ("both", "lp") else None
    g_ent = torch.randn(t, generator=g) if grads in ("both", "ent") else None
    r = reference(h, w, labels, temperature=temperature, g_lp=g_lp, g_ent=g_ent)
    cfg = _impl._Cfg(temperature=temperature, ignore_index=IGNORE, entropy=True, tp=None, reduce_dh=True)
    lse, ent = r.lse.float(), r.entropy.float()
    dh, dw = _impl._backward_chunked(h, w, labels, lse, ent, g_lp, g_ent, True, cfg, chunk=chunk)
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    close(dh, r.dh, 1e-4, 1e-4, "dh")
    close(dw, r.dw, 1e-4, 1e-4, "dW")
    assert float(dh[3].abs().max()) == 0.0 and float(dh[20].abs().max()) == 0.0
    # Without dW: none computed.
    dh2, dw2 = _impl._backward_chunked(h, w, labels, lse, ent, g_lp, g_ent, False, cfg, chunk=chunk)
    assert dw2 is None and torch.equal(dh2, dh)


def test_fp32_chunked_backward_oov_targets_keep_minus_p():
    """SkyRL's semantics in the chunked backward: a target no rank owns has log-prob 0 and
    d-logits ``−p`` (no one-hot); a shard's ``v_begin`` offsets the labels."""
    t, v, d = 10, 40, 16
    g = torch.Generator().manual_seed(4)
    h = torch.randn(t, d, generator=g)
    w = torch.randn(v, d, generator=g) * d**-0.5
    labels = torch.randint(0, v, (t,), generator=g)
    labels[2] = -100
    labels[5] = v + 3
    g_lp = torch.randn(t, generator=g)
    z = (h.double() @ w.double().T)
    lse = torch.logsumexp(z, -1)
    p = (z - lse[:, None]).exp()
    onehot = torch.zeros_like(p)
    ok = (labels >= 0) & (labels < v)
    onehot[ok.nonzero().squeeze(1), labels[ok]] = 1.0
    dl = g_lp.double()[:, None] * (onehot - p)
    cfg = _impl._Cfg(temperature=1.0, ignore_index=-1, entropy=False, tp=None, reduce_dh=False, oov_zero=True)
    dh, dw = _impl._backward_chunked(h, w, labels, lse.float(), None, g_lp, None, True, cfg, chunk=16)
    close(dh, dl @ w.double(), 1e-4, 1e-4, "dh")
    close(dw, dl.T @ h.double(), 1e-4, 1e-4, "dW")


def test_outputs_may_be_modified_in_place():
    """The backward reads copies, not the returned tensors."""
    h, w, labels = _inputs(16, 40, 16, seed=30, dtype=torch.float32)
    h.requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels, precision="split")
    g = torch.Generator().manual_seed(31)
    g_lp, g_ent = torch.randn(16, generator=g), torch.randn(16, generator=g)
    r = reference(h, w, labels, g_lp=g_lp, g_ent=g_ent)
    lp2, ent2 = lp * 1.0, ent * 1.0
    lp.mul_(0.0)  # a custom Function's outputs, modified in place after the fact
    ent.add_(5.0)
    torch.autograd.backward([lp2, ent2], [g_lp, g_ent])
    close(h.grad, r.dh, 1e-3, 1e-4, "dh")


def test_empty_batch():
    h, w, labels = _inputs(1, 10, 8)
    h = h[:0].clone().requires_grad_(True)
    lp, ent = L.fused_linear_logprob(h, w, labels[:0])
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    assert h.grad.shape == (0, 8)


# ---------------------------------------------------------------------------------------------
# Bad inputs -> ValueError
# ---------------------------------------------------------------------------------------------


def _ok():
    return _inputs(8, 20, 16, seed=10)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda h, w, l: (h.double(), w, l), "dtype"),
        (lambda h, w, l: (h, w.double(), l), "dtype"),
        (lambda h, w, l: (h, w, l.float()), "labels have dtype"),
        (lambda h, w, l: (h, w, l.to(torch.int16)), "labels have dtype"),
        (lambda h, w, l: (h[:, :8], w, l), "hidden size mismatch"),
        (lambda h, w, l: (h, w[:, :8].contiguous(), l), "hidden size mismatch"),
        (lambda h, w, l: (h, w, l[:5]), "labels must have shape"),
        (lambda h, w, l: (h, w.reshape(-1), l), "weight must be"),
        (lambda h, w, l: (h.t().contiguous().t(), w, l), "contiguous"),
        (lambda h, w, l: (h, w.t().contiguous().t(), l), "contiguous"),
        (lambda h, w, l: (h, w, torch.stack([l, l], 1)[:, 0]), "contiguous"),
        (lambda h, w, l: (h[:, :12].contiguous(), w[:, :12].contiguous(), l), "multiple of 8"),
        (lambda h, w, l: (h, w[:0], l), "no vocabulary"),
        (lambda h, w, l: (h.numpy() if h.dtype != torch.bfloat16 else [1.0], w, l), "torch.Tensor"),
    ],
)
def test_bad_inputs_raise_value_error(mutate, match):
    h, w, labels = _ok()
    h, w, labels = mutate(h, w, labels)
    with pytest.raises(ValueError, match=match):
        L.fused_linear_logprob(h, w, labels)


@pytest.mark.parametrize("label", [20, 1000, -1, -101])
def test_label_out_of_range_raises_value_error(label):
    h, w, labels = _ok()
    labels[3] = label
    with pytest.raises(ValueError, match="outside") as ei:
        L.fused_linear_logprob(h, w, labels)
    assert isinstance(ei.value, L.InputError)
    assert ei.value.kind == "bad_label" and ei.value.row == 3 and ei.value.label == label


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), "hot"])
def test_bad_temperature_raises_value_error(temperature):
    h, w, labels = _ok()
    with pytest.raises(ValueError, match="temperature"):
        L.fused_linear_logprob(h, w, labels, temperature)


def test_library_validation_is_typed():
    """Errors raised by the Rust library itself (not the Python checks) are ValueErrors too."""
    h, w, labels = _ok()
    lp = torch.empty(8)
    hb, wb = h.view(torch.int16), w.view(torch.int16)

    def cpu_forward(d, sc):
        ops = (hb.data_ptr(), wb.data_ptr(), labels.data_ptr(), True, 8, 20, d)
        _core._call(_native.cpu_forward, (ops, (lp.data_ptr(), lp.data_ptr(), 0)), sc, None)

    with pytest.raises(ValueError) as ei:
        cpu_forward(16, (1.0, -100, 5, 20, 0))  # a shard that does not fit the vocabulary
    assert isinstance(ei.value, L.InputError) and ei.value.kind == "invalid"
    with pytest.raises(ValueError) as ei:
        cpu_forward(12, (1.0, -100, 0, 20, 0))
    assert ei.value.kind == "shape"
    with pytest.raises(ValueError) as ei:
        cpu_forward(16, (0.0, -100, 0, 20, 0))
    assert ei.value.kind == "temperature"


def test_vocab_start_without_group_is_rejected():
    h, w, labels = _ok()
    with pytest.raises(ValueError, match="tp_group"):
        L.fused_linear_logprob(h, w, labels, vocab_start_index=4)


def test_warm_up_on_cpu_is_a_noop_and_release_is_safe():
    L.warm_up([128, 4096], 1000, 64, device="cpu")
    L.release_workspace()
    assert L.gpu_supported() in (False, True)


def test_no_gpu_raises_unavailable_error():
    if L.gpu_supported():
        pytest.skip("a supported GPU is present")
    if _native.driver_present():
        # A driver without a device the library supports: opening device 0 must fail with the
        # fall-back-able RuntimeError (or succeed if it is, in fact, usable).
        pass
    with pytest.raises(RuntimeError) as ei:
        _core._call(_native.device_info, 0)
    assert isinstance(ei.value, L.UnavailableError) or ei.value.kind in ("no_driver", "unsupported_device", "driver")


@pytest.mark.skipif(not torch.cuda.is_available() or L.gpu_supported(), reason="needs a CUDA GPU the library does not support")
def test_other_gpu_raises_unavailable_error():
    h = torch.randn(8, 16, device="cuda").bfloat16()
    w = torch.randn(16, 16, device="cuda").bfloat16()
    with pytest.raises(L.UnavailableError):
        L.fused_linear_logprob(h, w, torch.zeros(8, dtype=torch.long, device="cuda"))


@pytest.mark.skipif(_native.driver_present(), reason="a CUDA driver is present: the GPU tests call these for real")
def test_gpu_call_sites_match_the_native_signatures():
    """Without a GPU the GPU entry points still parse their arguments before failing to open the
    device: the argument tuples the package builds (and the bench's) must reach that point, i.e.
    raise UnavailableError, not TypeError."""
    t, v, d = 4, 8, 16
    hb, wb = torch.zeros(t, d, dtype=torch.bfloat16), torch.zeros(v, d, dtype=torch.bfloat16)
    labels = torch.zeros(t, dtype=torch.long)
    f = torch.zeros(t)
    dh, dw = torch.zeros(t, d), torch.zeros(v, d)
    tp = _tp._TP(None, 0, 2, 0, 16)
    comm = tp.cuda_comm(torch.device("cuda", 0))
    target = (0, 0)
    for c in (None, comm):
        for lab, ent in ((labels, f), (labels.int(), None)):
            with pytest.raises(L.UnavailableError):
                _native.gpu_forward(target, _impl._fwd_bufs(hb, wb, lab, d, f, f, ent), (1.0, -100, 0, v, 1), c)
        for reduce in (0, 1, 2):
            for args in (_impl._bwd_bufs(hb, wb, labels, f, f, f, f, dh, dw), _impl._bwd_bufs(hb, wb, labels, f, None, f, None, dh.bfloat16(), None)):
                with pytest.raises(L.UnavailableError):
                    _native.gpu_backward(target, args, (1.0, -100, 0, v + 1, 0), reduce, c)
    # The bench's raw-call timers and the other device entries.
    sc = (1.0, -100, 0, v, 0)
    fargs = (target, _impl._fwd_bufs(hb, wb, labels, d, f, f, f), sc)
    bargs = (target, _impl._bwd_bufs(hb, wb, labels, f, f, f, f, dh, dw), sc)
    for fn, args in ((_native.time_forward, fargs + (3,)), (_native.time_backward, bargs + (3,)), (_native.warm_up, (0, [1, 2], v, d, True, True)),
                     (_native.set_scratch, (0, None)), (_native.workspace_bytes, (0,)), (_native.kernel_report, (0,)),
                     (_native.label_status, (target,))):  # fmt: skip
        with pytest.raises(L.UnavailableError):
            fn(*args)
    assert _native.device_supported(0)[0] is False
    _native.noop(*fargs)
    _native.release_workspace()


def test_bench_calls_bind_to_the_internal_signatures():
    """The benchmark's GPU-only overhead path calls ``_impl._backward`` and ``_impl._forward``
    directly; a signature change must fail here, not first on a GPU machine."""
    import ast
    import inspect

    from lmhead_torch import bench

    tree = ast.parse(inspect.getsource(bench))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id in ("_core", "_impl")
    ]
    checked = 0
    for c in calls:
        fn = getattr({"_core": _core, "_impl": _impl}[c.func.value.id], c.func.attr)
        if not inspect.isfunction(fn):
            continue
        if any(isinstance(a, ast.Starred) for a in c.args):
            continue
        sig = inspect.signature(fn)
        sig.bind(*range(len(c.args)), **{k.arg: None for k in c.keywords if k.arg})
        checked += 1
    assert checked >= 4, "expected the bench to call _impl._forward, _impl._backward and the buffer builders"


def test_keep_logits_is_accepted_and_checked():
    """``keep_logits`` on CPU tensors: accepted (the CPU backend recomputes in float64), the same
    values and gradients; a bad value is a ValueError before anything runs."""
    h, w, labels = _inputs(40, 300, 64)
    outs = []
    for keep in (None, True, 1 << 20):
        hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        lp, ent = L.fused_linear_logprob(hh, ww, labels, keep_logits=keep)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0]))
    for bad in (-1, 1.5, "all"):
        with pytest.raises(ValueError):
            L.fused_linear_logprob(h, w, labels, keep_logits=bad)
    row = 2 * 1024 + 4 * 1024 // 32 + 4  # lmhead::keep::row_bytes: fp16 q, group maxima, label
    assert _impl._keep_row_len(1000) * 4 == row == _impl._keep_row_len(1003) * 4
    assert _impl._keep_rows(300, 1000, -1) == 300
    assert _impl._keep_rows(300, 1000, row * 299) == 256
    assert _impl._keep_rows(300, 1003, row * 300) == 300
    assert _impl._keep_rows(300, 1000, row * 127) == 0
