"""``python -m lmhead_torch.bench``: the binding against torch eager (plain and chunked), verl's
and Liger-Kernel's kernels when importable, on the same shapes in one process; and the binding's
overhead over the raw Rust call.

Per shape and implementation: forward (log-prob + entropy; Liger: log-prob only) and forward +
backward (both gradients, upstream gradients for both outputs), CUDA events around each
repetition after warm-up, median of the repetitions; peak memory of a forward + backward above
the inputs (``torch.cuda.max_memory_allocated``). Implementations:

- ``lmhead``: ``lmhead_torch.fused_linear_logprob`` (autograd);
- ``torch``: eager ``log_softmax`` over the full logits (skipped when it would not fit);
- ``torch-chunked``: eager over token chunks with recomputation in the backward (an
  ``autograd.Function``, the usual memory-saving baseline);
- ``verl``: ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (if importable);
- ``liger``: ``liger_kernel``'s ``LigerFusedLinearCrossEntropyFunction`` with
  ``reduction="sum"`` (it has no per-token backward and no entropy; it computes the gradients
  inside its forward when the inputs require them, so its "fwd" column is measured without
  grad and its fwd+bwd includes that work);
- with an fp32 weight (bf16 hidden, the gradient taken in the fp32 weight; not in the default
  list): ``fp32w-lmhead`` (the default ``precision="bf16"``: the weight rounded once per call),
  ``fp32w-cast`` (the caller's ``weight.to(torch.bfloat16)`` inside the timed call, then the bf16
  op: the baseline the default must not be slower than) and ``fp32w-split``
  (``precision="split"``).

Overhead: wall-clock of one synchronised call, the binding (``fused_linear_logprob`` under
``no_grad``; the backward wrapper) against the native entry that loops the Rust call on the same
buffers (``_native.time_forward`` / ``time_backward``), the two alternated; overhead = the median
of the paired differences (binding − Rust, both with the torch-allocated workspace), with the
goal of ≤ 2% or ≤ 30 µs; the workspace's own cost and a no-op native call reported beside it.

Writes a markdown table to stdout and one JSON object per (shape, implementation) to ``--out``.
``--device cpu`` runs everything (tiny shapes) through the float64 CPU backend with wall-clock
timing: a smoke test of this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

import lmhead_torch as L
from lmhead_torch import _core, _impl, _native

DEFAULT_SHAPES = [(4096, 32000, 4096), (8192, 128256, 4096), (4096, 151936, 3584), (16384, 151936, 2048), (1937, 152064, 3584)]
QUICK_SHAPES = [(4096, 32000, 4096), (8192, 128256, 4096)]


def _parse_shapes(s: str):
    out = []
    for part in s.split(";"):
        part = part.strip()
        if part:
            t, v, d = (int(x) for x in part.split(","))
            out.append((t, v, d))
    return out


# ---------------------------------------------------------------------------------------------
# Implementations: each returns (logprob, entropy or None) and is differentiable.
# ---------------------------------------------------------------------------------------------


def _torch_eager(h, w, labels, temperature=1.0):
    logits = (h @ w.T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, labels[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


class _TorchChunked(torch.autograd.Function):
    """Eager torch over token chunks; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h, w, labels, chunk):
        lps, ents, lses = [], [], []
        for s in range(0, h.shape[0], chunk):
            z = (h[s : s + chunk] @ w.T).float()
            lse = torch.logsumexp(z, -1)
            logp = z - lse[:, None]
            lps.append(logp.gather(1, labels[s : s + chunk, None]).squeeze(1))
            ents.append(-(logp.exp() * logp).sum(-1))
            lses.append(lse)
        lp, ent, lse = torch.cat(lps), torch.cat(ents), torch.cat(lses)
        ctx.save_for_backward(h, w, labels, lse, ent)
        ctx.chunk = chunk
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, labels, lse, ent = ctx.saved_tensors
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for s in range(0, h.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, h.shape[0])
            z = (h[s:e] @ w.T).float()
            p = (z - lse[s:e, None]).exp()
            dl = torch.zeros_like(z)
            if g_lp is not None:
                dl -= g_lp[s:e, None] * p
                dl.scatter_add_(1, labels[s:e, None], g_lp[s:e, None])
            if g_ent is not None:
                mu = lse[s:e] - ent[s:e]
                dl -= g_ent[s:e, None] * p * (z - mu[:, None])
            dl = dl.to(h.dtype)
            dh[s:e] = dl @ w
            dw += (dl.T @ h[s:e]).float()
        return dh, dw.to(w.dtype), None, None


