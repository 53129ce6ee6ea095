"""Drop-ins for SkyRL's fused LM head (``skyrl/backends/skyrl_train/distributed/megatron/``):

- :class:`FusedLinearLogprob` for ``FusedLinearChunkedDistributedLogprob`` (``model_utils.py``)
  and ``FusedLinearLogprobTriton`` (``fused_linear_logprob_triton.py``), with the development
  fork's extended ``apply`` (``active_mask``, ``active_spans``, ``compute_entropy``,
  ``entropy_requires_grad``);
- :func:`fused_vocab_parallel_entropy_from_hidden` for ``_fused_vocab_parallel_entropy_from_hidden``.

``FusedLinearLogprob.apply(hidden [B, S, H], weight [V_local, H], target [B, S],
vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only=False, active_mask=None,
active_spans=None, compute_entropy=False, entropy_requires_grad=False, *, temperature=1.0,
vocab_size=None, precision=None)`` returns the ``[B, S]`` fp32 log-probs, or ``(log-probs,
entropy)`` with ``compute_entropy``:

- ``target`` holds global vocab ids. This rank's ``weight`` holds rows
  ``[vocab_start_index, vocab_end_index)``. ``V_total``: ``vocab_size`` if given, else, when the
  shards are equal (``vocab_start_index == rank · V_local``, SkyRL's and Megatron's layout),
  ``world · V_local`` with no communication; otherwise the SUM of the ranks' rows (one
  all-reduce and a host read per call; not under torch.compile or CUDA-graph capture).
- A target that no rank owns (outside ``[0, V_total)``, including ``-100``: SkyRL has no ignore
  index) gets log-prob **0** in the forward, and in the backward the d-logits ``-p · g`` of a
  label that matches no column (no one-hot term) — exactly what SkyRL's references do.
- ``active_mask`` (``[B, S]``, as the fork's ``triton_block_sparse`` backend takes it): rows it
  leaves out get log-prob 0 and entropy 0 and no gradient (the fork's torch path masks its
  outputs so, which zeroes their gradient). ``active_spans`` is accepted and not needed: the
  library finds the active rows itself.
- ``temperature``: the logits are divided by it inside the kernels (SkyRL divides the weight, a
  ``V × H`` copy per call): pass the weight as it is.
- The logits are ``hidden.to(weight.dtype) @ weightᵀ`` as in SkyRL; an fp32 weight (or hidden)
  is computed as ``precision`` says (default ``"bf16"``: rounded to bf16 once per call, the
  bf16 path's speed; ``"split"``: bf16 hi/lo parts, within ~1e-6 of float64, see the README).
- ``d hidden`` is this rank's partial sum (Megatron's sequence-parallel gather or the caller
  reduces it), ``d weight`` this rank's rows; gradients in the inputs' dtypes.
- ``chunk_size`` is checked (>= 1) but not needed: the op never materialises logits.
- ``tp_group=None`` (or a group of one) means no tensor parallelism.
- ``inference_only=True`` saves nothing for backward; the entropy is differentiable only with
  ``entropy_requires_grad`` (as the fork's).
- Every target is valid by this contract, so no label check runs: a call reads nothing back to
  the host (with equal shards or ``vocab_size``, nothing at all: capturable as it is).
- On a CUDA device the library does not support, both fall back to the package's torch
  implementation (fp32 math over vocabulary chunks, same semantics), with a warning.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._core import _bad, _check, _precision, device_supported, unsupported_reason
from ._impl import _Cfg, _warn_fallback
from ._op import _apply
from ._tp import _make_tp

# The ignore label of the rows `active_mask` leaves out: no target can equal it, so a target no
# rank owns (log-prob 0, d-logits -p) stays apart from an inactive row (no gradient).
_INACTIVE = torch.iinfo(torch.int64).min


def _fallback(x: torch.Tensor) -> bool:
    if x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if not device_supported(index):
            _warn_fallback(unsupported_reason(index))
            return True
    return False


def _tp_of(tp_group, v_local: int, vocab_start_index: int, vocab_size: Optional[int], device):
    """The shard of a SkyRL call: none without a group (or a group of one at offset 0); else
    ``V_total`` from ``vocab_size``, from equal shards, or (unequal) the all-reduce."""
    if tp_group is None:
        return None
    import torch.distributed as dist

    world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if world == 1 and int(vocab_start_index) == 0 and vocab_size is None:
        return None
    if vocab_size is None and int(vocab_start_index) == rank * v_local:
        vocab_size = world * v_local
    return _make_tp(tp_group, v_local, int(vocab_start_index), vocab_size, device)


def _hidden_for(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SkyRL's ``hidden.to(weight.dtype)``: a bf16 weight rounds an fp32 hidden to bf16; for an
    fp32 weight the cast changes no value, so hidden stays as it is."""
    if isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype and (weight.dtype != torch.float32 or hidden.dtype == torch.float64):
        hidden = hidden.to(weight.dtype)
    return hidden


