"""What every path of the package shares: the native module's errors, the devices and the
workspace through PyTorch's caching allocator, the current stream, the package's settings (label
check, fp32 precision), the deferred label status, and the checks of a call's arguments.

Everything that touches memory is the native module's (``_native``), which takes only integers.
The package guarantees its contract: every address passed is ``data_ptr()`` of a contiguous
tensor of the stated dtype and size, on the device of the call (or the host for the CPU
backend), referenced until the native call returns. On the GPU the call is queued on PyTorch's
current stream, so PyTorch's usual stream semantics keep the memory valid for the queued work.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Callable, Optional

import torch

from . import _native

_BF16 = torch.bfloat16
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_LABEL_DTYPES = (torch.int64, torch.int32)

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

InputError = _native.InputError
UnavailableError = _native.UnavailableError
DeviceError = _native.DeviceError
CommError = _native.CommError


def _call(fn: Callable, *args):
    """Call into the native module, turning its out-of-memory error into PyTorch's."""
    try:
        return fn(*args)
    except _native.DeviceMemoryError as e:
        oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
        raise oom(str(e)) from e


def _bad(msg: str) -> ValueError:
    return ValueError(f"lmhead_torch: {msg}")


def _compiling() -> bool:
    """Whether dynamo is tracing the call (the custom-op path, see ``_op.py``)."""
    return torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

# Label check modes, as the native module numbers them.
LABEL_CHECKS = {"sync": 0, "deferred": 1, "off": 2}
PRECISIONS = ("bf16", "split")
_settings = {"label_check": "sync", "precision": "bf16"}


def set_label_check(mode: str) -> None:
    """How CUDA calls check their labels (default ``"sync"``): ``"sync"`` raises ``InputError``
    before anything runs (one small host read per forward); ``"deferred"`` never waits for the
    device: rows with a bad label come out NaN and :func:`check_labels_status` raises the error
    later; ``"off"``: NaN rows, nothing recorded. A call under CUDA-graph capture always runs
    ``"sync"`` as ``"deferred"``. CPU tensors always check synchronously."""
    if mode not in LABEL_CHECKS:
        raise _bad(f"label_check must be one of {sorted(LABEL_CHECKS)}, got {mode!r}")
    _settings["label_check"] = mode


def set_precision(mode: str) -> None:
    """How fp32 and fp16 operands are computed (default ``"bf16"``; see README, *fp32 inputs*):
    ``"bf16"`` rounds each to bf16 once per call and runs the fused kernels (the speed of bf16
    operands); ``"split"`` splits each into bf16 ``hi + lo`` parts (log-probs within ~1e-6 of
    float64) with an unfused fp32 backward (2–3× the forward's work, a slower backward)."""
    if mode not in PRECISIONS:
        raise _bad(f"precision must be one of {PRECISIONS}, got {mode!r}")
    _settings["precision"] = mode


def _label_check(mode: Optional[str]) -> int:
    mode = _settings["label_check"] if mode is None else mode
    if mode not in LABEL_CHECKS:
        raise _bad(f"label_check must be one of {sorted(LABEL_CHECKS)}, got {mode!r}")
    return LABEL_CHECKS[mode]


def _precision(mode: Optional[str]) -> str:
    mode = _settings["precision"] if mode is None else mode
    if mode not in PRECISIONS:
        raise _bad(f"precision must be one of {PRECISIONS}, got {mode!r}")
    return mode


# ---------------------------------------------------------------------------------------------
# Devices and the workspace through PyTorch's allocator
# ---------------------------------------------------------------------------------------------


class _TorchScratch:
    """The library's workspace allocator: ``torch.empty(nbytes, uint8)`` on the stream the library
    names (the call's stream), held until the library hands it back with ``free(address)``. The
    library keeps the forward's small buffers across calls and hands back the backward's large
    ones when each call returns (``release_workspace()`` hands back everything); a call under
    CUDA-graph capture asks for all of its buffers fresh, which PyTorch then takes from the
    graph's private pool. PyTorch's caching allocator makes this cheap and stream-ordered, and its
    accounting (``memory_allocated``, ``empty_cache``) sees the workspace."""

    def __init__(self, device: torch.device):
        self.device = device
        self._held: dict = {}
        self._lock = threading.Lock()

    def __call__(self, nbytes: int, stream: int) -> int:
        if stream == _raw_stream(self.device):
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            s = torch.cuda.default_stream(self.device) if stream == 0 else torch.cuda.ExternalStream(stream, device=self.device)
            with torch.cuda.stream(s):
                t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        ptr = t.data_ptr()
        with self._lock:
            self._held[ptr] = t
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            self._held.pop(ptr, None)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() for t in self._held.values())


_devices: dict = {}
_devices_lock = threading.Lock()
_supported: dict = {}


