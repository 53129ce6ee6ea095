"""The op and its two faces, both running ``_impl``'s forward and backward:

- eager calls go through an ``autograd.Function`` (a custom op's dispatch costs ~6× more Python
  per call, measured on CPU tensors: 212 µs against 33 µs per forward with autograd);
- calls that ``torch.compile`` traces go through the ``torch.library`` custom ops
  ``lmhead::forward`` and ``lmhead::backward``, with fake implementations on the inputs' symbolic
  sizes (one graph for every token count under ``dynamic=True``) and the backward registered as
  the forward's autograd formula. A custom op takes no Python objects, so the call's settings
  travel as numbers and strings: the process group by name.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _impl
from ._core import _BF16, _bad, _check, _compiling, _label_check, _precision
from ._impl import _Cfg
from ._tp import _TP, _dist, _group_name, _group_of, _make_tp

# ---------------------------------------------------------------------------------------------
# Eager: an autograd.Function
# ---------------------------------------------------------------------------------------------


class _LmHeadFn(torch.autograd.Function):
    """Autograd over ``(h [t, H], W [v, H])``; labels and the config are not differentiable."""

    @staticmethod
    def forward(ctx, h, w, labels, cfg: _Cfg):
        # The kept logits (``keep_logits``) are saved for the backward like any other tensor, and
        # freed with the graph.
        lp, lse, ent, h_b, w_b, kept = _impl._forward_keep(h, w, labels, cfg, True)
        ctx.set_materialize_grads(False)
        ctx.cfg = cfg
        # A copy of the entropy (the backward reads it), so that callers may modify the returned
        # tensors in place.
        ent_s = ent.clone() if ent is not None else None
        ctx.save_for_backward(h, w, labels, lse, ent_s, h_b, w_b, kept)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, labels, lse, ent, h_b, w_b, kept = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and ent is None:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, None, None
        dh, dw = _impl._backward(h, w, h_b, w_b, labels, lse, ent, g_lp, g_ent, need_dw, ctx.cfg, kept)
        return (dh if need_dh else None), dw, None, None


# ---------------------------------------------------------------------------------------------
# Traced: torch.library custom ops
# ---------------------------------------------------------------------------------------------


def _prims(cfg: _Cfg) -> tuple:
    """``cfg`` as the custom ops' trailing arguments."""
    tp = cfg.tp
    group = _group_name(tp.group) if tp is not None else ""
    v_begin, v_total = (tp.v_begin, tp.v_total) if tp is not None else (0, -1)
    return (cfg.temperature, cfg.ignore_index, cfg.entropy, v_begin, v_total, group, cfg.reduce_dh, cfg.oov_zero, cfg.precision,
            cfg.label_check, cfg.fallback, cfg.keep)  # fmt: skip


def _cfg_of(temperature, ignore_index, entropy, v_begin, v_total, group, reduce_dh, oov_zero, precision, label_check, fallback, keep) -> _Cfg:
    tp = None
    if group:
        g = _group_of(group)
        dist = _dist()
        tp = _TP(g, dist.get_rank(g), dist.get_world_size(g), v_begin, v_total)
    return _Cfg(temperature, ignore_index, entropy, tp, reduce_dh, oov_zero, precision, label_check, fallback, keep)


def _kept_len(h: Tensor, w: Tensor, cfg: _Cfg):
    """Elements of the kept logits a forward of ``cfg`` returns (0 where it keeps none; ``t``
    may be symbolic)."""
    if not _impl._keeps(h, w, cfg):
        return 0
    return _impl._keep_rows(h.shape[0], w.shape[0], cfg.keep) * _impl._keep_row_len(w.shape[0])


def _cast(x: Tensor, precision: str, fallback: bool) -> bool:
    """Whether the forward keeps a bf16 rounding of ``x`` for the backward."""
    return precision == "bf16" and not fallback and x.dtype != _BF16


