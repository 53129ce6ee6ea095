"""The drop-ins' semantics on CPU tensors (the float64 backend), against float64 references of
the originals' definitions: SkyRL's active rows, entropy, temperature, out-of-vocabulary targets
and vocabulary size from equal shards; verl's reductions; ``active_mask`` of the op; and the
torch fallback the drop-ins take on a GPU the library does not support (run here on CPU
tensors by forcing it).

Tolerances: the float64 backend returns f32 outputs (``atol 2e-6``) and gradients rounded once
to the inputs' dtype (bf16: relative ``2⁻⁸``); the torch fallback computes in fp32 over
vocabulary chunks (``1e-5`` on log-probs and entropy, ``1e-4`` relative on gradients).
"""

import pytest
import torch

import lmhead_torch as L
from lmhead_torch import _impl, skyrl, verl
from refs import close, reference
from skyrl_ref import float64_reference

BF16_RTOL = 2.0**-8 + 1e-6


def _inputs(B=2, S=20, V=96, H=32, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(dtype)
    target = torch.randint(0, V, (B, S), generator=g)
    return h, w, target


def _skyrl_fb(h, w, target, mask=None, entropy=False, ent_grad=False, **kw):
    hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = L.FusedLinearLogprob.apply(hx, wx, target, 0, w.shape[0], 8, None, False, mask, None, entropy, ent_grad, **kw)
    lp, ent = (out if entropy else (out, None))
    seed = torch.linspace(0.5, 1.5, steps=lp.numel()).reshape(lp.shape)
    loss = (lp * seed).sum()
    if ent_grad:
        loss = loss + (ent * 0.3).sum()
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), hx.grad, wx.grad, seed, ent


def test_skyrl_active_mask_follows_the_fork():
    """The fork's convention: rows ``active_mask`` leaves out give log-prob 0 and no gradient
    (its torch path masks the outputs, which zeroes their gradient); active out-of-vocabulary
    targets keep log-prob 0 and ``-p·g``."""
    h, w, target = _inputs(seed=1)
    V = w.shape[0]
    target[0, 3] = V + 7  # active, owned by no rank
    target[1, 5] = -100
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(target.shape, generator=g) > 0.4
    mask[0, 3] = True
    lp, _, dh, dw, seed, _ = _skyrl_fb(h, w, target, mask)
    lp64, dh64, dw64 = float64_reference(h, w, target, 0, V, seed * mask)
    close(lp, torch.where(mask, lp64, 0.0), 0.0, 2e-6, "logprob")
    assert bool((lp[~mask] == 0).all())
    close(dh, dh64, BF16_RTOL, 1e-7, "grad_hidden")
    close(dw, dw64, BF16_RTOL, 1e-7, "grad_weight")
    assert bool((dh[~mask] == 0).all()), "an inactive row got a gradient"
    assert float(dh[0, 3].float().abs().max()) > 0, "an active out-of-vocabulary target keeps -p·g"
    # The same with active_spans (accepted, not needed) and with an int mask.
    lp2 = L.FusedLinearLogprob.apply(h, w, target, 0, V, 8, None, True, mask.int(), ((0, 5), (7, 20)))
    assert torch.equal(lp2, lp)


def test_skyrl_entropy_outputs():
    h, w, target = _inputs(seed=3)
    V = w.shape[0]
    mask = torch.ones(target.shape, dtype=torch.bool)
    mask[1, :4] = False
    lp, ent, dh, _, seed, ent_t = _skyrl_fb(h, w, target, mask, entropy=True)
    r = reference(h.reshape(-1, h.shape[-1]), w, target.reshape(-1))
    close(ent.reshape(-1), torch.where(mask.reshape(-1), r.entropy, 0.0), 0.0, 2e-6, "entropy")
    assert not ent_t.requires_grad, "entropy is non-differentiable without entropy_requires_grad"
    # With entropy_requires_grad: the entropy's gradient joins the log-prob's.
    _, _, dh2, dw2, seed, ent2 = _skyrl_fb(h, w, target, mask, entropy=True, ent_grad=True)
    assert ent2.requires_grad
    gl = (seed * mask).reshape(-1)
    ge = (torch.full(target.shape, 0.3) * mask).reshape(-1)
    r2 = reference(h.reshape(-1, h.shape[-1]), w, target.reshape(-1), g_lp=gl, g_ent=ge)
    close(dh2.reshape(-1, h.shape[-1]), r2.dh, BF16_RTOL, 1e-7, "grad_hidden with entropy")
    close(dw2, r2.dw, BF16_RTOL, 1e-7, "grad_weight with entropy")
    with pytest.raises(ValueError, match="compute_entropy"):
        L.FusedLinearLogprob.apply(h, w, target, 0, V, 8, None, False, None, None, False, True)
    with pytest.raises(ValueError, match="inference_only"):
        L.FusedLinearLogprob.apply(h, w, target, 0, V, 8, None, True, None, None, True, True)