class FusedLinearLogprob:
    """``FusedLinearLogprob.apply(...)``: see the module docs."""

    @staticmethod
    def apply(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group,
        inference_only: bool = False,
        active_mask: Optional[torch.Tensor] = None,
        active_spans=None,
        compute_entropy: bool = False,
        entropy_requires_grad: bool = False,
        *,
        temperature: float = 1.0,
        vocab_size: Optional[int] = None,
        precision: Optional[str] = None,
    ):
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise _bad("hidden must be [B, S, H]")
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(hidden.shape[:2]):
            raise _bad(f"target must be [B, S] = {tuple(hidden.shape[:2])}")
        if int(chunk_size) < 1:
            raise _bad(f"chunk_size must be >= 1, got {chunk_size}")
        if entropy_requires_grad and not compute_entropy:
            raise _bad("entropy_requires_grad=True requires compute_entropy=True")
        if entropy_requires_grad and inference_only:
            raise _bad("entropy gradients are unavailable with inference_only=True")
        if active_spans is not None and not isinstance(active_spans, (tuple, list)):
            raise _bad("active_spans must be a sequence of (start, end) pairs or None")
        v_local = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else -1
        if int(vocab_end_index) - int(vocab_start_index) != v_local:
            raise _bad(
                f"vocab_end_index - vocab_start_index = {int(vocab_end_index) - int(vocab_start_index)} "
                f"but weight has {v_local} rows"
            )
        hidden = _hidden_for(hidden, weight)
        # int64 targets: the inactive rows' label is below any int32.
        target = target.long()
        # SkyRL slices hidden with any strides (e.g. a transposed [S, B, H] Megatron output).
        hidden, target = hidden.contiguous(), target.contiguous()
        if isinstance(weight, torch.Tensor):
            weight = weight.contiguous()
        temp = _check(hidden, weight, target, temperature)
        if active_mask is not None:
            active_mask = active_mask.to(device=target.device, dtype=torch.bool)
            if tuple(active_mask.shape) != tuple(target.shape):
                raise _bad(f"active_mask must be [B, S] = {tuple(target.shape)}, got {tuple(active_mask.shape)}")
            target = target.masked_fill(~active_mask, _INACTIVE)
        B, S, H = hidden.shape
        tp = _tp_of(tp_group, v_local, vocab_start_index, vocab_size, hidden.device)
        # Every target is valid here (those no rank owns become ignored rows in the forward), so
        # the label check is off: no host read per call.
        cfg = _Cfg(temp, _INACTIVE, bool(compute_entropy), tp, False, True, _precision(precision), 2, _fallback(hidden))
        h2 = hidden.reshape(B * S, H)
        lab = target.reshape(B * S)
        if inference_only:
            with torch.no_grad():
                lp, ent = _apply(h2, weight, lab, cfg)
        else:
            lp, ent = _apply(h2, weight, lab, cfg)
        lp = lp.view(B, S)
        if not compute_entropy:
            return lp
        ent = ent.view(B, S)
        return lp, (ent if entropy_requires_grad else ent.detach())


def fused_vocab_parallel_entropy_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tp_group,
    chunk_size: Optional[int] = None,
    temperature: float = 1.0,
    *,
    precision: Optional[str] = None,
) -> torch.Tensor:
    """Drop-in for SkyRL's ``_fused_vocab_parallel_entropy_from_hidden``: the per-token entropy
    ``[B, S]`` (fp32) of ``softmax(hidden · Wᵀ / temperature)`` over the full vocabulary, from
    ``hidden [B, S, H]`` and this rank's equal shard ``lm_head_weight [V // TP, H]`` (rank ``r``
    holds rows ``[r·V/TP, (r+1)·V/TP)``), without the logits; the temperature goes to the kernels
    (no divided weight). ``chunk_size`` is accepted and not needed. SkyRL calls it for the no-grad
    entropy metric; under grad mode the result is differentiable (``d hidden`` this rank's
    partial sum, as the log-prob op's)."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise _bad("hidden must be [B, S, H]")
    if chunk_size is not None and int(chunk_size) < 1:
        raise _bad(f"chunk_size must be >= 1, got {chunk_size}")
    weight = lm_head_weight
    hidden = _hidden_for(hidden, weight).contiguous()
    B, S, H = hidden.shape
    # Any valid label: its log-prob is not used (global id 0 is inside every vocabulary).
    labels = torch.zeros((B, S), dtype=torch.int64, device=hidden.device)
    temp = _check(hidden, weight, labels, temperature)
    v_local = int(weight.shape[0])
    tp = None
    if tp_group is not None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if world > 1:
            tp = _make_tp(tp_group, v_local, rank * v_local, world * v_local, hidden.device)
    # (Labels 0: always valid, so no label check.)
    cfg = _Cfg(temp, -100, True, tp, False, False, _precision(precision), 2, _fallback(hidden))
    _, ent = _apply(hidden.reshape(B * S, H), weight, labels.reshape(B * S), cfg)
    return ent.view(B, S)


__all__ = ["FusedLinearLogprob", "fused_vocab_parallel_entropy_from_hidden"]
