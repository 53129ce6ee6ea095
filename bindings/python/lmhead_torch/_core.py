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
The kernels multiply bf16. An fp32 (or fp16) operand ``x`` is split exactly-ish into
``x_hi = bf16(x)`` and ``x_lo = bf16(x - x_hi)`` (fp16: exactly; fp32: up to ~2^-17 relative),
and the logits are formed as ``h_hi·W_hiᵀ + h_hi·W_loᵀ + h_lo·W_hiᵀ`` (the products that
involve a split operand only) by concatenating the parts along the hidden dimension: one call
with hidden size ``k·H`` (k = 2 or 3). Gradients come back per part in f32 and are summed.
The backward stages its d-logits in bf16 (relative error 2^-9 per element); for rows whose
label has probability < 1/2 the label's one-hot term ``g·W[label]/T`` (and its ``dW`` row) is
added here in fp32 instead, and the kernel sees a label that matches no vocabulary row (a
"phantom" label ``v_total``, with the vocabulary declared one row larger). Then every staged
d-logit is ``-g·p`` and its rounding error scales with ``p``, which keeps fp32 gradients within
~1e-5 of float64 where probabilities are spread; rows whose label dominates keep the one-hot in
the kernel (there ``1 - p`` is small and bf16 staging is relatively accurate).
"""

from __future__ import annotations

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
# The phantom rule: rows whose label has probability below this use the fp32 one-hot.
_PHANTOM_BELOW = 0.5


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
    names (the call's stream), kept in a per-thread list that ``_scratch_call`` clears when the
    native call returns. PyTorch's caching allocator makes this cheap and stream-ordered, and its
    accounting (``memory_allocated``, ``empty_cache``) sees the workspace."""

    def __init__(self, device: torch.device):
        self.device = device
        self._tls = threading.local()

    def _held(self) -> list:
        held = getattr(self._tls, "held", None)
        if held is None:
            held = self._tls.held = []
        return held

    def __call__(self, nbytes: int, stream: int) -> int:
        cur = torch.cuda.current_stream(self.device)
        if stream == cur.cuda_stream:
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            s = torch.cuda.default_stream(self.device) if stream == 0 else torch.cuda.ExternalStream(stream, device=self.device)
            with torch.cuda.stream(s):
                t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._held().append(t)
        return t.data_ptr()

    def release(self) -> None:
        self._tls.held = []


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


class _ScratchScope:
    def __init__(self, scratch: Optional[_TorchScratch]):
        self.scratch = scratch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.scratch is not None:
            self.scratch.release()
        return False


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


def _recombine(g: torch.Tensor, d: int, segs: Segments, which: int) -> torch.Tensor:
    """Sum the parts of a gradient ``[n, k·d]`` whose ``which`` operand (0: hidden, 1: weight) is
    the high part: ``dh = Σ_{h part = hi}`` (that is dl·(W_hi + W_lo)), ``dW`` likewise."""
    out = None
    for i, pair in enumerate(segs):
        if pair[which] != "hi":
            continue
        part = g[:, i * d : (i + 1) * d]
        out = part.clone() if out is None else out.add_(part)
    return out


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
    # fp32 operands: the fp32 one-hot rule of the module docs (off: every row in the kernel).
    fp32_onehot: bool = True


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
        with torch.cuda.device(dev):
            scratch = _ensure_device(dev.index)
            stream = torch.cuda.current_stream(dev).cuda_stream
            comm = cfg.tp.cuda_comm(dev) if cfg.tp is not None else None
            with _ScratchScope(scratch):
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


