"""Drop-in for SkyRL's fused LM-head log-prob (``FusedLinearChunkedDistributedLogprob`` in
``skyrl/backends/skyrl_train/distributed/megatron/model_utils.py`` and
``FusedLinearLogprobTriton`` in ``fused_linear_logprob_triton.py``): the same ``apply``
signature and contract.

``FusedLinearLogprob.apply(hidden [B, S, H], weight [V_local, H], target [B, S],
vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only=False) -> [B, S]`` fp32:

- ``target`` holds global vocab ids. This rank's ``weight`` holds rows
  ``[vocab_start_index, vocab_end_index)``; ``V_total`` is the SUM of the ranks' ``V_local``.
- A target that no rank owns (outside ``[0, V_total)``, including ``-100``: SkyRL has no ignore
  index) gets log-prob **0** in the forward, and in the backward the d-logits ``-p · g`` of a
  label that matches no column (no one-hot term) — exactly what SkyRL's references do
  (``ChunkedDistributedLogprob.backward`` masks only the one-hot; the Triton adapter says "their
  backward path is left unchanged to match the stock and torch fused references").
- The logits are ``hidden.to(weight.dtype) @ weightᵀ`` as in SkyRL (a bf16 weight rounds an
  fp32 hidden to bf16; an fp32 weight makes the product fp32, computed through the bf16 split).
- ``d hidden`` is this rank's partial sum: not all-reduced inside the op. Megatron's sequence-
  parallel gather (or the caller) reduces it, as in SkyRL (both implementations return the
  local ``grad_logits @ weight``; "d_hidden is this rank's partial; SP gather backward performs
  TP reduction"). ``d weight`` is this rank's rows. Gradients come back in the inputs' dtypes.
- ``chunk_size`` is accepted and checked (>= 1) but not needed: the op never materialises
  logits, whatever the sequence length.
- ``tp_group=None`` (or a group of one) means no tensor parallelism, as in the Triton adapter.
- ``inference_only=True`` saves nothing for backward (the output does not require grad).
- Temperature is not an argument (SkyRL folds it into ``hidden`` before the call).
"""

from __future__ import annotations

import torch

from ._core import _Cfg, _apply_cfg, _bad, _check, _make_tp

# The label the forward sees for a target no rank owns: an ignore index no valid id can equal.
_OOV = -1


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
    ) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise _bad("hidden must be [B, S, H]")
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(hidden.shape[:2]):
            raise _bad(f"target must be [B, S] = {tuple(hidden.shape[:2])}")
        if int(chunk_size) < 1:
            raise _bad(f"chunk_size must be >= 1, got {chunk_size}")
        v_local = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else -1
        if int(vocab_end_index) - int(vocab_start_index) != v_local:
            raise _bad(
                f"vocab_end_index - vocab_start_index = {int(vocab_end_index) - int(vocab_start_index)} "
                f"but weight has {v_local} rows"
            )
        if isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype and (weight.dtype != torch.float32 or hidden.dtype == torch.float64):
            # SkyRL: hidden.to(weight.dtype) (a no-op in value for an fp32 weight, which the split
            # handles with hidden as it is).
            hidden = hidden.to(weight.dtype)
        if target.dtype not in (torch.int64, torch.int32):
            target = target.long()
        # SkyRL slices hidden with any strides (e.g. a transposed [S, B, H] Megatron output).
        hidden, target = hidden.contiguous(), target.contiguous()
        if isinstance(weight, torch.Tensor):
            weight = weight.contiguous()
        _check(hidden, weight, target, 1.0)
        B, S, H = hidden.shape
        tp = None
        if tp_group is not None:
            import torch.distributed as dist

            if dist.get_world_size(tp_group) > 1 or int(vocab_start_index) != 0:
                tp = _make_tp(tp_group, v_local, int(vocab_start_index), None, hidden.device)
        cfg = _Cfg(temperature=1.0, ignore_index=_OOV, entropy=False, tp=tp, reduce_dh=False, oov_zero=True)
        h2 = hidden.reshape(B * S, H)
        lab = target.reshape(B * S)
        if inference_only:
            with torch.no_grad():
                lp, _ = _apply_cfg(h2, weight, lab, cfg)
        else:
            lp, _ = _apply_cfg(h2, weight, lab, cfg)
        return lp.view(B, S)


__all__ = ["FusedLinearLogprob"]
