"""The computation of a call on 2-D operands: the native forward and backward (GPU kernels or the
CPU float64 backend), the fp32 precision modes, SkyRL's out-of-vocabulary targets, and the torch
implementation the drop-ins fall back to on a GPU the library does not support.

fp32 / fp16 operands
--------------------
The kernels multiply bf16. ``precision="bf16"`` (the default) rounds an fp32 or fp16 operand to
bf16 once per call (the rounded weight is kept for the backward, as autograd keeps a cast a
caller makes) and runs the fused kernels; the gradients of such an operand are written in f32 by
the kernels and returned in its dtype. ``precision="split"`` splits it into ``x_hi = bf16(x)`` and
``x_lo = bf16(x - x_hi)`` (fp16: exactly; fp32: up to ~2^-17 relative) and forms the logits as
``h_hi·W_hiᵀ + h_hi·W_loᵀ + h_lo·W_hiᵀ`` by concatenating the parts along the hidden dimension:
one fused call with hidden size ``k·H`` (k = 2 or 3), log-probs within ~1e-6 of float64. Its
backward is not fused: the bf16 d-logits of the fused backward (2^-9 relative) are too coarse for
fp32 expectations, so it runs in fp32 torch over vocabulary chunks (``_backward_chunked``;
``t × chunk`` floats at a time, at torch's fp32 matmul precision).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from . import _native
from ._core import _BF16, _call, _capturing, _ensure_device, _on_device, _raw_stream
from ._tp import _TP, _dist

# fp32 backward: vocabulary rows per chunk so that a chunk's logits stay near this many floats.
_CHUNK_FLOATS = 1 << 26


@dataclass
class _Cfg:
    temperature: float
    ignore_index: int
    entropy: bool
    tp: Optional[_TP]
    # Tensor parallel: all-reduce dh (True) or leave this rank's partial sum (Megatron).
    reduce_dh: bool
    # SkyRL: labels outside [0, v_total) give log-prob 0 and d-logits -p (no one-hot); rows
    # labelled ignore_index (inactive rows) give 0 and no gradient.
    oov_zero: bool = False
    precision: str = "bf16"
    # 0 sync, 1 deferred, 2 off (see _core.set_label_check).
    label_check: int = 0
    # The torch implementation (a CUDA device the library does not support).
    fallback: bool = False
    # Kept logits (``keep_logits``): a byte budget, -1 = every row, 0 = off (``_keep_rows``).
    keep: int = 0

    def v_total(self, v: int) -> int:
        return self.tp.v_total if self.tp is not None else v

    def v_begin(self) -> int:
        return self.tp.v_begin if self.tp is not None else 0


def _ptr(x: Optional[torch.Tensor]) -> int:
    return x.data_ptr() if x is not None else 0


def _fwd_bufs(hb, wb, labels, d, lp, lse, ent) -> tuple:
    """The forward's buffer tuple of the native module (``FwdBufs``)."""
    ops = (hb.data_ptr(), wb.data_ptr(), labels.data_ptr(), labels.dtype == torch.int64, hb.shape[0], wb.shape[0], d)
    return ops, (lp.data_ptr(), lse.data_ptr(), _ptr(ent))


def _bwd_bufs(hb, wb, labels, lse, ent, gl, ge, dh, dw) -> tuple:
    """The backward's buffer tuple of the native module (``BwdBufs``)."""
    ops = (hb.data_ptr(), wb.data_ptr(), labels.data_ptr(), labels.dtype == torch.int64, hb.shape[0], wb.shape[0], hb.shape[1])
    outs = (dh.data_ptr(), dh.dtype == torch.float32, _ptr(dw), dw is not None and dw.dtype == torch.float32)
    return ops, (lse.data_ptr(), _ptr(ent), _ptr(gl), _ptr(ge)), outs