@torch.library.custom_op("lmhead::forward", mutates_args=())
def _op_forward(
    h: Tensor, w: Tensor, labels: Tensor, temperature: float, ignore_index: int, entropy: bool, v_begin: int, v_total: int,
    group: str, reduce_dh: bool, oov_zero: bool, precision: str, label_check: int, fallback: bool, keep: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(logprob [t], entropy [t] or [0], lse [t], a copy of the entropy, h_b, w_b, kept)``: the
    forward of ``_impl`` (``h_b``/``w_b`` the bf16 roundings it keeps for the backward, else
    empty; ``kept`` the kept logits, ``[_kept_len]``)."""
    cfg = _cfg_of(temperature, ignore_index, entropy, v_begin, v_total, group, reduce_dh, oov_zero, precision, label_check, fallback, keep)
    lp, lse, ent, h_b, w_b, kept = _impl._forward_keep(h, w, labels, cfg, True)
    none = h.new_empty(0, dtype=torch.float32)
    if h_b is None:
        h_b = h.to(_BF16) if _cast(h, precision, fallback) else h.new_empty(0, dtype=_BF16)
    if w_b is None:
        w_b = w.to(_BF16) if _cast(w, precision, fallback) else w.new_empty(0, dtype=_BF16)
    if kept is None:
        # t = 0 keeps nothing; the fake's length is then 0 too.
        kept = h.new_empty(_kept_len(h, w, cfg) if h.shape[0] > 0 else 0, dtype=torch.float32)
    return lp, (ent if ent is not None else none), lse, (ent.clone() if ent is not None else none.clone()), h_b, w_b, kept


@_op_forward.register_fake
def _(h, w, labels, temperature, ignore_index, entropy, v_begin, v_total, group, reduce_dh, oov_zero, precision, label_check, fallback, keep):
    t = h.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    n = t if entropy else 0
    h_b = torch.empty_like(h, dtype=_BF16) if _cast(h, precision, fallback) else h.new_empty(0, dtype=_BF16)
    w_b = torch.empty_like(w, dtype=_BF16) if _cast(w, precision, fallback) else w.new_empty(0, dtype=_BF16)
    cfg = _cfg_of(temperature, ignore_index, entropy, v_begin, v_total, "", reduce_dh, oov_zero, precision, label_check, fallback, keep)
    kept = torch.empty(_kept_len(h, w, cfg), **f32)
    return torch.empty(t, **f32), torch.empty(n, **f32), torch.empty(t, **f32), torch.empty(n, **f32), h_b, w_b, kept


@torch.library.custom_op("lmhead::backward", mutates_args=())
def _op_backward(
    h: Tensor, w: Tensor, labels: Tensor, lse: Tensor, ent: Optional[Tensor], g_lp: Optional[Tensor], g_ent: Optional[Tensor],
    h_b: Tensor, w_b: Tensor, kept: Tensor, need_dw: bool, temperature: float, ignore_index: int, entropy: bool, v_begin: int,
    v_total: int, group: str, reduce_dh: bool, oov_zero: bool, precision: str, label_check: int, fallback: bool, keep: int,
) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """``(dh in h's dtype, dW in w's dtype or empty)``: the backward of ``_impl``."""
    cfg = _cfg_of(temperature, ignore_index, entropy, v_begin, v_total, group, reduce_dh, oov_zero, precision, label_check, fallback, keep)
    hb = h_b if h_b.dim() == 2 else None
    wb = w_b if w_b.dim() == 2 else None
    dh, dw = _impl._backward(h, w, hb, wb, labels, lse, ent, g_lp, g_ent, need_dw, cfg, kept)
    return dh, (dw if dw is not None else w.new_empty(0))


@_op_backward.register_fake
def _(h, w, labels, lse, ent, g_lp, g_ent, h_b, w_b, kept, need_dw, *prims):
    return torch.empty_like(h), (torch.empty_like(w) if need_dw else w.new_empty(0))


def _setup_context(ctx, inputs, output):
    h, w, labels = inputs[:3]
    _, _, lse, ent_s, h_b, w_b, kept = output
    ctx.prims = inputs[3:]
    ctx.save_for_backward(h, w, labels, lse, ent_s, h_b, w_b, kept)
    ctx.set_materialize_grads(False)


def _op_autograd(ctx, g_lp, g_ent, *_unused):
    h, w, labels, lse, ent_s, h_b, w_b, kept = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    entropy = ctx.prims[2]
    nones = (None,) * (1 + len(ctx.prims))
    if not entropy:
        g_ent = None
    if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
        return (None, None) + nones
    dh, dw = torch.ops.lmhead.backward(h, w, labels, lse, ent_s if entropy else None, g_lp, g_ent, h_b, w_b, kept, need_dw, *ctx.prims)
    return ((dh if need_dh else None), (dw if need_dw else None)) + nones


torch.library.register_autograd("lmhead::forward", _op_autograd, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------------------------


def _apply(h2: Tensor, w: Tensor, lab: Tensor, cfg: _Cfg) -> Tuple[Tensor, Optional[Tensor]]:
    """``(logprob, entropy or None)`` of 2-D inputs with a prepared config (the drop-ins use it):
    the custom op under torch.compile, else the Function, or the forward alone when nothing
    needs a gradient (without the autograd node's overhead)."""
    grad = torch.is_grad_enabled() and (h2.requires_grad or w.requires_grad)
    if cfg.keep != 0 and not grad:
        # A forward no gradient will follow keeps nothing.
        cfg = dataclasses.replace(cfg, keep=0)
    if _compiling():
        lp, ent, *_ = torch.ops.lmhead.forward(h2, w, lab, *_prims(cfg))
        return lp, (ent if cfg.entropy else None)
    if grad:
        return _LmHeadFn.apply(h2, w, lab, cfg)
    lp, _, ent, _, _ = _impl._forward(h2, w, lab, cfg)
    return lp, ent


def _keep_budget(keep_logits) -> int:
    """``keep_logits`` as ``_Cfg.keep``: -1 every row, a byte budget, or 0."""
    if keep_logits is None or keep_logits is False:
        return 0
    if keep_logits is True:
        return -1
    if isinstance(keep_logits, int) and not isinstance(keep_logits, bool) and keep_logits >= 0:
        return int(keep_logits)
    raise _bad(f"keep_logits must be True, False, None or a byte budget >= 0, got {keep_logits!r}")


def _masked(labels: Tensor, active_mask: Optional[Tensor], ignore_index: int) -> Tensor:
    """``labels`` with the rows ``active_mask`` leaves out set to ``ignore_index`` (on the
    device: nothing waits for it)."""
    if active_mask is None:
        return labels
    if not isinstance(active_mask, torch.Tensor) or active_mask.dtype != torch.bool:
        raise _bad("active_mask must be a bool tensor shaped like labels")
    if tuple(active_mask.shape) != tuple(labels.shape) or active_mask.device != labels.device:
        raise _bad(f"active_mask must have labels' shape {tuple(labels.shape)} and device {labels.device}, got {tuple(active_mask.shape)} on {active_mask.device}")
    return labels.masked_fill(~active_mask, ignore_index)


def fused_linear_logprob(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = True,
    ignore_index: int = -100,
    tp_group=None,
    vocab_start_index: int = 0,
    vocab_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    active_mask: Optional[Tensor] = None,
    precision: Optional[str] = None,
    label_check: Optional[str] = None,
    keep_logits: Union[bool, int, None] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Per token ``log_softmax(hidden · weightᵀ / temperature)[label]`` and (``return_entropy``)
    the entropy of that distribution, fp32 with hidden's leading shape, without the logits;
    differentiable in ``hidden`` and ``weight`` (``dW`` only when ``weight`` requires grad).

    - ``hidden [..., H]``, ``weight [V, H]``: bfloat16 (native), or float32/float16 (computed as
      ``precision`` says: ``"bf16"`` rounds them once per call, ``"split"`` splits them into bf16
      parts; default: :func:`set_precision`'s); contiguous; ``H`` a multiple of 8.
    - ``labels`` (int64/int32, hidden's leading shape): in ``[0, V_total)`` or ``ignore_index``
      (log-prob 0, entropy 0, no gradient). Any other label raises ``ValueError`` (``label_check``
      ``"sync"``, the default), or makes that row NaN and is reported by
      :func:`check_labels_status` (``"deferred"``, and always under CUDA-graph capture).
    - ``active_mask`` (bool, labels' shape): rows it leaves out are treated as ``ignore_index``.
    - ``tp_group``: vocab-parallel over a ``torch.distributed`` group. This rank's ``weight``
      holds rows ``[vocab_start_index, vocab_start_index + V)`` of a vocabulary of
      ``vocab_size`` (default: the SUM of every rank's ``V``, one small all-reduce; give it under
      torch.compile and CUDA-graph capture); labels are global; every rank gets the full
      outputs. ``reduce_hidden_grad``: all-reduce ``d hidden`` over the group (default) or leave
      this rank's partial sum for the caller (Megatron).
    - ``keep_logits``: keep the logits for the backward (``lmhead::keep``): ``True`` every row,
      an ``int`` a budget in bytes (``rows · (2·S + S/8 + 4)``, ``S = ceil32(V)``: all rows when they fit, else whole
      128-row tiles; the rest are recomputed), ``None``/``False``/``0`` (the default) off. The
      backward then runs two GEMMs instead of three; the kept tensor is saved for the backward
      and freed with the graph. Nothing is kept under ``torch.no_grad`` or when no input requires
      grad, nor on CPU tensors, under ``precision="split"`` or the torch fallback.
    - CUDA tensors run the fused kernels on the current stream; CPU tensors the exact float64
      backend (slow; for tests and machines without a GPU; TP needs a gloo group).
    """
    temp = _check(hidden, weight, labels, temperature)
    if tp_group is None and vocab_start_index != 0:
        raise _bad("vocab_start_index needs a tp_group")
    if tp_group is None and vocab_size is not None and int(vocab_size) != weight.shape[0]:
        raise _bad("vocab_size needs a tp_group (without one it is weight.shape[0])")
    labels = _masked(labels, active_mask, int(ignore_index))
    # (2-D hidden, the common case, skips the reshapes and views: each costs microseconds.)
    flat = hidden.dim() == 2
    lead = hidden.shape[:-1]
    h2 = hidden if flat else hidden.reshape(-1, hidden.shape[-1])
    lab = labels if flat else labels.reshape(-1)
    tp = None
    if tp_group is not None:
        tp = _make_tp(tp_group, int(weight.shape[0]), vocab_start_index, vocab_size, hidden.device)
    cfg = _Cfg(temp, int(ignore_index), bool(return_entropy), tp, bool(reduce_hidden_grad), False, _precision(precision), _label_check(label_check),
               keep=_keep_budget(keep_logits))  # fmt: skip
    lp, ent = _apply(h2, weight, lab, cfg)
    if not flat:
        lp = lp.view(lead)
        ent = ent.view(lead) if ent is not None else None
    return lp, ent