def _backward(h, w, labels, lp, lse, ent, g_lp, g_ent, need_dw: bool, cfg: _Cfg):
    """``(dh in h.dtype, dW in w.dtype or None)`` for 2-D ``h``, ``w``."""
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    if t == 0:
        return torch.zeros_like(h), (torch.zeros_like(w) if need_dw else None)
    hb, wb, segs = _operands(h, w)
    k = 1 if segs is None else len(segs)
    v_begin, v_total = _v_begin(cfg), _v_total(cfg, v)
    phantom = v_total  # a label no rank's rows match
    labels_b, v_total_b = labels, v_total
    valid = (labels >= 0) & (labels < v_total)
    if cfg.oov_zero:
        labels_b = torch.where(valid, labels, torch.full_like(labels, phantom))
        v_total_b = v_total + 1
    onehot_rows = None
    if segs is not None and cfg.fp32_onehot and g_lp is not None:
        rows = valid & (labels != cfg.ignore_index) & (lp.exp() < _PHANTOM_BELOW)
        if bool(rows.any()):
            onehot_rows = rows
            labels_b = torch.where(rows, torch.full_like(labels_b, phantom), labels_b)
            v_total_b = v_total + 1
    # Reduction of dh under TP: in the library, unless the fp32 one-hot is added here first.
    tp = cfg.tp
    reduce_here = tp is not None and cfg.reduce_dh and onehot_rows is not None
    native_reduce = tp is not None and cfg.reduce_dh and not reduce_here
    f32_grads = segs is not None or dev.type == "cpu"
    dh_buf = torch.empty((t, k * d), dtype=torch.float32 if f32_grads else _BF16, device=dev)
    dw_buf = torch.empty((v, k * d), dtype=torch.float32 if f32_grads else _BF16, device=dev) if need_dw else None
    gl = g_lp.float().contiguous() if g_lp is not None else None
    ge = g_ent.float().contiguous() if (g_ent is not None and ent is not None) else None
    opt = _ptr
    if dev.type == "cuda":
        # 0: single device; 1: TP, dh all-reduced; 2: TP (or a phantom vocabulary), partial dh.
        if tp is None:
            reduce = 0 if v_total_b == v else 2
        else:
            reduce = 1 if native_reduce else 2
        with torch.cuda.device(dev):
            scratch = _ensure_device(dev.index)
            stream = torch.cuda.current_stream(dev).cuda_stream
            comm = tp.cuda_comm(dev) if tp is not None else None
            with _ScratchScope(scratch):
                args = _gpu_backward_args(
                    dev.index, stream, hb, wb, labels_b, k * d, lse, ent if ge is not None else None, gl, ge, dh_buf, dw_buf, f32_grads,
                    (cfg.temperature, cfg.ignore_index, v_begin, v_total_b), reduce, comm,
                )  # fmt: skip
                _call(_native.gpu_backward, *args)
    else:
        lab64 = labels_b.to(torch.int64).contiguous()
        comm = tp.host_comm() if tp is not None else None
        _call(
            _native.cpu_backward,
            hb.view(torch.int16).data_ptr(),
            wb.view(torch.int16).data_ptr(),
            lab64.data_ptr(),
            t,
            v,
            k * d,
            lse.data_ptr(),
            opt(ent if ge is not None else None),
            opt(gl),
            opt(ge),
            dh_buf.data_ptr(),
            opt(dw_buf),
            cfg.temperature,
            cfg.ignore_index,
            v_begin,
            v_total_b,
            native_reduce,
            comm,
        )
    if segs is not None:
        dh = _recombine(dh_buf, d, segs, 0)
        dw = _recombine(dw_buf, d, segs, 1) if need_dw else None
    else:
        dh, dw = dh_buf, dw_buf
    if onehot_rows is not None:
        # The label's one-hot term in fp32, by the rank that holds the label's row.
        rows = onehot_rows & (labels >= v_begin) & (labels < v_begin + v)
        idx = rows.nonzero().squeeze(1)
        if idx.numel() > 0:
            coef = (gl[idx] / cfg.temperature).unsqueeze(1)
            loc = labels[idx].to(torch.int64) - v_begin
            dh.index_add_(0, idx, coef * w.index_select(0, loc).float())
            if need_dw:
                dw.index_add_(0, loc, coef * h.index_select(0, idx).float())
    if reduce_here:
        _dist().all_reduce(dh, op=_dist().ReduceOp.SUM, group=tp.group)
    dh = dh.to(h.dtype)
    dw = dw.to(w.dtype) if dw is not None else None
    return dh, dw


class _LmHeadFn(torch.autograd.Function):
    """Autograd over ``(h [t, H], W [v, H])``; labels and the config are not differentiable."""

    @staticmethod
    def forward(ctx, h, w, labels, cfg: _Cfg):
        lp, lse, ent = _forward(h, w, labels, cfg)
        ctx.set_materialize_grads(False)
        ctx.cfg = cfg
        ctx.save_for_backward(h, w, labels)
        # Copies of what the backward reads from the outputs ([t] floats each), so that callers
        # may modify the returned tensors in place: the entropy, and the log-prob for the fp32
        # one-hot rule.
        ctx.lse = lse
        ctx.ent = ent.clone() if ent is not None else None
        ctx.lp = lp.clone() if (h.dtype != _BF16 or w.dtype != _BF16) else None
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, labels = ctx.saved_tensors
        lp, lse, ent = ctx.lp, ctx.lse, ctx.ent
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and ent is None:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_dh or need_dw):
            return None, None, None, None
        dh, dw = _backward(h, w, labels, lp, lse, ent, g_lp, g_ent, need_dw, ctx.cfg)
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
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1)
    tp = None
    if tp_group is not None:
        tp = _make_tp(tp_group, int(weight.shape[0]), vocab_start_index, vocab_size, hidden.device)
    cfg = _Cfg(temperature=temp, ignore_index=int(ignore_index), entropy=bool(return_entropy), tp=tp, reduce_dh=bool(reduce_hidden_grad))
    lp, ent = _LmHeadFn.apply(h2, weight, lab, cfg)
    lp = lp.view(lead)
    ent = ent.view(lead) if ent is not None else None
    return lp, ent


def _apply_cfg(hidden2d, weight, labels1d, cfg: _Cfg):
    """The autograd Function on 2-D inputs with a prepared config (the drop-ins use it)."""
    return _LmHeadFn.apply(hidden2d, weight, labels1d, cfg)
