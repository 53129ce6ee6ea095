"""lmhead_torch: the fused LM head (``lmhead``, Rust) for PyTorch.

Per token ``log_softmax(hidden · weightᵀ / T)[label]``, optionally the entropy, and the
gradients of both in ``hidden`` and ``weight``, without materialising the ``tokens × vocab``
logits. CUDA tensors run the library's kernels zero-copy on PyTorch's current stream; CPU
tensors run its exact float64 backend.

- :func:`fused_linear_logprob` — the op (autograd, tensor parallelism, ``ignore_index``,
  ``active_mask``); traced by ``torch.compile`` as the custom op ``lmhead::forward``, and
  capturable in a CUDA graph.
- :func:`linear_cross_entropy` — drop-in for verl's kernel.
- :class:`FusedLinearLogprob`, :func:`fused_vocab_parallel_entropy_from_hidden` — drop-ins for
  SkyRL's fused LM-head log-prob and entropy.
- :func:`warm_up`, :func:`release_workspace`, :func:`gpu_supported`, :func:`set_label_check`,
  :func:`check_labels_status`, :func:`set_precision`.

Errors: ``ValueError`` (``InputError``) for bad shapes, dtypes, lengths, alignment, options and
labels; ``torch.cuda.OutOfMemoryError`` when device memory runs out; ``UnavailableError`` (a
``RuntimeError``) without a CUDA driver or on a GPU the library does not support — catch it to
fall back (the drop-ins fall back by themselves); ``DeviceError`` / ``CommError``
(``RuntimeError``) for driver, capture and all-reduce failures. See README.md for the
environment variables.
"""

from __future__ import annotations

from typing import Iterable

import torch

from . import _native
from ._core import (
    CommError,
    DeviceError,
    InputError,
    UnavailableError,
    _call,
    _ensure_device,
    check_labels_status,
    device_supported,
    set_label_check,
    set_precision,
)
from ._op import fused_linear_logprob
from .skyrl import FusedLinearLogprob, fused_vocab_parallel_entropy_from_hidden
from .verl import linear_cross_entropy

__version__ = _native.__version__


def gpu_supported(device=None) -> bool:
    """Whether ``device`` (default: the current CUDA device) can run the kernels: the library's
    own answer (a CUDA driver, and a device it supports), which opens the device (cached)."""
    if not torch.cuda.is_available() or not _native.driver_present():
        return False
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return False
    return device_supported(dev.index if dev.index is not None else torch.cuda.current_device())


def warm_up(
    token_counts: Iterable[int],
    vocab: int,
    hidden: int,
    entropy: bool = True,
    backward: bool = True,
    device=None,
) -> None:
    """Tune ahead of time: for each distinct power-of-two token bucket among ``token_counts``,
    run the forward (with or without entropy) and, if ``backward``, the backward once on scratch
    inputs of shape ``[t, hidden]`` x ``[vocab, hidden]`` (bf16; under tensor parallelism pass the
    local vocab rows), so that later calls find their configs in the tuning cache. Nothing of
    the caller's is touched. A no-op for a CPU ``device``. Raises ``UnavailableError`` without a
    usable GPU."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type == "cpu":
        return
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    counts = [int(t) for t in token_counts]
    with torch.cuda.device(dev):
        _ensure_device(dev.index)
        _call(_native.warm_up, dev.index, counts, int(vocab), int(hidden), bool(entropy), bool(backward))


def release_workspace() -> None:
    """Hand back the workspace of every device: the forward's buffers, which the library keeps
    between calls (from PyTorch's allocator by default, so they count in
    ``torch.cuda.memory_allocated``; afterwards ``torch.cuda.empty_cache()`` can return them to
    the driver), or the library's own buffers with ``LMHEAD_TORCH_ALLOCATOR=0``. The backward's
    large buffers are handed back to PyTorch when each backward returns."""
    _native.release_workspace()


def device_info(device=None) -> dict:
    """The library's view of a CUDA device (name, compute capability, SMs, driver, L2, the kernel
    module it loads: ``"hopper"`` or ``"portable"``), opening it."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _ensure_device(dev.index if dev.index is not None else torch.cuda.current_device())
    return _call(_native.device_info, dev.index if dev.index is not None else torch.cuda.current_device())


__all__ = [
    "fused_linear_logprob",
    "linear_cross_entropy",
    "FusedLinearLogprob",
    "fused_vocab_parallel_entropy_from_hidden",
    "set_label_check",
    "check_labels_status",
    "set_precision",
    "warm_up",
    "release_workspace",
    "gpu_supported",
    "device_info",
    "InputError",
    "UnavailableError",
    "DeviceError",
    "CommError",
]