def _split(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32/fp16) as ``hi + lo``, both bf16 (exact for fp16; fp32 to ~2^-17 relative)."""
    x32 = x.float()
    hi = x32.to(_BF16)
    lo = (x32 - hi.float()).to(_BF16)
    return hi, lo


def _split_operands(h: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The concatenated parts ``[t, k·H]``, ``[v, k·H]`` of ``precision="split"`` and ``k``."""
    h_split, w_split = h.dtype != _BF16, w.dtype != _BF16
    h_hi, h_lo = _split(h) if h_split else (h, None)
    w_hi, w_lo = _split(w) if w_split else (w, None)
    segs: List[Tuple[str, str]] = [("hi", "hi")]
    if w_split:
        segs.append(("hi", "lo"))
    if h_split:
        segs.append(("lo", "hi"))
    hp, wp = {"hi": h_hi, "lo": h_lo}, {"hi": w_hi, "lo": w_lo}
    hcat = torch.cat([hp[a] for a, _ in segs], dim=1).contiguous()
    wcat = torch.cat([wp[b] for _, b in segs], dim=1).contiguous()
    return hcat, wcat, len(segs)


def _is_split(h: torch.Tensor, w: torch.Tensor, cfg: _Cfg) -> bool:
    return cfg.precision == "split" and (h.dtype != _BF16 or w.dtype != _BF16)


def _oov_to_ignore(labels: torch.Tensor, cfg: _Cfg, v: int) -> torch.Tensor:
    """SkyRL's forward: a target no rank owns gives log-prob 0, as an ignored row does."""
    v_total = cfg.v_total(v)
    oov = (labels < 0) | (labels >= v_total)
    return labels.masked_fill(oov, cfg.ignore_index)


_KEEP_ROW_ALIGN = 128


def _keep_row_len(v: int) -> int:
    """f32 elements one kept row takes over a local vocabulary of ``v``
    (``lmhead::keep::row_bytes`` / 4, from the native library)."""
    return _native.keep_row_bytes(v) // 4


def _keep_rows(t, v: int, budget: int):
    """Rows of a ``t``-token call that a budget of ``budget`` bytes keeps (-1: every row), as
    ``lmhead::keep::rows`` says: all rows when they fit, else whole 128-row tiles. ``t`` may be
    symbolic (torch.compile)."""
    if budget == 0:
        return 0
    if budget < 0:
        return t
    fit = budget // _native.keep_row_bytes(v)
    return t if fit >= t else fit // _KEEP_ROW_ALIGN * _KEEP_ROW_ALIGN


def _keeps(h: torch.Tensor, w: torch.Tensor, cfg: _Cfg) -> bool:
    """Whether a call of ``cfg`` on these operands keeps logits: the mode is on, the native
    kernels run (CUDA, bf16 path; the CPU backend, ``precision="split"`` and the torch fallback
    recompute), and at least one row fits."""
    if cfg.keep == 0 or h.device.type != "cuda" or cfg.fallback or _is_split(h, w, cfg):
        return False
    return True


def _forward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, cfg: _Cfg):
    """``(logprob, lse, entropy or None, h_b, w_b)`` for 2-D ``h``, ``w`` (any float dtype):
    f32 ``[t]`` outputs, and the bf16 roundings of fp32/fp16 operands under ``precision="bf16"``
    (None for bf16 operands and under ``"split"``), which the backward reads. Keeps nothing."""
    return _forward_keep(h, w, labels, cfg, False)[:5]


