"""Where the binding's time goes: wall-clock medians (55 interleaved rounds, each call followed by
a stream synchronisation) of the nested layers of one forward, from the raw Rust call inward to
the public API. On a GPU machine with the wheel installed, from ``bindings/python/tests`` (where
the source tree's ``lmhead_torch/`` does not shadow the wheel): ``python ../tools/overhead_layers.py``.

- ``a``: the library call timed inside Rust (``_native.time_forward``), no Python;
- ``b``: ``_native.gpu_forward`` with preallocated outputs (the native entry point);
- ``c``: ``_impl._forward`` (output allocation, device and stream lookups);
- ``d``: ``fused_linear_logprob`` under ``no_grad`` (the checks and the public wrapper);
- ``b2``/``e``: a no-op native call and three ``torch.empty`` (for scale).
"""
import statistics
import sys
import time

import torch
import lmhead_torch as L
from lmhead_torch import _impl, _native

dev = torch.device("cuda", 0)
sync = torch.cuda.current_stream(dev).synchronize
for (t, v, d) in [(4096, 32000, 4096), (256, 4096, 1024)]:
    h = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(v, d, device=dev) * 0.02).to(torch.bfloat16)
    lab = torch.randint(0, v, (t,), device=dev)
    lp = torch.empty(t, device=dev); lse = torch.empty(t, device=dev); ent = torch.empty(t, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    fargs = ((0, stream), _impl._fwd_bufs(h, w, lab, d, lp, lse, ent), (1.0, -100, 0, v, 0))
    nargs = fargs + (None,)
    cfg = _impl._Cfg(1.0, -100, True, None, True)
    with torch.no_grad():
        L.fused_linear_logprob(h, w, lab)
    sync()

    def timed(f):
        t0 = time.perf_counter(); f(); sync(); return (time.perf_counter() - t0) * 1e6

    layers = {
        "a rust (time_forward)": lambda: _native.time_forward(*fargs, 1)[0] * 1e6,
        "a2 rust x1 wall from py": lambda: timed(lambda: _native.time_forward(*fargs, 1)),
        "b native gpu_forward": lambda: timed(lambda: _native.gpu_forward(*nargs)),
        "b2 noop native": lambda: timed(lambda: _native.noop(*fargs)),
        "c _impl._forward": lambda: timed(lambda: _impl._forward(h, w, lab, cfg)),
        "d fused_linear_logprob no_grad": lambda: timed(lambda: _nograd(h, w, lab)),
        "e empty x3 + device ctx": lambda: timed(lambda: _empties(t)),
    }

    def _nograd(h, w, lab):
        with torch.no_grad():
            L.fused_linear_logprob(h, w, lab)

    def _empties(t):
        with torch.cuda.device(dev):
            torch.empty(t, device=dev); torch.empty(t, device=dev); torch.empty(t, device=dev)

    res = {k: [] for k in layers}
    for i in range(60):
        for k, f in layers.items():
            x = f()
            if i >= 5:
                res[k].append(x)
    print(f"t={t} v={v} d={d}")
    for k, xs in res.items():
        q = statistics.quantiles(xs, n=4)
        print(f"  {k:34s} median {statistics.median(xs):9.1f} us  IQR {q[2]-q[0]:7.1f}")
    sys.stdout.flush()
