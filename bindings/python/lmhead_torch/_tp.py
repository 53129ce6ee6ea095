"""Tensor parallelism over ``torch.distributed``: the all-reduce callbacks the native module calls
(zero-copy views of the library's buffers, reduced on PyTorch's current stream), and a call's
shard of the vocabulary."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from ._core import _bad, _capturing, _compiling


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
    """This rank's shard ``[vocab_start_index, + v_local)`` of a vocabulary of ``vocab_size``;
    without ``vocab_size``, the SUM of every rank's rows (one all-reduce and a host read: not
    under torch.compile or CUDA-graph capture, where the caller must give it)."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise _bad("tp_group given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if vocab_size is None:
        if _compiling() or _capturing():
            raise _bad("under torch.compile or CUDA-graph capture pass vocab_size with tp_group (it is the SUM of the ranks' rows otherwise, an all-reduce and a host read per call)")
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


def _group_name(group) -> str:
    """The name a custom op carries a process group by (``torch.library`` ops take no groups)."""
    return group.group_name


def _group_of(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
