"""CUDA graphs and torch.compile on CUDA tensors (skipped with the reason without a GPU the
library supports).

- A training step (forward with entropy, a loss, ``backward()``) captured in a
  ``torch.cuda.CUDAGraph`` after eager warm-up calls on a side stream (PyTorch's recipe), then
  replayed on fresh inputs copied into the captured tensors: outputs and gradients bitwise equal
  to an eager step on the same inputs when every row is labelled (same configs: the kernels are
  deterministic), within 2⁻⁸ (relative L2) of it with ignored rows (the eager step then computes
  only the active rows, a captured one every row), and always within
  the bf16 bounds of the float64 reference (``refs.check_forward_gpu``, ``6e-3`` relative L2 on
  the gradients). Seeds are fixed per round (printed in the failure message).
- A bad label under capture: the check is deferred, its row comes out NaN, and
  :func:`lmhead_torch.check_labels_status` raises after the replay (and is clear after that).
- The SkyRL drop-in with ``active_mask`` and an fp32 weight (rounded once to bf16 inside the
  graph), captured and replayed.
- ``torch.compile(fullgraph=True, dynamic=True)`` with inductor on CUDA over two token counts:
  no recompile; and ``mode="reduce-overhead"`` (CUDA-graph trees) equal to eager.
"""

import pytest
import torch

import lmhead_torch as L
from refs import BF16_REL_L2, check_forward_gpu, reference, rel_l2

GPU = L.gpu_supported()
REASON = "needs a CUDA GPU the library supports" if torch.cuda.is_available() else "needs a CUDA GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason=REASON)]


def _inputs(t, v, d, seed, dtype=torch.bfloat16, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, d, generator=g)
    w = torch.randn(v, d, generator=g) * (2.0 / d**0.5)
    labels = torch.randint(0, v, (t,), generator=g)
    if ignore:
        labels[::9] = -100
    adv = torch.randn(t, generator=g)
    return h.cuda().to(dtype), w.cuda().to(dtype), labels.cuda(), adv.cuda()


def _step(h, w, labels, adv):
    lp, ent = L.fused_linear_logprob(h, w, labels, 0.9)
    loss = (lp * adv).sum() - 0.05 * ent.sum()
    loss.backward()
    return lp, ent


class _Captured:
    """Static tensors, a warm-up on a side stream, one captured step."""

    def __init__(self, t, v, d, step=_step, dtype=torch.bfloat16):
        h, w, labels, adv = _inputs(t, v, d, seed=1, dtype=dtype)
        self.h = h.clone().requires_grad_(True)
        self.w = w.clone().requires_grad_(True)
        self.labels, self.adv = labels.clone(), adv.clone()
        self.step = step
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._zero()
                step(self.h, self.w, self.labels, self.adv)
        torch.cuda.current_stream().wait_stream(s)
        self._zero()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.lp, self.ent = step(self.h, self.w, self.labels, self.adv)

    def _zero(self):
        self.h.grad = None
        self.w.grad = None

    def replay(self, h, w, labels, adv):
        with torch.no_grad():
            self.h.copy_(h)
            self.w.copy_(w)
            self.labels.copy_(labels)
            self.adv.copy_(adv)
        self.graph.replay()
        torch.cuda.synchronize()
        return self.lp.clone(), self.ent.clone(), self.h.grad.clone(), self.w.grad.clone()


def _eager(step, h, w, labels, adv):
    hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = step(hx, wx, labels, adv)
    torch.cuda.synchronize()
    return lp.detach(), ent.detach(), hx.grad, wx.grad


@pytest.mark.parametrize("t,v,d", [(300, 2900, 256), (1000, 32001, 1024)])
def test_captured_step_replays_on_new_inputs(t, v, d):
    cap = _Captured(t, v, d)
    for seed, ignore in ((11, False), (12, False), (13, True)):
        h, w, labels, adv = _inputs(t, v, d, seed, ignore=ignore)
        got = cap.replay(h, w, labels, adv)
        want = _eager(_step, h, w, labels, adv)
        for a, b, name in zip(got, want, ("logprob", "entropy", "dh", "dW")):
            if ignore:
                # With ignored rows the eager step computes only the active rows (its label
                # check counts them; fewer token tiles, another split plan, dW summed in
                # another order), a captured one every row (no host read): equal up to
                # rounding, and both are held to float64 below.
                e = rel_l2(a, b)
                assert e <= 2.0**-8, f"seed {seed}: replayed {name} is {e:.3g} (rel L2) from the eager step"
                continue
            diff = (a.double() - b.double()).abs().max().item()
            assert torch.equal(a, b), f"seed {seed}: replayed {name} differs from the eager step (max |diff| {diff:.3g})"
        r = reference(h, w, labels, 0.9, g_lp=adv, g_ent=torch.full_like(adv, -0.05), rss=True)
        check_forward_gpu(got[0], got[1], r, d, f"replay seed {seed}")
        assert rel_l2(got[2], r.dh, r.rss_dh) <= BF16_REL_L2, f"seed {seed}: dh"
        assert rel_l2(got[3], r.dw, r.rss_dw) <= BF16_REL_L2, f"seed {seed}: dW"
    L.check_labels_status()