def _torch_chunked(h, w, labels, chunk=1024):
    return _TorchChunked.apply(h, w, labels, chunk)


def _lmhead(h, w, labels):
    return L.fused_linear_logprob(h, w, labels)


# The fp32-weight variants: called with the fp32 weight (see ``bench_shape``).
_FP32W = {
    "fp32w-lmhead": lambda h, w, labels: L.fused_linear_logprob(h, w, labels),
    "fp32w-cast": lambda h, w, labels: L.fused_linear_logprob(h, w.to(torch.bfloat16), labels),
    "fp32w-split": lambda h, w, labels: L.fused_linear_logprob(h, w, labels, precision="split"),
}


def _verl():
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy  # type: ignore
    except Exception:
        linear_cross_entropy = _verl_kernel_only()
        if linear_cross_entropy is None:
            return None

    def run(h, w, labels):
        return linear_cross_entropy(h, w, labels, 1.0, "none")

    return run


def _verl_kernel_only():
    """verl's kernel from an installed ``verl`` whose package ``__init__`` cannot be imported
    (it pulls in Ray and its data protocol, which the kernel does not use): the packages
    ``verl``, ``verl.utils`` and ``verl.utils.kernel`` are registered without running their
    ``__init__`` files, then the kernel module is imported as usual."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    saved = {k: sys.modules.get(k) for k in ("verl", "verl.utils", "verl.utils.kernel")}
    try:
        for name, sub in (("verl", ""), ("verl.utils", "/utils"), ("verl.utils.kernel", "/utils/kernel")):
            m = types.ModuleType(name)
            m.__path__ = [root + sub]
            sys.modules[name] = m
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy  # type: ignore

        return linear_cross_entropy
    except Exception as e:
        print(f"verl's kernel did not import: {type(e).__name__}: {e}", file=sys.stderr)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        return None


def _liger():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction  # type: ignore
    except Exception:
        return None

    def run(h, w, labels):
        out = LigerFusedLinearCrossEntropyFunction.apply(h, w, labels, None, None, -100, 0.0, 0.0, "sum")
        loss = out[0] if isinstance(out, tuple) else out
        return -loss, None

    return run


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _time(fn: Callable[[], object], reps: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` (CUDA events on the current stream, or wall clock)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak(fn: Callable[[], object], cuda: bool) -> Optional[int]:
    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _fits_eager(t, v, d, cuda: bool) -> bool:
    """The eager baseline keeps ~5 fp32 copies of the t × v logits alive in fwd+bwd."""
    if not cuda:
        return True
    free, _ = torch.cuda.mem_get_info()
    return 5 * 4 * t * v < 0.8 * free


def _overhead(h, w, labels, reps: int, cuda: bool) -> Dict[str, float]:
    """Binding vs raw Rust call: wall clock of synchronised calls, in microseconds.

    ``rust_*``: the native entry loops the library call on the same buffers with the library's
    own (reused) workspace — no Python at all; ``rust_torch_ws_*``: the same with the workspace
    allocated through PyTorch (the binding's default: a Python callback per buffer, inside the
    call); ``binding_*``: the Python API (forward under ``no_grad`` and with autograd; the
    backward wrapper on saved forward state). ``overhead_*``: the median of paired differences
    ``binding − rust_torch_ws`` (the two calls alternate); ``torch_ws_*``: the workspace's cost,
    ``rust_torch_ws − rust``."""
    if not cuda:
        return {}
    t, d = h.shape
    v = w.shape[0]
    dev = h.device
    idx = dev.index
    scratch = _core._ensure_device(idx)
    stream = torch.cuda.current_stream(dev).cuda_stream
    sync = torch.cuda.current_stream(dev).synchronize
    lp = torch.empty(t, device=dev)
    lse = torch.empty(t, device=dev)
    ent = torch.empty(t, device=dev)
    cfg = _impl._Cfg(1.0, -100, True, None, True)
    sc = (1.0, -100, 0, v, 0)
    fargs = ((idx, stream), _impl._fwd_bufs(h, w, labels, d, lp, lse, ent), sc)
    with torch.no_grad():
        lpx, lsex, entx, _, _ = _impl._forward(h, w, labels, cfg)
    g1 = torch.randn(t, device=dev)
    g2 = torch.randn(t, device=dev)
    dh = torch.empty_like(h)
    dw = torch.empty_like(w)
    bargs = ((idx, stream), _impl._bwd_bufs(h, w, labels, lsex, entx, g1, g2, dh, dw), sc)

    def rust_own(fn, args):
        _native.set_scratch(idx, None)
        try:
            fn(*args, 2)  # warm (allocates the library's workspace)
            return statistics.median(fn(*args, reps)) * 1e6
        finally:
            _native.set_scratch(idx, scratch)  # frees the library's workspace again

    def rust_torch_once(fn, args) -> float:
        return fn(*args, 1)[0]

    def binding_once(call) -> float:
        t0 = time.perf_counter()
        call()
        sync()
        return time.perf_counter() - t0

    def paired(fn, args, call) -> Dict[str, float]:
        """Rust call and binding call alternated (each goes first in half the pairs), same
        workspace source (torch's allocator): the median of the per-pair differences is the
        binding's own cost, free of the clock drift that separates two blocks of calls on a GPU
        at its power limit."""
        rust, bind, diff = [], [], []
        for i in range(pairs + 2):
            # Alternate which call goes first: the second of two back-to-back calls can run on a
            # hotter, slower-clocked GPU, and that must not count as the binding's cost.
            if i % 2 == 0:
                a = rust_torch_once(fn, args)
                b = binding_once(call)
            else:
                b = binding_once(call)
                a = rust_torch_once(fn, args)
            if i >= 2:
                rust.append(a)
                bind.append(b)
                diff.append(b - a)
        q = statistics.quantiles(diff, n=4)
        return {
            "rust": statistics.median(rust) * 1e6,
            "binding": statistics.median(bind) * 1e6,
            "diff": statistics.median(diff) * 1e6,
            # The interquartile range of the differences: the measurement's own spread.
            "diff_iqr": (q[2] - q[0]) * 1e6,
        }

    # Enough pairs that the median difference is not the GPU's clock noise (±2% of a call).
    pairs = max(reps, 30)
    hh = h.detach().requires_grad_(True)

    def fwd_nograd():
        with torch.no_grad():
            L.fused_linear_logprob(h, w, labels)

    pf = paired(_native.time_forward, fargs, fwd_nograd)
    pa = paired(_native.time_forward, fargs, lambda: L.fused_linear_logprob(hh, w, labels))
    pb = paired(_native.time_backward, bargs, lambda: _impl._backward(h, w, None, None, labels, lsex, entx, g1, g2, True, cfg))
    res = {
        "rust_fwd_us": rust_own(_native.time_forward, fargs),
        "rust_torch_ws_fwd_us": pf["rust"],
        "binding_fwd_us": pf["binding"],
        "binding_fwd_autograd_us": pa["binding"],
        "rust_bwd_us": rust_own(_native.time_backward, bargs),
        "rust_torch_ws_bwd_us": pb["rust"],
        "binding_bwd_us": pb["binding"],
    }
    # The binding's own cost: paired differences against the Rust call with the same (torch)
    # workspace; the workspace's cost separately (torch's allocator vs the library's own).
    res["overhead_fwd_us"] = pf["diff"]
    res["overhead_fwd_autograd_us"] = pa["diff"]
    res["overhead_bwd_us"] = pb["diff"]
    res["overhead_fwd_iqr_us"] = pf["diff_iqr"]
    res["overhead_bwd_iqr_us"] = pb["diff_iqr"]
    res["torch_ws_fwd_us"] = res["rust_torch_ws_fwd_us"] - res["rust_fwd_us"]
    res["torch_ws_bwd_us"] = res["rust_torch_ws_bwd_us"] - res["rust_bwd_us"]
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        _native.noop(*fargs)
    res["noop_call_us"] = (time.perf_counter() - t0) / n * 1e6
    return res


def _within_goal(over_us: float, base_us: float) -> bool:
    return over_us <= 30.0 or over_us <= 0.02 * base_us


def bench_shape(t, v, d, impls: List[str], reps: int, warmup: int, device: torch.device, chunk: int) -> List[dict]:
    cuda = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(t, d, generator=g) * 1.0).to(device, torch.bfloat16)
    w = (torch.randn(v, d, generator=g) * (2.0 / math.sqrt(d))).to(device, torch.bfloat16)
    labels = torch.randint(0, v, (t,), generator=g).to(device)
    g_lp = torch.randn(t, generator=g).to(device)
    g_ent = torch.randn(t, generator=g).to(device)
    table = {
        "lmhead": _lmhead,
        "torch": _torch_eager,
        "torch-chunked": lambda a, b, c: _torch_chunked(a, b, c, chunk),
        "verl": _verl(),
        "liger": _liger(),
        **_FP32W,
    }
    w32 = w.float() if any(n in _FP32W for n in impls) else None
    rows = []
    for name in impls:
        fn = table.get(name)
        row = {"t": t, "v": v, "d": d, "impl": name, "device": str(device)}
        if fn is None:
            row["skipped"] = "not importable"
            rows.append(row)
            continue
        if name == "torch" and not _fits_eager(t, v, d, cuda):
            row["skipped"] = "the eager logits would not fit in free memory"
            rows.append(row)
            continue
        try:
            wx = w32 if name in _FP32W else w
            hh = h.detach().requires_grad_(True)
            ww = wx.detach().requires_grad_(True)

            def fwd():
                with torch.no_grad():
                    return fn(h, wx, labels)

            def fwd_bwd():
                lp, ent = fn(hh, ww, labels)
                outs, grads = [lp], [g_lp if lp.dim() else torch.ones((), device=device)]
                if ent is not None:
                    outs.append(ent)
                    grads.append(g_ent)
                torch.autograd.grad(outs, (hh, ww), grads)

            row["fwd_ms"] = _time(fwd, reps, warmup, cuda)
            row["fwd_bwd_ms"] = _time(fwd_bwd, reps, warmup, cuda)
            row["peak_fwd_bwd_bytes"] = _peak(fwd_bwd, cuda)
            row["peak_fwd_bytes"] = _peak(fwd, cuda)
        except torch.cuda.OutOfMemoryError as e:  # pragma: no cover - GPU only
            row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
            torch.cuda.empty_cache()
        except Exception as e:
            row["skipped"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    if "lmhead" in impls:
        try:
            over = _overhead(h, w, labels, max(reps, 10), cuda)
        except Exception as e:  # pragma: no cover - reported
            over = {"overhead_error": f"{type(e).__name__}: {e}"}
        for r in rows:
            if r["impl"] == "lmhead":
                r.update(over)
                if "overhead_fwd_us" in over:
                    r["overhead_fwd_goal_met"] = _within_goal(over["overhead_fwd_us"], over["rust_fwd_us"])
                    r["overhead_bwd_goal_met"] = _within_goal(over["overhead_bwd_us"], over["rust_bwd_us"])
    return rows


def _fmt_ms(x):
    return "—" if x is None else f"{x:.3f}"


def _fmt_mib(x):
    return "—" if x is None else f"{x / 2**20:.0f}"


def markdown(rows: List[dict]) -> str:
    out = ["| t | v | d | impl | fwd ms | fwd+bwd ms | fwd+bwd vs torch | peak fwd+bwd MiB | peak vs torch | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_shape: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault((r["t"], r["v"], r["d"]), {})[r["impl"]] = r
    for (t, v, d), impls in by_shape.items():
        base = impls.get("torch") if "fwd_bwd_ms" in impls.get("torch", {}) else impls.get("torch-chunked")
        for name, r in impls.items():
            if "skipped" in r:
                out.append(f"| {t} | {v} | {d} | {name} | — | — | — | — | — | skipped: {r['skipped']} |")
                continue
            speed = f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x faster" if base and "fwd_bwd_ms" in base else "—"
            mem = (
                f"{r['peak_fwd_bwd_bytes'] / base['peak_fwd_bwd_bytes']:.3f}"
                if base and r.get("peak_fwd_bwd_bytes") is not None and base.get("peak_fwd_bwd_bytes")
                else "—"
            )
            note = ""
            if name == "liger":
                note = "log-prob only, reduction=sum"
            if "overhead_fwd_us" in r:
                note = (
                    f"overhead fwd {r['overhead_fwd_us']:.1f} µs (IQR {r['overhead_fwd_iqr_us']:.0f}) on {r['rust_fwd_us']:.0f} "
                    f"(autograd {r['overhead_fwd_autograd_us']:.1f}), bwd {r['overhead_bwd_us']:.1f} µs (IQR {r['overhead_bwd_iqr_us']:.0f}) "
                    f"on {r['rust_bwd_us']:.0f}; besides, the torch-allocated workspace "
                    f"{r['torch_ws_fwd_us']:.1f} / {r['torch_ws_bwd_us']:.1f} µs; no-op call {r['noop_call_us']:.2f} µs; "
                    f"goal {'met' if r['overhead_fwd_goal_met'] and r['overhead_bwd_goal_met'] else 'MISSED'}"
                )
            out.append(
                f"| {t} | {v} | {d} | {name} | {_fmt_ms(r['fwd_ms'])} | {_fmt_ms(r['fwd_bwd_ms'])} | {speed} | "
                f"{_fmt_mib(r.get('peak_fwd_bwd_bytes'))} | {mem} | {note} |"
            )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmhead_torch.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", help="t,v,d;t,v,d;... (default: a set of LLM shapes)")
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer repetitions")
    ap.add_argument("--impls", default="lmhead,torch,torch-chunked,verl,liger")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=1024, help="token chunk of torch-chunked")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--out", help="JSON lines file (appended)")
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shapes = _parse_shapes(a.shapes) if a.shapes else (QUICK_SHAPES if a.quick else DEFAULT_SHAPES)
    if device.type == "cpu" and not a.shapes:
        shapes = [(64, 1000, 128)]
    reps = min(a.reps, 5) if a.quick else a.reps
    impls = [x.strip() for x in a.impls.split(",") if x.strip()]
    header = {"torch": torch.__version__, "lmhead_torch": L.__version__, "device": str(device)}
    if device.type == "cuda":
        header["gpu"] = torch.cuda.get_device_name(device)
        try:
            header["kernels"] = _native.kernel_report(device.index)
        except Exception as e:
            header["kernels"] = f"{type(e).__name__}: {e}"
    header["env"] = {k: v for k, v in os.environ.items() if k.startswith("LMHEAD_")}
    print("# lmhead_torch bench")
    print()
    for k, v in header.items():
        print(f"- {k}: {v}")
    print()
    rows = []
    with torch.cuda.device(device) if device.type == "cuda" else _Null():
        for t, v, d in shapes:
            if device.type == "cuda":
                try:
                    L.warm_up([t], v, d, entropy=True, backward=True, device=device)
                except Exception as e:
                    print(f"warm-up failed: {e}", file=sys.stderr)
            rows.extend(bench_shape(t, v, d, impls, reps, a.warmup, device, a.chunk))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(markdown(rows))
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, **{"header": header})) + "\n")
    return 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
