"""The fused LM head as a ``torch.autograd.Function``: checks, output allocation, the CPU and GPU
paths, tensor parallelism over ``torch.distributed``, and the fp32 operand splits.

Everything that touches memory is the native module's (``_native``), which takes only integers.
This module guarantees its contract: every address passed is ``data_ptr()`` of a contiguous
tensor of the stated dtype and size, on the device of the call (or the host for the CPU
backend), referenced here until the native call returns. On the GPU the call is queued on
PyTorch's current stream, so PyTorch's usual stream semantics keep the memory valid for the
queued work.

fp32 / fp16 operands
--------------------
The kernels multiply bf16. The forward splits an fp32 (or fp16) operand ``x`` into
``x_hi = bf16(x)`` and ``x_lo = bf16(x - x_hi)`` (fp16: exactly; fp32: up to ~2^-17 relative)
and forms the logits as ``h_hi·W_hiᵀ + h_hi·W_loᵀ + h_lo·W_hiᵀ`` (the products that involve a
split operand only) by concatenating the parts along the hidden dimension: one fused call with
hidden size ``k·H`` (k = 2 or 3), log-probs within ~1e-6 of float64.

The fused backward stages its d-logits in bf16 (2^-9 relative per element), which is right for
bf16 training and too coarse for fp32 expectations (SkyRL's and verl's fp32 tests hold
gradients to 1e-4), and the split itself (2^-17) is too coarse for the one-hot term of ``dW``.
So the backward of fp32/fp16 operands is *not fused*: it runs in fp32 torch over vocabulary
chunks (``_backward_chunked``; memory ``t × chunk`` floats, the matmuls at torch's fp32 matmul
precision, so TF32 only if the caller enabled it), on the GPU and on CPU tensors alike, using
the forward's log-sum-exp and entropy. fp32 is an accuracy mode; bf16 is the fast path (and on
CPU tensors bf16 runs the float64 backend both ways).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import _native

_BF16 = torch.bfloat16
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_LABEL_DTYPES = (torch.int64, torch.int32)
# fp32 backward on the GPU: vocabulary rows per chunk so that a chunk's logits stay near this
# many floats.
_CHUNK_FLOATS = 1 << 26


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


# ---------------------------------------------------------------------------------------------
# Devices and the workspace through PyTorch's allocator
# ---------------------------------------------------------------------------------------------


class _TorchScratch:
    """The library's workspace allocator: ``torch.empty(nbytes, uint8)`` on the stream the library
    names (the call's stream), held until the library hands it back with ``free(address)``. The
    library keeps the forward's small buffers across calls and hands back the backward's large
    ones when each call returns (``release_workspace()`` hands back everything). PyTorch's
    caching allocator makes this cheap and stream-ordered, and its accounting
    (``memory_allocated``, ``empty_cache``) sees the workspace."""

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
        _call(_native.device_info, index)  # opens it: UnavailableError without driver / sm_90
        scratch = _TorchScratch(torch.device("cuda", index)) if _torch_allocator_enabled() else None
        _native.set_scratch(index, scratch)
        _devices[index] = scratch
        return scratch


# ---------------------------------------------------------------------------------------------
# Tensor parallelism over torch.distributed
# ---------------------------------------------------------------------------------------------


class _CudaView:
    """``len`` f32 at device address ``ptr``, exposed through ``__cuda_array_interface__`` so that
    ``torch.as_tensor`` wraps it without a copy."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<f4",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # the caller's stream is the current stream: no synchronisation
        }


def _dist():
    import torch.distributed as dist

    return dist


def _reduce_op(op: int):
    dist = _dist()
    return dist.ReduceOp.MAX if op == 0 else dist.ReduceOp.SUM