def test_bad_label_under_capture_is_reported_after_the_replay():
    t, v, d = 200, 1000, 128
    cap = _Captured(t, v, d)
    h, w, labels, adv = _inputs(t, v, d, 21)
    labels[17] = v + 3
    lp, _, _, _ = cap.replay(h, w, labels, adv)
    assert bool(torch.isnan(lp[17])) and bool(torch.isfinite(lp[labels != v + 3]).all())
    with pytest.raises(L.InputError) as ei:
        L.check_labels_status()
    assert ei.value.kind == "bad_label" and ei.value.row == 17 and ei.value.label is None
    L.check_labels_status()  # cleared by the read
    # A good round reports nothing.
    h, w, labels, adv = _inputs(t, v, d, 22)
    cap.replay(h, w, labels, adv)
    L.check_labels_status()


def test_deferred_label_check_on_request():
    h, w, labels, _ = _inputs(64, 500, 64, 23)
    labels[5] = -7
    with pytest.raises(L.InputError):
        L.fused_linear_logprob(h, w, labels)  # "sync": nothing written, typed error
    lp, _ = L.fused_linear_logprob(h, w, labels, label_check="deferred")
    assert bool(torch.isnan(lp[5]))
    with pytest.raises(L.InputError) as ei:
        L.check_labels_status()
    assert ei.value.row == 5
    lp, _ = L.fused_linear_logprob(h, w, labels, label_check="off")
    assert bool(torch.isnan(lp[5]))
    L.check_labels_status()


def test_skyrl_drop_in_with_active_mask_and_fp32_weight_replays():
    t, v, d = 256, 4096, 256

    def step(h, w, labels, adv):
        mask = adv > -0.3
        lp, ent = L.FusedLinearLogprob.apply(h[None], w, labels[None], 0, w.shape[0], 64, None, False, mask[None], None, True, True, temperature=0.8)
        (lp[0] * adv + 0.1 * ent[0]).sum().backward()
        return lp[0], ent[0]

    cap = _Captured(t, v, d, step=step, dtype=torch.float32)
    for seed in (31, 32):
        h, w, labels, adv = _inputs(t, v, d, seed, dtype=torch.float32)
        got = cap.replay(h, w, labels, adv)
        want = _eager(step, h, w, labels, adv)
        for a, b, name in zip(got, want, ("logprob", "entropy", "dh", "dW")):
            assert torch.equal(a, b), f"seed {seed}: replayed {name} differs from the eager step"
        assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
        assert bool((got[0][adv <= -0.3] == 0).all()) and bool((got[2][adv <= -0.3] == 0).all())


def _loss(h, w, labels, adv):
    lp, ent = L.fused_linear_logprob(h, w, labels, 0.9)
    return lp, ent, (lp * adv).sum() - 0.05 * ent.sum()


def _run_loss(fn, h, w, labels, adv):
    hx, wx = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent, loss = fn(hx, wx, labels, adv)
    loss.backward()
    torch.cuda.synchronize()
    return lp.detach(), ent.detach(), hx.grad, wx.grad


def test_inductor_one_graph_over_two_token_counts():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counters.clear()
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_loss, backend=cnt, fullgraph=True, dynamic=True)
    frames = []
    for t in (700, 1300):
        h, w, labels, adv = _inputs(t, 4096, 256, t)
        got = _run_loss(compiled, h, w, labels, adv)
        want = _run_loss(_loss, h, w, labels, adv)
        frames.append(cnt.frame_count)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"t={t}: compiled forward"
        for a, b, name in zip(got[2:], want[2:], ("dh", "dW")):
            # (Inductor's kernels for the loss's backward may round its upstream gradients
            # differently in the last bit: the gradients within 1e-2 relative L2.)
            err = float((a.double() - b.double()).norm() / b.double().norm())
            assert err <= 1e-2, f"t={t}: compiled {name} rel L2 {err:.2e}"
    assert frames[1] == frames[0], f"backend calls {frames}: a recompile per token count"
    assert counters["stats"]["unique_graphs"] == 1


def test_reduce_overhead_mode_matches_eager():
    torch._dynamo.reset()
    step = torch.compile(_step, mode="reduce-overhead", dynamic=False)
    for t in (512, 512, 512):
        h, w, labels, adv = _inputs(t, 4096, 256, 40 + t)
        got = _eager(step, h, w, labels, adv)
        want = _eager(_step, h, w, labels, adv)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    L.check_labels_status()
