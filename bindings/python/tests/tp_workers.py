"""Multi-process tensor-parallel test cases (not collected by pytest): ``run_tp(case, world,
placement, backend, **kw)`` spawns ``world`` processes with ``torch.multiprocessing``, joins a
``torch.distributed`` group over a file store, and runs ``CASES[case]`` on every rank; an
assertion failing on any rank fails the call with that rank's traceback.

``placement``: ``"cpu"`` (CPU tensors, the float64 backend), ``"cuda0"`` (every rank on cuda:0),
``"cuda"`` (rank r on cuda:r).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_tp(case: str, world: int, placement: str = "cpu", backend: str = "gloo", **kw):
    """Run one case on ``world`` ranks."""
    run_tp_cases(world, [(case, kw)], placement, backend)


def run_tp_cases(world: int, cases, placement: str = "cpu", backend: str = "gloo"):
    """Run several ``(case, kwargs)`` in turn in one group of ``world`` spawned ranks (a spawn
    costs seconds: every rank imports torch). The first failure stops all ranks and is raised
    here with the case's name and arguments."""
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(world, init, list(cases), placement, backend), nprocs=world, join=True)


def _entry(rank, world, init, cases, placement, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if placement == "cpu":
        device = torch.device("cpu")
    elif placement == "cuda0":
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        for case, kw in cases:
            try:
                CASES[case](rank, world, device, **kw)
                dist.barrier()
            except BaseException as e:
                # Printed at once: spawn reports whichever rank it notices first, often a peer
                # that only saw the connection close.
                import sys
                import traceback

                print(f"=== rank {rank} failed in {case} {kw}:", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
                raise AssertionError(f"rank {rank}/{world} ({placement}, {backend}) case {case} {kw}: {e}") from e
    finally:
        dist.destroy_process_group()


def _shards(v_total, world, sizes=None):
    if sizes is None:
        base, extra = divmod(v_total, world)
        sizes = [base + (1 if r < extra else 0) for r in range(world)]
    assert sum(sizes) == v_total
    begins = [sum(sizes[:r]) for r in range(world)]
    return begins, sizes


# ---------------------------------------------------------------------------------------------
# The core op under TP
# ---------------------------------------------------------------------------------------------


def core_tp(rank, world, device, t=37, v=300, d=72, sizes=None, dtype="bf16", temperature=1.0, reduce=True, ignore=True, give_vocab=False, gpu_tol=False, precision=None):
    import lmhead_torch as L
    from refs import BF16_REL_L2, IGNORE, check_forward_gpu, close, dlogits, reference, rel_l2

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(1234)
    h = torch.randn(t, d, generator=g).to(dt)
    w_full = (torch.randn(v, d, generator=g) * (d**-0.5) * 2.0).to(dt)
    labels = torch.randint(0, v, (t,), generator=g)
    if ignore:
        labels[::5] = IGNORE
    g_lp, g_ent = torch.randn(t, generator=g), torch.randn(t, generator=g)
    begins, szs = _shards(v, world, sizes)
    b, n = begins[rank], szs[rank]
    w = w_full[b : b + n].clone()
    hd = h.to(device).requires_grad_(True)
    wd = w.to(device).requires_grad_(True)
    kw = dict(tp_group=dist.group.WORLD, vocab_start_index=b, reduce_hidden_grad=reduce, precision=precision)
    if give_vocab:
        kw["vocab_size"] = v
    lp, ent = L.fused_linear_logprob(hd, wd, labels.to(device), temperature, **kw)
    torch.autograd.backward([lp, ent], [g_lp.to(device), g_ent.to(device)])
    r = reference(h, w_full, labels, temperature, g_lp=g_lp, g_ent=g_ent, rss=True)
    dl = dlogits(h, w_full, labels, temperature, IGNORE, g_lp, g_ent, 0, r.lse, r.entropy)
    dh_partial = dl[:, b : b + n] @ w_full[b : b + n].double()
    if gpu_tol:
        check_forward_gpu(lp, ent, r, d, f"rank {rank}")
    else:
        close(lp, r.logprob, 1e-6 if dt == torch.bfloat16 else 0.0, 2e-6 if dt == torch.bfloat16 else 1e-4, f"rank {rank} logprob")
        close(ent, r.entropy, 1e-6 if dt == torch.bfloat16 else 0.0, 2e-6 if dt == torch.bfloat16 else 1e-4, f"rank {rank} entropy")
    dh, dw = hd.grad.cpu(), wd.grad.cpu()
    assert dh.dtype == dt and dw.dtype == dt
    lim = BF16_REL_L2 if (gpu_tol or dt == torch.bfloat16) else 5e-5
    want_dh = r.dh if reduce else dh_partial
    assert rel_l2(dh, want_dh, r.rss_dh) <= lim, f"rank {rank} dh rel_l2 {rel_l2(dh, want_dh, r.rss_dh):.2e}"
    assert rel_l2(dw, r.dw[b : b + n], r.rss_dw[b : b + n]) <= lim, f"rank {rank} dW rel_l2 {rel_l2(dw, r.dw[b:b+n]):.2e}"
    if not gpu_tol and dt == torch.bfloat16:
        # CPU backend: exact up to the bf16 rounding of the gradient.
        close(dh, want_dh, 2.0**-8 + 1e-6, 1e-7, f"rank {rank} dh")
        close(dw, r.dw[b : b + n], 2.0**-8 + 1e-6, 1e-7, f"rank {rank} dW")
    if not reduce:
        total = hd.grad.double()  # on the device: NCCL reduces only device memory
        dist.all_reduce(total, group=dist.group.WORLD)
        assert rel_l2(total.cpu(), r.dh, r.rss_dh) <= lim
    assert bool((dh[labels == IGNORE] == 0).all()), f"rank {rank}: ignored rows got a gradient"


def label_error_tp(rank, world, device):
    """A bad global label raises ValueError on every rank (no hang)."""
    import pytest

    import lmhead_torch as L

    h = torch.randn(8, 16).bfloat16().to(device)
    w = torch.randn(10, 16).bfloat16().to(device)
    labels = torch.randint(0, 10 * world, (8,))
    labels[2] = 10 * world  # outside [0, V_total)
    with pytest.raises(ValueError):
        L.fused_linear_logprob(h, w, labels.to(device), tp_group=dist.group.WORLD, vocab_start_index=10 * rank)


# ---------------------------------------------------------------------------------------------
# verl's TP test (tests/utils/test_special_linear_cross_entropy_tp.py)
# ---------------------------------------------------------------------------------------------


def verl_tp(rank, world, device, num_tokens=96, hidden_size=256, vocab_size=512, temperature=1.5, dtype="bf16", reference_dtype="fp64", tol="port"):
    """Port of ``TestLinearCrossEntropy_TensorParallel.verify_kernel_correctness``: inputs
    broadcast from rank 0, ``vocab_size`` rows per rank, labels in ``[0, vocab_size)`` as
    upstream, the kernel against ``TorchEntropyTP``; d_hidden all-reduced by the test ("all-reduce
    on hidden is conducted outside the kernel"). Upstream tolerances: forward atol 1e-1 rtol
    1e-2, gradients atol 2e-2 rtol 4e-2; ``tol="tight"`` holds the CPU backend to float64."""
    import lmhead_torch as L
    from refs import close
    from verl_ref import run_torch_entropy_tp

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    rdt = {"fp64": torch.float64, "fp32": torch.float32}[reference_dtype]
    group = dist.group.WORLD
    torch.manual_seed(233376 + rank)
    hidden = torch.empty((1, num_tokens, hidden_size), dtype=dt).uniform_(-0.5, 0.5).to(device)
    weight = torch.empty((vocab_size, hidden_size), dtype=dt).uniform_(-0.5, 0.5).to(device)
    labels = torch.randint(0, vocab_size, (1, num_tokens)).to(device)
    dist.broadcast(hidden, src=0, group=group)
    dist.broadcast(labels, src=0, group=group)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    # The reference's leaves: the inputs themselves (upstream), or float64 copies so that its
    # gradients are not rounded to bf16 (tight).
    rh, rw = (hidden, weight) if tol == "port" else (hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_())
    t_lp, t_ent = run_torch_entropy_tp(rh, rw, labels, temperature, group, rdt)
    k_lp, k_ent = L.linear_cross_entropy(hidden, weight, labels, temperature, "none", group)
    assert k_lp.dtype == torch.float32 and k_ent.dtype == torch.float32 and k_lp.shape == (num_tokens,)
    fa, fr, ga, gr = (1e-1, 1e-2, 2e-2, 4e-2) if tol == "port" else (2e-6, 1e-6, 1e-6, 2.0**-8)
    close(k_lp, t_lp.detach(), fr, fa, f"rank {rank} logprobs")
    close(k_ent, t_ent.detach(), fr, fa, f"rank {rank} entropy")
    g_entropy = torch.empty((num_tokens,), dtype=dt).uniform_(-0.5, 0.5).to(device)
    g_logprobs = torch.empty((num_tokens,), dtype=dt).uniform_(-1, 1).to(device)
    dist.broadcast(g_entropy, src=0, group=group)
    dist.broadcast(g_logprobs, src=0, group=group)
    t_dh, t_dw = torch.autograd.grad((t_ent, t_lp), (rh, rw), (g_entropy.to(rdt), g_logprobs.to(rdt)))
    k_dh, k_dw = torch.autograd.grad((k_ent, k_lp), (hidden, weight), (g_entropy.float(), g_logprobs.float()))
    assert k_dh.dtype == dt and k_dw.dtype == dt and k_dh.shape == hidden.shape
    if tol != "port":
        # Each rank's partial d_hidden, exact up to its bf16 rounding (the all-reduced sum of two
        # rounded partials is only as good as the partials' magnitudes, not the sum's).
        close(k_dh, t_dh, gr, ga, f"rank {rank} partial d_hidden")
    t_dh = t_dh.clone()
    dist.all_reduce(t_dh, op=dist.ReduceOp.SUM, group=group)
    k_dh = k_dh.float()
    dist.all_reduce(k_dh, op=dist.ReduceOp.SUM, group=group)
    if tol == "port":
        close(k_dh, t_dh, gr, ga, f"rank {rank} d_hidden")
    close(k_dw, t_dw, gr, ga, f"rank {rank} d_weight")


# ---------------------------------------------------------------------------------------------
# SkyRL's TP tests
# ---------------------------------------------------------------------------------------------


def skyrl_triton_tp(rank, world, device, chunk_size=8, with_oov=False, dtype_str="fp32"):
    """Port of ``_worker`` in SkyRL's ``test_fused_linear_logprob_triton.py``: B, S, H, V = 3, 24,
    128, 256, identical inputs on every rank (seed 0), shard V/world, targets rolled, the op
    against the stock materialised-logits path with ``fp32: atol=rtol=1e-4``, ``bf16: 2e-2``;
    plus the float64 contract (``skyrl_ref.float64_reference``) at the binding's own bounds. The
    fp32 cases run ``precision="split"``, as upstream flips its kernel to IEEE fp32 for them
    (``FORCE_FP32_IEEE_PRECISION``); the default rounds an fp32 operand to bf16."""
    import lmhead_torch as L
    from refs import close
    from skyrl_ref import float64_reference, stock_shifted

    dtype = torch.bfloat16 if dtype_str == "bf16" else torch.float32
    torch.manual_seed(0)
    B, S, H, V = 3, 24, 128, 256
    hidden = (torch.randn(B, S, H) * 0.5).to(dtype).to(device)
    weight_full = (torch.randn(V, H) * 0.1).to(dtype).to(device)
    target_high = V + 50 if with_oov else V
    target = torch.randint(0, target_high, (B, S), dtype=torch.long).to(device)
    assert V % world == 0
    shard = V // world
    vstart, vend = rank * shard, (rank + 1) * shard
    weight_shard = weight_full[vstart:vend].contiguous()
    target_shifted = target.roll(shifts=-1, dims=-1)
    group = dist.group.WORLD
    lp_ref, gh_ref, gw_ref, grad_seed = stock_shifted(hidden, weight_shard, target_shifted, vstart, vend, chunk_size, group)
    leaf_h = hidden.detach().clone().requires_grad_(True)
    leaf_w = weight_shard.detach().clone().requires_grad_(True)
    precision = "split" if dtype == torch.float32 else None
    lp = L.FusedLinearLogprob.apply(leaf_h, leaf_w, target_shifted, vstart, vend, chunk_size, group, False, precision=precision)
    lp.backward(grad_seed.clone())
    assert lp.dtype == torch.float32 and lp.shape == (B, S)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(lp.float(), lp_ref.float(), **tol), f"rank {rank} forward {float((lp - lp_ref).abs().max())}"
    assert torch.allclose(leaf_h.grad.float(), gh_ref.float(), **tol), f"rank {rank} grad-hidden {float((leaf_h.grad.float() - gh_ref.float()).abs().max())}"
    assert torch.allclose(leaf_w.grad.float(), gw_ref.float(), **tol), f"rank {rank} grad-weight {float((leaf_w.grad.float() - gw_ref.float()).abs().max())}"
    # The float64 contract (OOV: 0 forward, -p·g backward; partial grad_hidden).
    lp64, dh64, dw64 = float64_reference(hidden.cpu(), weight_full.cpu(), target_shifted.cpu(), vstart, vend, grad_seed.cpu())
    oov = (target_shifted.cpu() < 0) | (target_shifted.cpu() >= V)
    assert bool((lp.cpu()[oov] == 0).all())
    if device.type == "cpu":
        close(lp, lp64, 0.0, 1e-6 if dtype == torch.bfloat16 else 1e-5, f"rank {rank} logprob vs f64")
        rt = 2.0**-8 + 1e-6 if dtype == torch.bfloat16 else 1e-4
        close(leaf_h.grad, dh64, rt, 1e-6, f"rank {rank} grad_hidden vs f64")
        close(leaf_w.grad, dw64, rt, 1e-6, f"rank {rank} grad_weight vs f64")


def skyrl_fused_tp(rank, world, device, B=2, S=64, H=256, V=4096, chunks=(16, 512)):
    """Port of ``_distributed_main`` in SkyRL's ``test_fused_linear_logprob.py``: bf16 hidden,
    fp32 weight shard, targets in ``[0, V)``; fused vs ``_reference_fb`` with atol/rtol 1e-4 on
    the forward and 5e-3 on both gradients (``grad_hidden`` local: not reduced), with
    ``precision="split"`` (fp32-grade logits, which those bounds need)."""
    import lmhead_torch as L
    from skyrl_ref import fused_reference

    assert V % world == 0
    v_tp = V // world
    vstart, vend = rank * v_tp, (rank + 1) * v_tp
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float32).to(device, torch.bfloat16)
    target = torch.randint(0, V, (B, S), generator=g)
    w_full = torch.randn(V, H, generator=g, dtype=torch.float32) * (H**-0.5)
    weight = w_full[vstart:vend].to(device, torch.float32)
    target = target.to(device)
    group = dist.group.WORLD
    for chunk_size in chunks:
        h = hidden.detach().clone().requires_grad_(True)
        w = weight.detach().clone().requires_grad_(True)
        out = L.FusedLinearLogprob.apply(h, w, target, vstart, vend, chunk_size, group, False, precision="split")
        seed = torch.linspace(0.5, 1.5, steps=out.numel(), device=out.device, dtype=out.dtype).reshape(out.shape)
        out.backward(seed)
        out_r, gh_r, gw_r, _ = fused_reference(hidden, weight, target, vstart, vend, group, chunk_size)
        torch.testing.assert_close(out.detach(), out_r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h.grad, gh_r, atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(w.grad.float(), gw_r.float(), atol=5e-3, rtol=5e-3)


CASES = {
    "core_tp": core_tp,
    "label_error_tp": label_error_tp,
    "verl_tp": verl_tp,
    "skyrl_triton_tp": skyrl_triton_tp,
    "skyrl_fused_tp": skyrl_fused_tp,
}