@dataclass
class _TP:
    group: object
    rank: int
    size: int
    v_begin: int
    v_total: int

    def cuda_comm(self, device: torch.device):
        group = self.group

        def all_reduce(ptr: int, n: int, op: int, stream: int) -> None:
            view = torch.as_tensor(_CudaView(ptr, n), device=device)
            if view.data_ptr() != ptr:  # never a silent copy
                raise RuntimeError("lmhead_torch: torch.as_tensor copied the all-reduce buffer")
            cur = torch.cuda.current_stream(device)
            if stream == cur.cuda_stream:
                _dist().all_reduce(view, op=_reduce_op(op), group=group)
            else:
                s = torch.cuda.default_stream(device) if stream == 0 else torch.cuda.ExternalStream(stream, device=device)
                with torch.cuda.stream(s):
                    _dist().all_reduce(view, op=_reduce_op(op), group=group)

        return (self.rank, self.size, all_reduce)

    def host_comm(self):
        group = self.group

        def all_reduce(ptr: int, n: int, op: int) -> None:
            buf = (ctypes.c_double * n).from_address(ptr)
            view = torch.frombuffer(buf, dtype=torch.float64)
            _dist().all_reduce(view, op=_reduce_op(op), group=group)

        return (self.rank, self.size, all_reduce)


