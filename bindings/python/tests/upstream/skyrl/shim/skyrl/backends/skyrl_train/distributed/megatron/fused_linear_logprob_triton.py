"""Shim of ``skyrl/backends/skyrl_train/distributed/megatron/fused_linear_logprob_triton.py`` for
running SkyRL's tests unmodified against ``lmhead_torch`` (see tests/upstream/README.md).

``FusedLinearLogprobTriton`` is ``lmhead_torch``'s drop-in. SkyRL's tests set
``FORCE_FP32_IEEE_PRECISION`` for their fp32 cases, which makes SkyRL's kernel compute fp32
operands in IEEE fp32 instead of TF32; here it selects ``precision="split"`` (fp32-grade logits)
instead of the default, which rounds fp32 operands to bf16. ``efficient_entropy_kernel_general_mainloop``
stands in for the Triton kernel whose tile configs the tests shrink on GPUs with under 128 KiB
of shared memory per block (nothing to shrink here).
"""

import sys
import types

import torch

import lmhead_torch

is_cuda_available = torch.cuda.is_available()
TRITON_AVAILABLE = True
FORCE_FP32_IEEE_PRECISION = False
efficient_entropy_kernel_general_mainloop = types.SimpleNamespace(configs=[])


class FusedLinearLogprobTriton:
    @staticmethod
    def apply(*args, **kwargs):
        if sys.modules[__name__].FORCE_FP32_IEEE_PRECISION:
            kwargs.setdefault("precision", "split")
        return lmhead_torch.FusedLinearLogprob.apply(*args, **kwargs)