def _forward_keep(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, cfg: _Cfg, keep: bool):
    """``_forward``'s outputs and the kept logits (``keep`` and ``_keeps``: f32
    ``[rows · _keep_row_len(v)]``, else None; the rows are ``_keep_rows(t, v, cfg.keep)``)."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    lp = torch.empty(t, dtype=torch.float32, device=dev)
    lse = torch.empty(t, dtype=torch.float32, device=dev)
    ent = torch.empty(t, dtype=torch.float32, device=dev) if cfg.entropy else None
    if t == 0:
        return lp, lse, ent, None, None, None
    if cfg.oov_zero:
        labels = _oov_to_ignore(labels, cfg, v)
    if cfg.fallback:
        _forward_torch(h, w, labels, cfg, lp, lse, ent)
        return lp, lse, ent, None, None, None
    h_b = w_b = None
    if _is_split(h, w, cfg):
        hb, wb, k = _split_operands(h, w)
    else:
        hb = h if h.dtype == _BF16 else h.to(_BF16)
        wb = w if w.dtype == _BF16 else w.to(_BF16)
        h_b = hb if hb is not h else None
        w_b = wb if wb is not w else None
        k = 1
    sc = (cfg.temperature, cfg.ignore_index, cfg.v_begin(), cfg.v_total(v))
    kept = None
    if dev.type == "cuda":
        mode = 1 if (cfg.label_check == 0 and _capturing()) else cfg.label_check
        karg = None
        if keep and _keeps(h, w, cfg):
            rows = _keep_rows(t, v, cfg.keep)
            if rows > 0:
                kept = torch.empty(rows * _keep_row_len(v), dtype=torch.float32, device=dev)
                budget = (1 << 64) - 1 if cfg.keep < 0 else cfg.keep
                karg = (kept.data_ptr(), kept.numel(), budget)
        with _on_device(dev, cfg.tp is not None):
            _ensure_device(dev.index)
            comm = cfg.tp.cuda_comm(dev) if cfg.tp is not None else None
            target = (dev.index, _raw_stream(dev))
            _call(_native.gpu_forward, target, _fwd_bufs(hb, wb, labels, k * d, lp, lse, ent), (*sc, mode), comm, karg)
    else:
        lab64 = labels.to(torch.int64).contiguous()
        comm = cfg.tp.host_comm() if cfg.tp is not None else None
        bufs = _fwd_bufs(hb.view(torch.int16), wb.view(torch.int16), lab64, k * d, lp, lse, ent)
        _call(_native.cpu_forward, bufs, (*sc, 0), comm)
    return lp, lse, ent, h_b, w_b, kept


def _backward(h, w, h_b, w_b, labels, lse, ent, g_lp, g_ent, need_dw: bool, cfg: _Cfg, kept=None):
    """``(dh in h.dtype, dW in w.dtype or None)`` for 2-D ``h``, ``w``: the native backward on the
    bf16 operands (``h_b``/``w_b``: the forward's roundings, or None), ``_backward_chunked`` for
    ``precision="split"`` and the torch fallback. ``kept``: the forward's kept logits (or None,
    or empty), whose rows are ``_keep_rows(t, v, cfg.keep)``."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    if t == 0:
        return torch.zeros_like(h), (torch.zeros_like(w) if need_dw else None)
    if cfg.fallback or _is_split(h, w, cfg):
        return _backward_chunked(h, w, labels, lse, ent, g_lp, g_ent, need_dw, cfg)
    hb = h_b if h_b is not None else (h if h.dtype == _BF16 else h.to(_BF16))
    wb = w_b if w_b is not None else (w if w.dtype == _BF16 else w.to(_BF16))
    v_begin, v_total = cfg.v_begin(), cfg.v_total(v)
    labels_b, v_total_b = labels, v_total
    if cfg.oov_zero:
        # A target no rank owns keeps its -p terms but no one-hot: the kernel sees a label that
        # matches no row (v_total, with the vocabulary declared one row larger); inactive rows
        # (ignore_index) stay ignored.
        keep = ((labels >= 0) & (labels < v_total)) | (labels == cfg.ignore_index)
        labels_b = labels.masked_fill(~keep, v_total)
        v_total_b = v_total + 1
    tp = cfg.tp
    native_reduce = tp is not None and cfg.reduce_dh
    cpu = dev.type == "cpu"
    # f32 gradients for f32/f16 operands (and always from the CPU backend), written so by the
    # kernels: no bf16 rounding of a gradient whose operand is not bf16.
    dh = torch.empty((t, d), dtype=torch.float32 if (cpu or h.dtype != _BF16) else _BF16, device=dev)
    dw = torch.empty((v, d), dtype=torch.float32 if (cpu or w.dtype != _BF16) else _BF16, device=dev) if need_dw else None
    gl = g_lp.float().contiguous() if g_lp is not None else None
    ge = g_ent.float().contiguous() if (g_ent is not None and ent is not None) else None
    sc = (cfg.temperature, cfg.ignore_index, v_begin, v_total_b, 0)
    if dev.type == "cuda":
        # 0: single device; 1: TP, dh all-reduced; 2: TP (or a widened vocabulary), partial dh.
        if tp is None:
            reduce = 0 if v_total_b == v else 2
        else:
            reduce = 1 if native_reduce else 2
        with _on_device(dev, tp is not None):
            _ensure_device(dev.index)
            comm = tp.cuda_comm(dev) if tp is not None else None
            bufs = _bwd_bufs(hb, wb, labels_b, lse, ent if ge is not None else None, gl, ge, dh, dw)
            karg = None
            if kept is not None and kept.numel() > 0:
                karg = (kept.data_ptr(), kept.numel(), _keep_rows(t, v, cfg.keep))
            _call(_native.gpu_backward, (dev.index, _raw_stream(dev)), bufs, sc, reduce, comm, karg)
    else:
        lab64 = labels_b.to(torch.int64).contiguous()
        comm = tp.host_comm() if tp is not None else None
        bufs = _bwd_bufs(hb.view(torch.int16), wb.view(torch.int16), lab64, lse, ent if ge is not None else None, gl, ge, dh, dw)
        _call(_native.cpu_backward, bufs, sc, native_reduce, comm)
    return dh.to(h.dtype), (dw.to(w.dtype) if dw is not None else None)