def _make_tp(group, v_local: int, vocab_start_index: int, vocab_size: Optional[int], device: torch.device) -> _TP:
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise _bad("tp_group given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if vocab_size is None:
        n = torch.tensor([v_local], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
        vocab_size = int(n.item())
    vocab_start_index, vocab_size = int(vocab_start_index), int(vocab_size)
    if vocab_start_index < 0 or vocab_start_index + v_local > vocab_size:
        raise _bad(
            f"this rank's vocab rows [{vocab_start_index}, {vocab_start_index + v_local}) are not inside "
            f"the vocabulary of {vocab_size}"
        )
    return _TP(group, rank, size, vocab_start_index, vocab_size)


# ---------------------------------------------------------------------------------------------
# Operands
# ---------------------------------------------------------------------------------------------


def _split(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32/fp16) as ``hi + lo``, both bf16 (exact for fp16; fp32 to ~2^-17 relative)."""
    x32 = x.float()
    hi = x32.to(_BF16)
    lo = (x32 - hi.float()).to(_BF16)
    return hi, lo


# A part pair (hidden part, weight part): "hi" or "lo".
Segments = List[Tuple[str, str]]


def _operands(h: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[Segments]]:
    """The bf16 operands of a call: ``(h, w, None)`` when both are bf16, else the concatenated
    parts ``[t, k·H]``, ``[v, k·H]`` and the part pairs (see the module docs)."""
    h_split, w_split = h.dtype != _BF16, w.dtype != _BF16
    if not h_split and not w_split:
        return h, w, None
    h_hi, h_lo = _split(h) if h_split else (h, None)
    w_hi, w_lo = _split(w) if w_split else (w, None)
    segs: Segments = [("hi", "hi")]
    if w_split:
        segs.append(("hi", "lo"))
    if h_split:
        segs.append(("lo", "hi"))
    hp = {"hi": h_hi, "lo": h_lo}
    wp = {"hi": w_hi, "lo": w_lo}
    hcat = torch.cat([hp[a] for a, _ in segs], dim=1).contiguous()
    wcat = torch.cat([wp[b] for _, b in segs], dim=1).contiguous()
    return hcat, wcat, segs


# ---------------------------------------------------------------------------------------------
# The call configuration
# ---------------------------------------------------------------------------------------------


@dataclass
class _Cfg:
    temperature: float
    ignore_index: int
    entropy: bool
    tp: Optional[_TP]
    # Tensor parallel: all-reduce dh (True) or leave this rank's partial sum (Megatron).
    reduce_dh: bool
    # SkyRL: labels outside [0, v_total) give log-prob 0 and d-logits -p (no one-hot).
    oov_zero: bool = False


def _v_total(cfg: _Cfg, v: int) -> int:
    return cfg.tp.v_total if cfg.tp is not None else v


def _v_begin(cfg: _Cfg) -> int:
    return cfg.tp.v_begin if cfg.tp is not None else 0


# ---------------------------------------------------------------------------------------------
# Forward / backward on the native backends
# ---------------------------------------------------------------------------------------------


def _ptr(x: Optional[torch.Tensor]) -> int:
    return x.data_ptr() if x is not None else 0


def _gpu_forward_args(index, stream, hb, wb, labels, d, lp, lse, ent, tail, comm) -> tuple:
    """The argument list of ``_native.gpu_forward`` (kept in one place: tests/test_cpu.py checks it
    against the native signature without a GPU)."""
    t, v = hb.shape[0], wb.shape[0]
    return (index, stream, hb.data_ptr(), wb.data_ptr(), labels.data_ptr(), labels.dtype == torch.int64, t, v, d,
            lp.data_ptr(), lse.data_ptr(), _ptr(ent), *tail, comm)  # fmt: skip


def _gpu_backward_args(index, stream, hb, wb, labels, d, lse, ent, gl, ge, dh, dw, f32, tail, reduce, comm) -> tuple:
    """The argument list of ``_native.gpu_backward`` (checked like ``_gpu_forward_args``)."""
    t, v = hb.shape[0], wb.shape[0]
    return (index, stream, hb.data_ptr(), wb.data_ptr(), labels.data_ptr(), labels.dtype == torch.int64, t, v, d,
            lse.data_ptr(), _ptr(ent), _ptr(gl), _ptr(ge), dh.data_ptr(), f32, _ptr(dw), f32, *tail, reduce, comm)  # fmt: skip


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


def _forward(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, cfg: _Cfg):
    """``(logprob, lse, entropy or None)``, f32 ``[t]``, for 2-D ``h`` and ``w`` (any float dtype)."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    lp = torch.empty(t, dtype=torch.float32, device=dev)
    lse = torch.empty(t, dtype=torch.float32, device=dev)
    ent = torch.empty(t, dtype=torch.float32, device=dev) if cfg.entropy else None
    if t == 0:
        return lp, lse, ent
    hb, wb, segs = _operands(h, w)
    k = 1 if segs is None else len(segs)
    if cfg.oov_zero:
        v_total = _v_total(cfg, v)
        labels = torch.where((labels < 0) | (labels >= v_total), torch.full_like(labels, cfg.ignore_index), labels)
    args_tail = (cfg.temperature, cfg.ignore_index, _v_begin(cfg), _v_total(cfg, v))
    if dev.type == "cuda":
        with _on_device(dev, cfg.tp is not None):
            _ensure_device(dev.index)
            stream = _raw_stream(dev)
            comm = cfg.tp.cuda_comm(dev) if cfg.tp is not None else None
            _call(_native.gpu_forward, *_gpu_forward_args(dev.index, stream, hb, wb, labels, k * d, lp, lse, ent, args_tail, comm))
    else:
        lab64 = labels.to(torch.int64).contiguous()
        comm = cfg.tp.host_comm() if cfg.tp is not None else None
        _call(
            _native.cpu_forward,
            hb.view(torch.int16).data_ptr(),
            wb.view(torch.int16).data_ptr(),
            lab64.data_ptr(),
            t,
            v,
            k * d,
            lp.data_ptr(),
            lse.data_ptr(),
            ent.data_ptr() if ent is not None else 0,
            *args_tail,
            comm,
        )
    return lp, lse, ent


def _backward(h, w, labels, lse, ent, g_lp, g_ent, need_dw: bool, cfg: _Cfg):
    """``(dh in h.dtype, dW in w.dtype or None)`` for 2-D ``h``, ``w``: the native backward for
    bf16 operands, ``_backward_chunked`` for fp32/fp16 ones."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    if t == 0:
        return torch.zeros_like(h), (torch.zeros_like(w) if need_dw else None)
    if h.dtype != _BF16 or w.dtype != _BF16:
        return _backward_chunked(h, w, labels, lse, ent, g_lp, g_ent, need_dw, cfg)
    v_begin, v_total = _v_begin(cfg), _v_total(cfg, v)
    labels_b, v_total_b = labels, v_total
    if cfg.oov_zero:
        # A target no rank owns keeps its -p terms but no one-hot: the kernel sees a label that
        # matches no row (v_total, with the vocabulary declared one row larger).
        valid = (labels >= 0) & (labels < v_total)
        labels_b = torch.where(valid, labels, torch.full_like(labels, v_total))
        v_total_b = v_total + 1
    tp = cfg.tp
    native_reduce = tp is not None and cfg.reduce_dh
    f32_grads = dev.type == "cpu"
    dh = torch.empty((t, d), dtype=torch.float32 if f32_grads else _BF16, device=dev)
    dw = torch.empty((v, d), dtype=torch.float32 if f32_grads else _BF16, device=dev) if need_dw else None
    gl = g_lp.float().contiguous() if g_lp is not None else None
    ge = g_ent.float().contiguous() if (g_ent is not None and ent is not None) else None
    opt = _ptr
    if dev.type == "cuda":
        # 0: single device; 1: TP, dh all-reduced; 2: TP (or a widened vocabulary), partial dh.
        if tp is None:
            reduce = 0 if v_total_b == v else 2
        else:
            reduce = 1 if native_reduce else 2
        with _on_device(dev, tp is not None):
            _ensure_device(dev.index)
            stream = _raw_stream(dev)
            comm = tp.cuda_comm(dev) if tp is not None else None
            args = _gpu_backward_args(
                dev.index, stream, h, w, labels_b, d, lse, ent if ge is not None else None, gl, ge, dh, dw, f32_grads,
                (cfg.temperature, cfg.ignore_index, v_begin, v_total_b), reduce, comm,
            )  # fmt: skip
            _call(_native.gpu_backward, *args)
    else:
        lab64 = labels_b.to(torch.int64).contiguous()
        comm = tp.host_comm() if tp is not None else None
        _call(
            _native.cpu_backward,
            h.view(torch.int16).data_ptr(),
            w.view(torch.int16).data_ptr(),
            lab64.data_ptr(),
            t,
            v,
            d,
            lse.data_ptr(),
            opt(ent if ge is not None else None),
            opt(gl),
            opt(ge),
            dh.data_ptr(),
            opt(dw),
            cfg.temperature,
            cfg.ignore_index,
            v_begin,
            v_total_b,
            native_reduce,
            comm,
        )
    return dh.to(h.dtype), (dw.to(w.dtype) if dw is not None else None)


def _backward_chunked(h, w, labels, lse, ent, g_lp, g_ent, need_dw: bool, cfg: _Cfg, chunk: Optional[int] = None):
    """The backward in fp32 torch over vocabulary chunks (fp32/fp16 operands on the GPU; any
    device works, tests run it on CPU tensors). Same maths as the kernels and the reference
    (``crates/lmhead-reference/src/bwd.rs``): with ``z = h·wᵀ/T`` and ``p = e^{z − lse}``,

        dlogits = (1/T)·[g_ℓ (onehot − p) − g_H p (z − (lse − H))],

    rows labelled ``ignore_index`` get 0 (SkyRL's ``oov_zero``: a target no rank owns keeps the
    ``−p`` terms, without a one-hot). ``lse`` and ``ent`` are the forward's (global under TP), so
    under TP ``dh`` is this rank's partial sum until the all-reduce."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    inv_t = 1.0 / cfg.temperature
    v_begin = _v_begin(cfg)
    lab = labels.to(torch.int64)
    if cfg.oov_zero:
        live = torch.ones(t, dtype=torch.bool, device=dev)
    else:
        live = lab != cfg.ignore_index
    local = lab - v_begin
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
            # (A target no rank owns has no local column in any chunk.)
            rows = (live & (local >= c0) & (local < c1)).nonzero().squeeze(1)
            dl[rows, local[rows] - c0] += gl[rows]
        dl.mul_(inv_t)
        dh.addmm_(dl, wc)
        if dw is not None:
            torch.mm(dl.t(), h32, out=dw[c0:c1])
    if cfg.tp is not None and cfg.reduce_dh:
        _dist().all_reduce(dh, op=_dist().ReduceOp.SUM, group=cfg.tp.group)
    return dh.to(h.dtype), (dw.to(w.dtype) if dw is not None else None)


class _LmHeadFn(torch.autograd.Function):
    """Autograd over ``(h [t, H], W [v, H])``; labels and the config are not differentiable."""

    @staticmethod
    def forward(ctx, h, w, labels, cfg: _Cfg):
        lp, lse, ent = _forward(h, w, labels, cfg)
        ctx.set_materialize_grads(False)
        ctx.cfg = cfg
        ctx.save_for_backward(h, w, labels)
        # A copy of the entropy (the backward reads it), so that callers may modify the returned
        # tensors in place.
        ctx.lse = lse
        # (Only when a gradient can flow: a no-grad call skips the copy.)
        ctx.ent = ent.clone() if ent is not None and any(ctx.needs_input_grad[:2]) else None
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, labels = ctx.saved_tensors
        lse, ent = ctx.lse, ctx.ent
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and ent is None:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, None, None
        dh, dw = _backward(h, w, labels, lse, ent, g_lp, g_ent, need_dw, ctx.cfg)
        return (dh if need_dh else None), dw, None, None


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
    h = int(hidden.shape[-1])
    if h <= 0 or h % 8 != 0:
        raise _bad(f"the hidden size must be a positive multiple of 8 (rows of 16 bytes), got {h}")
    if weight.shape[0] == 0:
        raise _bad("weight has no vocabulary rows")
    if hidden.device.type == "cuda":
        for name, x in (("hidden", hidden), ("weight", weight)):
            if x.dtype == _BF16 and x.data_ptr() % 16 != 0:
                raise _bad(f"{name} is not 16-byte aligned (a view at an odd offset; {name}.clone() fixes it)")
    try:
        temp = float(temperature)
    except (TypeError, ValueError):
        raise _bad(f"temperature must be a number, got {temperature!r}") from None
    if not (math.isfinite(temp) and temp > 0.0):
        raise _bad(f"temperature must be finite and > 0, got {temperature}")
    return temp


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = True,
    ignore_index: int = -100,
    tp_group=None,
    vocab_start_index: int = 0,
    vocab_size: Optional[int] = None,
    reduce_hidden_grad: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per token ``log_softmax(hidden · weightᵀ / temperature)[label]`` and (``return_entropy``)
    the entropy of that distribution, fp32 with hidden's leading shape, without the logits;
    differentiable in ``hidden`` and ``weight`` (``dW`` only when ``weight`` requires grad).

    - ``hidden [..., H]``, ``weight [V, H]``: bfloat16 (native), or float32/float16 (split into
      bf16 parts, see the module docs); contiguous; ``H`` a multiple of 8.
    - ``labels`` (int64/int32, hidden's leading shape): in ``[0, V_total)`` or ``ignore_index``
      (log-prob 0, entropy 0, no gradient); anything else raises ``ValueError``.
    - ``tp_group``: vocab-parallel over a ``torch.distributed`` group. This rank's ``weight``
      holds rows ``[vocab_start_index, vocab_start_index + V)`` of a vocabulary of
      ``vocab_size`` (default: the SUM of every rank's ``V``, one small all-reduce); labels are
      global; every rank gets the full outputs. ``reduce_hidden_grad``: all-reduce ``d hidden``
      over the group (default) or leave this rank's partial sum for the caller (Megatron).
    - CUDA tensors run the fused kernels (H100/H200) on the current stream; CPU tensors the exact
      float64 backend (slow; for tests and machines without a GPU; TP needs a gloo group).
    """
    temp = _check(hidden, weight, labels, temperature)
    if tp_group is None and vocab_start_index != 0:
        raise _bad("vocab_start_index needs a tp_group")
    if tp_group is None and vocab_size is not None and int(vocab_size) != weight.shape[0]:
        raise _bad("vocab_size needs a tp_group (without one it is weight.shape[0])")
    # (2-D hidden, the common case, skips the reshapes and views: each costs microseconds.)
    flat = hidden.dim() == 2
    lead = hidden.shape[:-1]
    h2 = hidden if flat else hidden.reshape(-1, hidden.shape[-1])
    lab = labels if flat else labels.reshape(-1)
    tp = None
    if tp_group is not None:
        tp = _make_tp(tp_group, int(weight.shape[0]), vocab_start_index, vocab_size, hidden.device)
    cfg = _Cfg(temperature=temp, ignore_index=int(ignore_index), entropy=bool(return_entropy), tp=tp, reduce_dh=bool(reduce_hidden_grad))
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        lp, ent = _LmHeadFn.apply(h2, weight, lab, cfg)
    else:
        # Nothing to differentiate: the forward alone, without the autograd node's overhead.
        lp, _, ent = _forward(h2, weight, lab, cfg)
    if not flat:
        lp = lp.view(lead)
        ent = ent.view(lead) if ent is not None else None
    return lp, ent


def _apply_cfg(hidden2d, weight, labels1d, cfg: _Cfg):
    """The autograd Function on 2-D inputs with a prepared config (the drop-ins use it)."""
    return _LmHeadFn.apply(hidden2d, weight, labels1d, cfg)