def _torch_allocator_enabled() -> bool:
    return os.environ.get("LMHEAD_TORCH_ALLOCATOR", "1") != "0"


def _ensure_device(index: int) -> Optional[_TorchScratch]:
    """Open device ``index`` in the library (once) and route its workspace through PyTorch."""
    try:
        return _devices[index]
    except KeyError:
        pass
    with _devices_lock:
        if index in _devices:
            return _devices[index]
        _call(_native.device_info, index)  # opens it: UnavailableError without driver / support
        scratch = _TorchScratch(torch.device("cuda", index)) if _torch_allocator_enabled() else None
        _native.set_scratch(index, scratch)
        _devices[index] = scratch
        return scratch


def device_supported(index: int) -> bool:
    """The library's own answer for CUDA device ``index`` (cached): it opens the device."""
    try:
        return _supported[index][0]
    except KeyError:
        pass
    if not torch.cuda.is_available() or not _native.driver_present():
        ok = (False, "no CUDA driver or device")
    else:
        ok = _call(_native.device_supported, index)
    _supported[index] = ok
    return ok[0]


def unsupported_reason(index: int) -> str:
    device_supported(index)
    return _supported[index][1]


_NO_CONTEXT = contextlib.nullcontext()


def _on_device(dev: torch.device, always: bool):
    """``torch.cuda.device(dev)`` when it changes something (another device is current) or
    ``always`` (tensor parallel: the collectives run on the current device); else no context
    manager at all (it costs a few microseconds per call)."""
    if always or dev.index != torch.cuda.current_device():
        return torch.cuda.device(dev)
    return _NO_CONTEXT


_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(dev: torch.device) -> int:
    """The handle of PyTorch's current stream on ``dev`` (without building a Stream object
    where this PyTorch has the direct accessor)."""
    if _get_raw_stream is not None:
        return _get_raw_stream(dev.index)
    return torch.cuda.current_stream(dev).cuda_stream


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never for CPU-only PyTorch)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_labels_status(device=None) -> None:
    """Raise what the deferred label checks on ``device`` (default: the current CUDA device)
    found since the last call, and clear it: ``InputError`` with ``kind == "bad_label"`` and
    ``row`` the lowest bad row (``label`` is None: the labels may have changed since). Returns
    None when every label was good. Ordered after the work queued on the current stream, which
    it waits for; synchronise other streams first. Not under CUDA-graph capture (raises
    ``DeviceError``): call it after a replay."""
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _devices:
        return  # no call ran on it
    with _on_device(torch.device("cuda", index), False):
        _call(_native.label_status, (index, _raw_stream(torch.device("cuda", index))))


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _check(hidden, weight, labels, temperature) -> float:
    for name, x in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(x, torch.Tensor):
            raise _bad(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if hidden.dim() < 1:
        raise _bad("hidden must be [..., H]")
    if weight.dim() != 2:
        raise _bad(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise _bad(f"hidden size mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise _bad(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims), got {tuple(labels.shape)}")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if x.dtype not in _FLOATS:
            raise _bad(f"{name} has dtype {x.dtype}; use bfloat16 (native), float32 or float16 (e.g. {name}.to(torch.bfloat16))")
    if labels.dtype not in _LABEL_DTYPES:
        raise _bad(f"labels have dtype {labels.dtype}; use int64 or int32 (labels.long())")
    if not (hidden.device == weight.device == labels.device):
        raise _bad(f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) must be on one device")
    if hidden.device.type not in ("cuda", "cpu"):
        raise _bad(f"device {hidden.device} is not supported (cuda or cpu)")
    for name, x in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not x.is_contiguous():
            raise _bad(f"{name} must be contiguous ({name}.contiguous())")
    h = hidden.shape[-1]
    if h <= 0 or h % 8 != 0:
        raise _bad(f"the hidden size must be a positive multiple of 8 (rows of 16 bytes), got {h}")
    if weight.shape[0] == 0:
        raise _bad("weight has no vocabulary rows")
    # (Under torch.compile the tensors have no addresses yet; the library checks them then.)
    if hidden.device.type == "cuda" and not _compiling():
        for name, x in (("hidden", hidden), ("weight", weight)):
            if x.dtype == _BF16 and x.data_ptr() % 16 != 0:
                raise _bad(f"{name} is not 16-byte aligned (a view at an odd offset; {name}.clone() fixes it)")
    try:
        temp = float(temperature)
    except (TypeError, ValueError):
        raise _bad(f"temperature must be a number, got {temperature!r}") from None
    # (Comparisons, not math.isfinite: under torch.compile a temperature may be a symbolic float,
    # which compares but has no isfinite; NaN fails the first comparison.)
    if not (temp > 0.0 and temp < math.inf):
        raise _bad(f"temperature must be finite and > 0, got {temperature}")
    return temp
