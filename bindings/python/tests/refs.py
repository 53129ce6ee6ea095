"""float64 references and tolerance helpers shared by the tests (not collected by pytest).

The reference takes the very values the op sees: bf16 inputs are exact in float64, fp32 inputs
too, so ``reference(...)`` is the exact answer the library approximates. Gradients come from
autograd over the float64 graph; ``dlogits`` gives the same d-logits explicitly, for the
root-sum-of-squares scale of bf16 staging errors (see tests/gpu_bwd.rs of the Rust crate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

IGNORE = -100


@dataclass
class Ref:
    logprob: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    dh: Optional[torch.Tensor]
    dw: Optional[torch.Tensor]
    # Per element sqrt(Σ_terms²) of dh and dW (the scale of staging rounding errors).
    rss_dh: Optional[torch.Tensor] = None
    rss_dw: Optional[torch.Tensor] = None
    spread: Optional[torch.Tensor] = None
    z_label: Optional[torch.Tensor] = None


def reference(h, w, labels, temperature=1.0, ignore_index=IGNORE, g_lp=None, g_ent=None, v_begin=0, rss=False):
    """f64 log-prob, entropy, lse and (if any upstream gradient is given) dh, dW.

    ``w`` is the full vocabulary unless ``v_begin`` says it is a shard starting there (labels
    are global then and ones outside the shard match no row)."""
    h2 = h.detach().reshape(-1, h.shape[-1]).to(torch.float64)
    w64 = w.detach().to(torch.float64)
    lab = labels.reshape(-1).to(torch.int64)
    h2.requires_grad_(g_lp is not None or g_ent is not None)
    w64.requires_grad_(g_lp is not None or g_ent is not None)
    z = (h2 @ w64.T) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse[:, None]
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    valid = lab != ignore_index
    loc = lab - v_begin
    inside = valid & (loc >= 0) & (loc < w64.shape[0])
    zl = torch.where(inside, z.gather(1, loc.clamp(0, w64.shape[0] - 1)[:, None]).squeeze(1), torch.zeros_like(lse))
    lp = torch.where(valid, zl - lse, torch.zeros_like(lse))
    ent = torch.where(valid, ent, torch.zeros_like(ent))
    mu = lse - ent
    spread = (p * (z - mu[:, None]).abs()).sum(-1).detach()
    out = Ref(lp.detach(), ent.detach(), lse.detach(), None, None, spread=spread, z_label=zl.detach())
    if g_lp is not None or g_ent is not None:
        loss = 0.0
        if g_lp is not None:
            loss = loss + (lp * g_lp.reshape(-1).to(torch.float64)).sum()
        if g_ent is not None:
            loss = loss + (ent * g_ent.reshape(-1).to(torch.float64)).sum()
        dh, dw = torch.autograd.grad(loss, (h2, w64))
        out.dh, out.dw = dh.reshape(h.shape), dw
        if rss:
            dl = dlogits(h, w, labels, temperature, ignore_index, g_lp, g_ent, v_begin, lse.detach(), ent.detach())
            out.rss_dh = ((dl * dl) @ (w64.detach() ** 2)).sqrt().reshape(h.shape)
            out.rss_dw = ((dl * dl).T @ (h2.detach() ** 2)).sqrt()
    return out


def dlogits(h, w, labels, temperature, ignore_index, g_lp, g_ent, v_begin, lse, ent):
    """The explicit f64 d-logits ``(1/T)[g_ℓ(onehot − p) − g_H p (z − μ)]`` (0 on ignored rows)."""
    h2 = h.detach().reshape(-1, h.shape[-1]).to(torch.float64)
    w64 = w.detach().to(torch.float64)
    lab = labels.reshape(-1).to(torch.int64)
    z = (h2 @ w64.T) / temperature
    p = (z - lse[:, None]).exp()
    dl = torch.zeros_like(z)
    if g_lp is not None:
        onehot = torch.zeros_like(z)
        loc = lab - v_begin
        inside = (lab != ignore_index) & (loc >= 0) & (loc < w64.shape[0])
        rows = inside.nonzero().squeeze(1)
        onehot[rows, loc[rows]] = 1.0
        dl += g_lp.reshape(-1, 1).to(torch.float64) * (onehot - p)
    if g_ent is not None:
        mu = lse - ent
        dl -= g_ent.reshape(-1, 1).to(torch.float64) * p * (z - mu[:, None])
    dl /= temperature
    dl[lab == ignore_index] = 0.0
    return dl


def acc_tol(mag: torch.Tensor, d: int) -> torch.Tensor:
    """Tensor-core accumulation tolerance of logits of magnitude ``mag`` (tests/gpu_fwd.rs)."""
    return mag * 2.0**-22 * (d / 16.0 + 4.0)


def check_forward_gpu(lp, ent, ref: Ref, d: int, what: str = "", slack: float = 0.0):
    """GPU forward thresholds of the Rust crate's tests/gpu_fwd.rs, per row:
    log-prob ``1e-4 + mag·2⁻²²·(d/16 + 4)`` with ``mag = max(|lse|, |z_label|)``;
    entropy ``1e-4·max(1, H) + |lse|·2⁻²²·(d/16 + 4)·(1 + spread)``; plus ``slack`` (absolute;
    the fp32 split's logit error). ``d`` is the hidden size the kernels see."""
    lp = lp.reshape(-1).double().cpu()
    r = ref.logprob.cpu()
    mag = torch.maximum(ref.lse.abs(), ref.z_label.abs()).cpu()
    tol = 1e-4 + acc_tol(mag, d) + slack
    err = (lp - r).abs()
    bad = (err > tol) | ~torch.isfinite(lp)
    assert not bool(bad.any()), f"{what} logprob: {int(bad.sum())} rows off, worst {float(err.max()):.3e} (tol {float(tol[err.argmax()]):.3e})"
    if ent is not None:
        e = ent.reshape(-1).double().cpu()
        re = ref.entropy.cpu()
        tol_e = 1e-4 * re.abs().clamp_min(1.0) + (acc_tol(ref.lse.abs().cpu(), d) + slack) * (1.0 + ref.spread.cpu())
        err_e = (e - re).abs()
        bad = (err_e > tol_e) | ~torch.isfinite(e)
        assert not bool(bad.any()), f"{what} entropy: {int(bad.sum())} rows off, worst {float(err_e.max()):.3e}"


def rel_l2(x: torch.Tensor, ref: torch.Tensor, scale: Optional[torch.Tensor] = None) -> float:
    """‖x − ref‖ / max(‖ref‖, ‖scale‖) in float64."""
    x, ref = x.double().reshape(-1).cpu(), ref.double().reshape(-1).cpu()
    den = ref.norm()
    if scale is not None:
        den = torch.maximum(den, scale.double().reshape(-1).cpu().norm())
    num = (x - ref).norm()
    if float(den) == 0.0:
        return float(num)
    return float(num / den)


# Thresholds of the Rust crate's tests/gpu_bwd.rs: bf16 gradients 6e-3, f32 gradients 4e-3 of
# max(‖ref‖, ‖rss‖) (d-logits staged in bf16: relative rounding ≤ 2⁻⁸ per term).
BF16_REL_L2 = 6e-3
F32_REL_L2 = 4e-3


def close(a, b, rtol, atol, what=""):
    a, b = a.double().cpu(), b.double().cpu()
    err = (a - b).abs()
    lim = atol + rtol * b.abs()
    bad = err > lim
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())}/{bad.numel()} elements off, worst abs {float(err.max()):.3e}, "
        f"worst ratio {float((err / lim).max()):.3f}"
    )
