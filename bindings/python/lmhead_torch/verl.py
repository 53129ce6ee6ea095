"""Drop-in for verl's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``.

Same signature, shapes, dtypes, reductions and tensor-parallel semantics as verl's Triton kernel
(``verl/utils/kernel/linear_cross_entropy.py`` and ``kernels.py``):

- ``hidden [..., H]`` and ``labels [...]`` are flattened to ``N`` tokens; ``weight [V, H]``.
- Returns ``(logprobs, entropy)``, both fp32: ``logprobs`` are log-probabilities (not their
  negation: verl's kernel computes ``-(max + log Σ - z_label)``), ``[N]`` for
  ``reduction="none"``, their sum for ``"sum"`` and their sum divided by ``N`` for ``"mean"``
  (0-dim tensors); ``entropy`` is always per token ``[N]``, never reduced.
- ``dist_process_group``: vocab-parallel as verl: rank ``r`` of the group holds rows
  ``[r·V, (r+1)·V)`` of a vocabulary of ``world·V`` (equal shards), labels are global ids,
  every rank gets the full outputs, ``d weight`` is this rank's rows and ``d hidden`` is this
  rank's partial sum — verl all-reduces it outside the op ("all-reduce on hidden is conducted
  outside the kernel", ``tests/utils/test_special_linear_cross_entropy_tp.py``).
- Gradients: ``d hidden`` in hidden's dtype and shape, ``d weight`` in weight's dtype.
- ``"mean"`` divides the sum by ``N``, every token: verl's kernels divide by ``num_tokens =
  labels.shape[0]`` in the forward (``tl.sum(logprobs) / num_tokens``) and scale the upstream
  gradient by ``1 / num_tokens`` in the backward (``verl/utils/kernel/kernels.py``); verl has no
  ignore index, so there is no "non-ignored" count to divide by.
- The vocabulary is ``world · V`` from the equal shards: no communication per call.

Differences (all supersets): ``H`` need only be a multiple of 8 (verl asserts 128); labels equal
to ``-100`` give log-prob 0, entropy 0 and no gradient (in verl such a label matches no column,
so its "log-prob" is ``-lse`` and it enters the sum and the mean), any other label outside
``[0, world·V)`` raises ``ValueError``; fp32 inputs are computed as ``precision`` says (default
``"bf16"``: rounded to bf16 once per call; see ``lmhead_torch``'s README). On a CUDA device the
library does not support it falls back to the package's torch implementation (same semantics),
with a warning.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._core import _bad, _check, _label_check, _precision
from ._impl import _Cfg
from ._op import _apply
from ._tp import _make_tp
from .skyrl import _fallback


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
    *,
    precision: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(reduction, str) or reduction.lower() not in ("none", "sum", "mean"):
        raise _bad(f"Invalid reduction: {reduction}")
    reduction = reduction.lower()
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise _bad("hidden must be a tensor [..., H]")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1)
    if h2.shape[0] != lab.shape[0]:
        raise _bad(f"{h2.shape[0]} tokens in hidden but {lab.shape[0]} labels")
    temp = _check(h2, weight, lab, temperature)
    tp = None
    group: Optional[object] = dist_process_group
    if group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        v_local = int(weight.shape[0])
        tp = _make_tp(group, v_local, rank * v_local, world * v_local, h2.device)
    cfg = _Cfg(temp, -100, True, tp, False, False, _precision(precision), _label_check(None), _fallback(h2))
    logprobs, entropy = _apply(h2, weight, lab, cfg)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.sum() / lab.shape[0]
    return logprobs, entropy


__all__ = ["linear_cross_entropy"]
