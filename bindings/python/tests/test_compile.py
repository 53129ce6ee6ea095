"""The op under ``torch.compile`` and PyTorch's autograd modes, on CPU tensors (the float64
backend; the CUDA variants are in test_gpu_capture.py): one graph over two token counts with
``fullgraph=True, dynamic=True`` for the op and both drop-ins, the compiled forward and backward
equal to eager (the same backend runs both: bitwise), the custom ops' registration checked by
``torch.library.opcheck``, and inference mode, ``no_grad``, autocast and
``torch.utils.checkpoint``.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import lmhead_torch as L
from refs import close, reference


def _inputs(t, v=300, d=64, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * d**-0.5 * 2).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::7] = -100
    return h.to(device), w.to(device), labels.to(device)


def _step(h, w, labels, adv):
    lp, ent = L.fused_linear_logprob(h, w, labels, 0.9)
    return (lp * adv).sum() - 0.01 * ent.sum()


def _grads(fn, h, w, labels, adv):
    hx, wx = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss = fn(hx, wx, labels, adv)
    loss.backward()
    return loss.detach(), hx.grad, wx.grad


def _one_graph(step, make, counts=(40, 23)):
    """Compile ``step`` with fullgraph and dynamic shapes (AOTAutograd, so the backward is traced
    through the fake implementations too), run it at two token counts, and check one frame was
    compiled and the results equal eager bitwise."""
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for t in counts:
        args = make(t)
        want = _grads(step, *args)
        got = _grads(compiled, *args)
        frames.append(cnt.frame_count)
        for a, b, name in zip(got, want, ("loss", "dh", "dW")):
            assert torch.equal(a, b), f"t={t}: compiled {name} differs from eager"
    # (A first compile may restart its analysis once, e.g. for a symbolic float: two backend
    # calls for one frame. A recompile would add calls at the second count.)
    assert frames[1] == frames[0], f"backend calls {frames} over token counts {counts}: a recompile"
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return cnt


def test_one_graph_over_two_token_counts():
    cnt = _one_graph(_step, lambda t: (*_inputs(t, seed=t), torch.randn(t)))
    assert cnt.op_count > 0


def test_compiled_values_match_float64():
    torch._dynamo.reset()
    h, w, labels = _inputs(31, seed=3)
    fn = torch.compile(lambda h, w, l: L.fused_linear_logprob(h, w, l, 0.9), backend="aot_eager", fullgraph=True, dynamic=True)
    lp, ent = fn(h, w, labels)
    r = reference(h, w, labels, 0.9)
    close(lp, r.logprob, 1e-6, 2e-6, "logprob")
    close(ent, r.entropy, 1e-6, 2e-6, "entropy")


def test_verl_drop_in_compiles_to_one_graph():
    def step(h, w, labels, adv):
        lp, ent = L.linear_cross_entropy(h, w, labels, 1.0, "none")
        return (lp * adv).sum() + L.linear_cross_entropy(h, w, labels, 1.0, "mean")[0] - 0.01 * ent.sum()

    _one_graph(step, lambda t: (*_inputs(t, seed=t + 1), torch.randn(t)))


@pytest.mark.parametrize("temperature", [None, 0.8], ids=["default", "given"])
def test_skyrl_drop_in_compiles_to_one_graph(temperature):
    # (A default temperature reaches dynamo as a symbolic float, a given one as a constant.)
    kw = {} if temperature is None else {"temperature": temperature}

    def step(h, w, target, adv):
        mask = adv > -0.5
        lp, ent = L.FusedLinearLogprob.apply(h[None], w, target[None], 0, w.shape[0], 8, None, False, mask[None], None, True, True, **kw)
        return (lp[0] * adv).sum() + 0.1 * ent.sum() + L.FusedLinearLogprob.apply(h[None], w, target[None], 0, w.shape[0], 8, None).sum()

    def make(t):
        h, w, labels = _inputs(t, seed=t + 2)
        labels[3] = w.shape[0] + 5  # a target no rank owns
        return h, w, labels, torch.randn(t)

    _one_graph(step, make)


def test_fp32_weight_compiles_to_one_graph():
    def step(h, w, labels, adv):
        lp, _ = L.fused_linear_logprob(h, w, labels, return_entropy=False)
        return (lp * adv).sum()

    def make(t):
        h, w, labels = _inputs(t, seed=t + 4)
        return h, w.float(), labels, torch.randn(t)

    _one_graph(step, make)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_custom_ops_pass_opcheck(w_dtype):
    """``torch.library.opcheck``: the schema, the fake implementations against the real ones,
    the registered autograd, and AOT dispatch with dynamic shapes."""
    from lmhead_torch import _op

    h, w, labels = _inputs(12, seed=9)
    w = w.to(w_dtype).requires_grad_(True)
    h = h.requires_grad_(True)
    cfg = _op._Cfg(1.0, -100, True, None, True)
    torch.library.opcheck(torch.ops.lmhead.forward.default, (h, w, labels, *_op._prims(cfg)))
    lp, ent, lse, ent_s, h_b, w_b, kept = torch.ops.lmhead.forward(h.detach(), w.detach(), labels, *_op._prims(cfg))
    assert kept.numel() == 0, "nothing kept without keep_logits (and never on CPU tensors)"
    g = torch.randn(12)
    args = (h.detach(), w.detach(), labels, lse, ent_s, g, g, h_b, w_b, kept, True, *_op._prims(cfg))
    torch.library.opcheck(torch.ops.lmhead.backward.default, args)
    # With the mode on (CPU tensors keep nothing; the fake must say so too).
    cfg_keep = _op._Cfg(1.0, -100, True, None, True, keep=-1)
    torch.library.opcheck(torch.ops.lmhead.forward.default, (h, w, labels, *_op._prims(cfg_keep)))


def test_the_custom_op_and_the_eager_function_agree():
    """The traced op and the eager Function run the same code: bitwise equal outputs and
    gradients, with either upstream gradient."""
    from lmhead_torch import _op

    h, w, labels = _inputs(20, seed=10)
    cfg = _op._Cfg(1.2, -100, True, None, True)
    for which in ("lp", "ent", "both"):
        outs = []
        for path in ("op", "fn"):
            hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            if path == "op":
                lp, ent, *_ = torch.ops.lmhead.forward(hx, wx, labels, *_op._prims(cfg))
            else:
                lp, ent = _op._LmHeadFn.apply(hx, wx, labels, cfg)
            loss = (lp.sum() if which != "ent" else 0) + (ent.sum() if which != "lp" else 0)
            loss.backward()
            outs.append((lp.detach(), ent.detach(), hx.grad, wx.grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b), which


def test_inference_mode_and_no_grad():
    h, w, labels = _inputs(16, seed=11)
    r = reference(h, w, labels)
    h.requires_grad_(True)
    with torch.inference_mode():
        lp, ent = L.fused_linear_logprob(h, w, labels)
    assert lp.is_inference() and not lp.requires_grad
    close(lp, r.logprob, 1e-6, 2e-6, "inference_mode")
    with torch.no_grad():
        lp2, _ = L.fused_linear_logprob(h, w, labels)
        lp3 = L.FusedLinearLogprob.apply(h[None], w, labels.clamp(min=0)[None], 0, w.shape[0], 4, None)
    assert not lp2.requires_grad and not lp3.requires_grad
    assert torch.equal(lp2, lp.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast(dtype):
    """Under autocast to bf16 the op computes as without it (fp32 operands rounded once to bf16,
    as autocast would for a matmul): same outputs, gradients in the leaves' dtypes."""
    h, w, labels = _inputs(16, seed=12, dtype=torch.float32)
    h, w = h.to(dtype), w.to(dtype)
    want = _grads(_step, h, w, labels, torch.ones(16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(_step, h, w, labels, torch.ones(16))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    # And the split mode's fp32 torch matmuls are not autocast to bf16.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hx = h.float().clone().requires_grad_(True)
        lp, _ = L.fused_linear_logprob(hx, w.float(), labels, precision="split")
        lp.sum().backward()
    r = reference(h.float(), w.float(), labels, g_lp=torch.ones(16))
    close(lp, r.logprob, 0.0, 1e-4, "split under autocast")
    assert hx.grad.dtype == torch.float32


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint(use_reentrant):
    h, w, labels = _inputs(24, seed=13)
    adv = torch.randn(24)
    want = _grads(_step, h, w, labels, adv)

    def ckpt(h, w, labels, adv):
        return torch.utils.checkpoint.checkpoint(_step, h, w, labels, adv, use_reentrant=use_reentrant)

    got = _grads(ckpt, h, w, labels, adv)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def group():
    """A single-rank gloo group (a real process group: the op carries it by name)."""
    import os
    import tempfile

    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tempfile.mkdtemp(), 'store')}", rank=0, world_size=1)
        created = True
    yield dist.group.WORLD
    if created and dist.is_initialized():
        dist.destroy_process_group()


def test_tensor_parallel_call_compiles_to_one_graph(group):
    """A call with a process group (``vocab_size`` given: no all-reduce of the vocabulary): the
    group reaches the custom op by name; equal to eager bitwise."""

    def step(h, w, labels, adv):
        lp, ent = L.fused_linear_logprob(h, w, labels, tp_group=group, vocab_size=w.shape[0], reduce_hidden_grad=True)
        return (lp * adv).sum() + ent.sum()

    _one_graph(step, lambda t: (*_inputs(t, seed=t + 5), torch.randn(t)))
    # (Raised while tracing: dynamo reports it as an "observed exception" carrying the message.)
    with pytest.raises(Exception, match="pass vocab_size"):
        torch._dynamo.reset()
        h, w, labels = _inputs(8)
        torch.compile(lambda h, w, l: L.fused_linear_logprob(h, w, l, tp_group=group), backend="aot_eager", fullgraph=True)(h, w, labels)