def test_skyrl_temperature_goes_to_the_kernel():
    """``temperature=T`` gives SkyRL's ``hidden @ (W/T)ᵀ`` (float64: exactly), without a
    divided copy of the weight."""
    h, w, target = _inputs(seed=4)
    lp, _, dh, dw, seed, _ = _skyrl_fb(h, w, target, temperature=0.7)
    r = reference(h.reshape(-1, h.shape[-1]), w, target.reshape(-1), 0.7, g_lp=seed.reshape(-1))
    close(lp.reshape(-1), r.logprob, 0.0, 2e-6, "logprob")
    close(dh.reshape(-1, h.shape[-1]), r.dh, BF16_RTOL, 1e-7, "grad_hidden")
    close(dw, r.dw, BF16_RTOL, 1e-7, "grad_weight")


def test_skyrl_vocabulary_from_equal_shards_needs_no_communication(monkeypatch):
    """Equal shards (``vocab_start_index == rank · V_local``): ``V_total = world · V_local``
    without an all-reduce; unequal ones all-reduce (eager only)."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 2)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda n, **k: (calls.append(n), n.fill_(400)))
    tp = skyrl._tp_of(object(), 100, 200, None, torch.device("cpu"))
    assert (tp.v_begin, tp.v_total, tp.rank, tp.size) == (200, 400, 2, 4) and not calls
    tp = skyrl._tp_of(object(), 100, 200, 450, torch.device("cpu"))
    assert tp.v_total == 450 and not calls
    tp = skyrl._tp_of(object(), 100, 150, None, torch.device("cpu"))  # unequal: the all-reduce
    assert len(calls) == 1 and tp.v_total == 400


def test_skyrl_entropy_function():
    """``fused_vocab_parallel_entropy_from_hidden`` against SkyRL's definition (the entropy of
    ``softmax(hidden · Wᵀ / T)``), and differentiable under grad mode."""
    h, w, _ = _inputs(seed=5)
    ent = L.fused_vocab_parallel_entropy_from_hidden(h, w, None, chunk_size=4, temperature=0.8)
    assert ent.shape == h.shape[:2] and ent.dtype == torch.float32
    z = (h.double() @ w.double().T) / 0.8
    p = torch.softmax(z, -1)
    want = -(p * torch.log_softmax(z, -1)).sum(-1)
    close(ent, want, 0.0, 2e-6, "entropy")
    hx = h.clone().requires_grad_(True)
    L.fused_vocab_parallel_entropy_from_hidden(hx, w, None, temperature=0.8).sum().backward()
    r = reference(h.reshape(-1, h.shape[-1]), w, torch.zeros(h.shape[0] * h.shape[1], dtype=torch.long), 0.8, g_ent=torch.ones(h.shape[0] * h.shape[1]))
    close(hx.grad.reshape(-1, h.shape[-1]), r.dh, BF16_RTOL, 1e-7, "d hidden of the entropy")


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_verl_reductions_as_verl_defines_them(reduction):
    """verl's ``"mean"`` divides by every token (``num_tokens = labels.shape[0]``, forward and
    backward); ``-100`` rows contribute 0 to the sum (verl has no ignore index)."""
    h, w, labels = _inputs(seed=6)
    labels[0, :5] = -100
    N = labels.numel()
    hx = h.clone().requires_grad_(True)
    lp, ent = L.linear_cross_entropy(hx, w, labels, 1.0, reduction)
    assert ent.shape == (N,) and lp.shape == ((N,) if reduction == "none" else ())
    (lp.sum() if reduction == "none" else lp).backward()
    g = torch.full((N,), 1.0 / N if reduction == "mean" else 1.0)
    r = reference(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), g_lp=g)
    if reduction == "none":
        close(lp, r.logprob, 0.0, 2e-6, "logprobs")
    else:
        want = float(r.logprob.sum()) / (N if reduction == "mean" else 1)
        assert abs(float(lp.detach()) - want) <= 1e-5 * max(1.0, abs(want)), (float(lp.detach()), want)
    close(hx.grad.reshape(-1, h.shape[-1]), r.dh, BF16_RTOL, 1e-7, "d hidden")


def test_active_mask_is_ignore_index():
    h, w, target = _inputs(seed=7)
    h2, lab = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    mask = torch.arange(lab.numel()) % 3 != 0
    lp, ent = L.fused_linear_logprob(h2, w, lab, active_mask=mask)
    lp2, ent2 = L.fused_linear_logprob(h2, w, lab.masked_fill(~mask, -100))
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
    with pytest.raises(ValueError, match="active_mask"):
        L.fused_linear_logprob(h2, w, lab, active_mask=mask[:5])
    with pytest.raises(ValueError, match="active_mask"):
        L.fused_linear_logprob(h2, w, lab, active_mask=mask.int())


def _force_fallback(monkeypatch):
    monkeypatch.setattr(skyrl, "_fallback", lambda x: True)
    monkeypatch.setattr(verl, "_fallback", lambda x: True)


def test_fallback_matches_float64(monkeypatch):
    """The torch fallback (fp32 math over vocabulary chunks) has the drop-ins' semantics."""
    _force_fallback(monkeypatch)
    h, w, target = _inputs(seed=8)
    V = w.shape[0]
    target[0, 2] = V + 3
    mask = torch.ones(target.shape, dtype=torch.bool)
    mask[1, 7:] = False
    lp, ent, dh, dw, seed, _ = _skyrl_fb(h, w, target, mask, entropy=True, temperature=1.3)
    hf, wf = h.double(), w.double()
    lp64, dh64, dw64 = float64_reference(hf / 1.3, wf, target, 0, V, seed * mask)
    close(lp, torch.where(mask, lp64, 0.0), 0.0, 1e-5, "fallback logprob")
    close(dh, dh64 / 1.3, 2.0**-8 + 1e-4, 1e-6, "fallback grad_hidden")
    close(dw, dw64, 2.0**-8 + 1e-4, 1e-6, "fallback grad_weight")
    labels = target.clone()
    labels[0, 2] = -100
    vl, ve = L.linear_cross_entropy(h, w, labels, 0.9, "none")
    r = reference(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), 0.9)
    close(vl, r.logprob, 0.0, 1e-5, "fallback verl logprobs")
    close(ve, r.entropy, 0.0, 1e-5, "fallback verl entropy")
    bad = labels.clone()
    bad[1, 1] = V
    with pytest.raises(ValueError, match="outside"):
        L.linear_cross_entropy(h, w, bad, 1.0, "none")