def _backward_chunked(h, w, labels, lse, ent, g_lp, g_ent, need_dw: bool, cfg: _Cfg, chunk: Optional[int] = None):
    """The backward in fp32 torch over vocabulary chunks (``precision="split"``, the fallback;
    any device works, tests run it on CPU tensors). Same maths as the kernels and the reference
    (``crates/lmhead-reference/src/bwd.rs``): with ``z = h·wᵀ/T`` and ``p = e^{z − lse}``,

        dlogits = (1/T)·[g_ℓ (onehot − p) − g_H p (z − (lse − H))],

    rows labelled ``ignore_index`` get 0 (SkyRL's ``oov_zero``: a target no rank owns keeps the
    ``−p`` terms, without a one-hot). ``lse`` and ``ent`` are the forward's (global under TP), so
    under TP ``dh`` is this rank's partial sum until the all-reduce. Nothing waits for the device
    (the one-hot is a scatter), so it may be captured into a CUDA graph."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    inv_t = 1.0 / cfg.temperature
    v_begin = cfg.v_begin()
    lab = labels.to(torch.int64)
    live = lab != cfg.ignore_index
    local = lab - v_begin
    with torch.autocast(dev.type, enabled=False):
        gl = torch.where(live, g_lp.float(), 0.0) if g_lp is not None else None
        ge = torch.where(live, g_ent.float(), 0.0) if (g_ent is not None and ent is not None) else None
        mu = (lse - ent).unsqueeze(1) if ge is not None else None
        lse_col = lse.unsqueeze(1)
        h32 = h.float()
        w32 = w.float()
        dh = torch.zeros((t, d), dtype=torch.float32, device=dev)
        dw = torch.empty((v, d), dtype=torch.float32, device=dev) if need_dw else None
        if chunk is None:
            chunk = max(1, min(v, _CHUNK_FLOATS // max(1, t)))
        for c0 in range(0, v, chunk):
            c1 = min(v, c0 + chunk)
            wc = w32[c0:c1]
            z = torch.mm(h32, wc.t()).mul_(inv_t)
            p = torch.exp(z - lse_col)
            dl = torch.zeros_like(z)
            if ge is not None:
                dl.sub_(p * (z - mu) * ge.unsqueeze(1))
            if gl is not None:
                dl.sub_(p * gl.unsqueeze(1))
                # The one-hot of rows whose label is in this chunk (a target no rank owns has no
                # local column in any chunk).
                in_c = live & (local >= c0) & (local < c1)
                col = (local - c0).clamp(0, c1 - c0 - 1).unsqueeze(1)
                dl.scatter_add_(1, col, torch.where(in_c, gl, 0.0).unsqueeze(1))
            dl.mul_(inv_t)
            dh.addmm_(dl, wc)
            if dw is not None:
                torch.mm(dl.t(), h32, out=dw[c0:c1])
    if cfg.tp is not None and cfg.reduce_dh:
        _dist().all_reduce(dh, op=_dist().ReduceOp.SUM, group=cfg.tp.group)
    return dh.to(h.dtype), (dw.to(w.dtype) if dw is not None else None)


_warned_fallback = False


def _warn_fallback(reason: str) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"lmhead_torch: {reason}; the drop-in falls back to its torch implementation (fp32 math over vocabulary chunks, slower)", stacklevel=3)


def _forward_torch(h, w, labels, cfg: _Cfg, lp, lse, ent) -> None:
    """The forward in fp32 torch over vocabulary chunks (online log-sum-exp, entropy and label
    logit; under TP the row states all-reduced as the kernels' are): the drop-ins' fallback on a
    GPU the library does not support. A label outside ``[0, v_total)`` raises ``InputError``
    (one host read) unless the label check is off or deferred or the stream is capturing; such
    rows are NaN then."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    inv_t = 1.0 / cfg.temperature
    v_begin, v_total = cfg.v_begin(), cfg.v_total(v)
    lab = labels.to(torch.int64)
    live = lab != cfg.ignore_index
    bad = live & ((lab < 0) | (lab >= v_total))
    if cfg.label_check == 0 and not _capturing() and bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        e = _native.InputError(f"lmhead: label {int(lab[row])} of row {row} is outside [0, vocab) and is not ignore_index")
        e.kind, e.row, e.label = "bad_label", row, int(lab[row])
        raise e
    local = lab - v_begin
    with torch.autocast(dev.type, enabled=False):
        h32, w32 = h.float(), w.float()
        m = torch.full((t,), float("-inf"), device=dev)
        s = torch.zeros(t, device=dev)
        sz = torch.zeros(t, device=dev)
        zl = torch.zeros(t, device=dev)
        chunk = max(1, min(v, _CHUNK_FLOATS // max(1, t)))
        for c0 in range(0, v, chunk):
            c1 = min(v, c0 + chunk)
            z = torch.mm(h32, w32[c0:c1].t()).mul_(inv_t)
            m_new = torch.maximum(m, z.amax(1))
            scale = torch.exp(m - m_new)
            ez = torch.exp(z - m_new.unsqueeze(1))
            s = s * scale + ez.sum(1)
            sz = sz * scale + (ez * z).sum(1)
            m = m_new
            in_c = live & (local >= c0) & (local < c1)
            col = (local - c0).clamp(0, c1 - c0 - 1).unsqueeze(1)
            zl = zl + torch.where(in_c, z.gather(1, col).squeeze(1), 0.0)
        if cfg.tp is not None:
            dist = _dist()
            m_g = m.clone()
            dist.all_reduce(m_g, op=dist.ReduceOp.MAX, group=cfg.tp.group)
            scale = torch.exp(m - m_g)
            stats = torch.stack([s * scale, sz * scale, zl])
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=cfg.tp.group)
            s, sz, zl, m = stats[0], stats[1], stats[2], m_g
        lse.copy_(m + torch.log(s))
        lp.copy_(torch.where(live, zl - lse, 0.0).masked_fill(bad, float("nan")))
        if ent is not None:
            ent.copy_(torch.where(live, lse - sz / s, 0.0).masked_fill(bad, float("nan")))