def test_fallback_cfg_runs_on_cpu_tensors():
    """``_impl._forward`` with ``fallback`` on CPU tensors equals the float64 backend to fp32."""
    h, w, target = _inputs(seed=9)
    h2, lab = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    lab[::5] = -100
    cfg = _impl._Cfg(1.0, -100, True, None, True, fallback=True)
    lp, lse, ent, _, _ = _impl._forward(h2, w, lab, cfg)
    r = reference(h2, w, lab)
    close(lp, r.logprob, 0.0, 1e-5, "logprob")
    close(lse, r.lse, 0.0, 1e-5, "lse")
    close(ent, r.entropy, 0.0, 1e-5, "entropy")


def test_settings_are_checked():
    with pytest.raises(ValueError, match="label_check"):
        L.set_label_check("later")
    with pytest.raises(ValueError, match="precision"):
        L.set_precision("fp64")
    h, w, target = _inputs(seed=10)
    with pytest.raises(ValueError, match="precision"):
        L.fused_linear_logprob(h, w, target, precision="tf32")
    # CPU tensors check labels synchronously whatever the setting; the status is a no-op.
    L.set_label_check("deferred")
    try:
        bad = target.clone()
        bad[0, 0] = w.shape[0]
        with pytest.raises(ValueError, match="outside"):
            L.fused_linear_logprob(h, w, bad)
    finally:
        L.set_label_check("sync")
    assert L.check_labels_status() is None
