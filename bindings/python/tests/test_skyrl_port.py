"""SkyRL's tests of its fused LM-head log-prob, ported to ``lmhead_torch.FusedLinearLogprob`` and
run on CPU tensors (the float64 backend) as well as CUDA ones. SkyRL's own files run unmodified
on the GPU from ``tests/upstream/skyrl/`` (see its README entry); this port keeps their cases and
bounds where our contract is theirs, and says where it is not:

1. ``test_fused_linear_logprob_triton.py`` — ``test_fused_triton_matches_stock_logits_path``:
   dtype fp32/bf16 × TP 1/2 × chunk 8/1000 × out-of-vocab targets or not; B, S, H, V = 3, 24,
   128, 256; the op against the stock materialised-logits path, ``fp32: atol = rtol = 1e-4``
   (upstream flips its kernel to IEEE fp32 for these: ``precision="split"`` here),
   ``bf16: 2e-2``; output dtype fp32 (``tp_workers.skyrl_triton_tp``): gloo on CPU in CI, gloo
   with both ranks on one GPU, NCCL on two GPUs; on CPU also held to float64.
2. ``test_fused_linear_logprob.py`` — ``test_fused_matches_materialized_logits`` (chunk
   1/7/64/512 × OOV × (bf16, bf16) / (bf16, fp32) / (fp32, fp32); B, S, V, H = 4, 32, 4096, 256),
   ``..._edge_cases`` and ``test_fused_linear_logprob_tp`` (TP 2 and 4 over NCCL). Upstream
   holds the forward to ``1e-5`` and the gradients to ``2e-3`` (a bf16 ``grad_weight``:
   ``4e-2``) against ``_reference_fb``.
   - fp32 weight: upstream's bounds, as is, with ``precision="split"`` (fp32-grade logits);
     the default ``precision="bf16"`` rounds the weight to bf16 and is held to the float64 of the
     rounded weight instead (``test_fp32_weight_default_contract``).
   - bf16 weight: ``_reference_fb`` rounds the logits to bf16 (``hidden @ weightᵀ`` in bf16),
     so its bound of 1e-5 measures SkyRL's rounding, not the op: upstream's file fails there
     (marked expected-to-fail in ``tests/upstream/skyrl``). Here the op is held to the float64
     of the same bf16 inputs, and both deviations are printed: the op's from float64 and the
     reference's.
3. ``test_fused_forward_matches_liger_flce``: log-prob == -LigerFLCE(reduction="none"), GPU,
   skipped unless ``liger_kernel`` is importable.

Semantics checked throughout: targets outside the vocabulary give log-prob 0 in the forward and
``-p·g`` d-logits (no one-hot) in the backward; ``grad_hidden`` is this rank's partial sum (not
all-reduced: Megatron reduces it); gradients in the inputs' dtypes.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import lmhead_torch as L
from refs import close
from skyrl_ref import float64_reference, fused_reference
from tp_workers import run_tp_cases

H = 256
GPU = L.gpu_supported()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU" if not torch.cuda.is_available() else "the library does not support this CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[needs_gpu, pytest.mark.gpu])]


@pytest.fixture(scope="module")
def tp_group():
    """Single-rank gloo group (upstream's fixture: world_size=1, all-reduces are no-ops)."""
    created = False
    tmp = tempfile.mkdtemp()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        created = True
    yield dist.group.WORLD
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _fused_fb(hidden, weight, target, vstart, vend, tp_group, chunk_size, precision=None):
    """Upstream ``_fused_fb`` with our op: (logprob, grad_hidden, grad_weight)."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    out = L.FusedLinearLogprob.apply(h, w, target, vstart, vend, chunk_size, tp_group, False, precision=precision)
    seed = torch.linspace(0.5, 1.5, steps=out.numel(), device=out.device, dtype=out.dtype).reshape(out.shape)
    out.backward(seed)
    return out.detach(), h.grad.detach(), w.grad.detach(), seed


def _assert_equivalent(hidden, weight, target, vstart, vend, tp_group, chunk_size):
    fp32_weight = weight.dtype == torch.float32
    out_f, gh_f, gw_f, seed = _fused_fb(hidden, weight, target, vstart, vend, tp_group, chunk_size, "split" if fp32_weight else None)
    out_r, gh_r, gw_r, _ = fused_reference(hidden, weight, target, vstart, vend, tp_group, chunk_size)
    assert out_f.dtype == torch.float32
    assert gh_f.dtype == hidden.dtype and gw_f.dtype == weight.dtype
    V = weight.shape[0]
    oov = (target < 0) | (target >= V)
    assert bool((out_f[oov] == 0).all())
    lp64, dh64, dw64 = float64_reference(hidden.cpu(), weight.cpu(), target.cpu(), vstart, vend, seed.cpu())
    if fp32_weight:
        # Upstream's bounds, as is (precision="split": fp32-grade logits).
        torch.testing.assert_close(out_f, out_r, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gh_f.float(), gh_r.float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(gw_f.float(), gw_r.float(), atol=2e-3, rtol=2e-3)
    else:
        # The reference rounds its logits to bf16 (upstream's file fails its 1e-5 here): the op is
        # held to float64 below; both deviations are printed for the README's list.
        d_ref = float((out_r.double().cpu() - lp64).abs().max())
        d_op = float((out_f.double().cpu() - lp64).abs().max())
        print(f"bf16 weight, chunk {chunk_size}: max |reference - float64| = {d_ref:.2e}, max |op - float64| = {d_op:.2e}, max |op - reference| = {float((out_f - out_r).abs().max()):.2e}")
    # The float64 contract of the same inputs (exact on CPU up to output rounding; on the GPU,
    # the kernels' accumulation).
    on_cpu = hidden.device.type == "cpu"
    split = hidden.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
    close(out_f, lp64, 0.0, (1e-4 if split else 2e-6) if on_cpu else 2e-4, "logprob vs f64")
    rt = lambda dt: 2.0**-8 + 1e-6 if dt == torch.bfloat16 else 1e-3  # noqa: E731
    at = (5e-5 if split else 1e-6) if on_cpu else 2e-3
    close(gh_f, dh64, rt(gh_f.dtype) if on_cpu else 2e-2, at, "grad_hidden vs f64")
    close(gw_f, dw64, rt(gw_f.dtype) if on_cpu else 2e-2, at, "grad_weight vs f64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=["bf16-fp32", "fp32-fp32"])
def test_fp32_weight_default_contract(tp_group, device, hidden_dtype):
    """Upstream's fp32-weight cases under the default ``precision="bf16"``: the weight (and an
    fp32 hidden) rounded once to bf16. The op then equals the call on the rounded operands
    bitwise, matches the float64 of those at the bf16 path's bounds, and returns an fp32
    ``grad_weight``; upstream's 1e-5 against an fp32 reference is not this contract."""
    torch.manual_seed(0)
    B, S, V = 4, 32, 4096
    hidden = torch.randn(B, S, H, dtype=hidden_dtype).to(device)
    weight = (torch.randn(V, H, dtype=torch.float32) * (H**-0.5)).to(device)
    target = torch.randint(0, V + 1024, (B, S), dtype=torch.long).to(device)
    out, gh, gw, seed = _fused_fb(hidden, weight, target, 0, V, tp_group, 64)
    assert gh.dtype == hidden_dtype and gw.dtype == torch.float32
    hb, wb = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    out_b, _, _, _ = _fused_fb(hb, wb, target, 0, V, tp_group, 64)
    assert torch.equal(out, out_b)
    lp64, dh64, dw64 = float64_reference(hb.cpu(), wb.cpu(), target.cpu(), 0, V, seed.cpu())
    on_cpu = device == "cpu"
    close(out, lp64, 0.0, 2e-6 if on_cpu else 2e-4, "logprob vs f64 of the rounded operands")
    close(gh, dh64, 2.0**-8 + 1e-6 if hidden_dtype == torch.bfloat16 else 1e-5, 1e-6 if on_cpu else 2e-3, "grad_hidden")
    close(gw, dw64, 1e-5 if on_cpu else 2e-2, 1e-6 if on_cpu else 2e-3, "grad_weight")
    # How far the rounding moves the result from the fp32 reference (printed for the README).
    out_r, _, _, _ = fused_reference(hidden, weight, target, 0, V, tp_group, 64)
    print(f"fp32 weight, default contract: max |op - fp32 reference| = {float((out - out_r).abs().max()):.2e}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 512])
@pytest.mark.parametrize("with_oov_targets", [False, True])
@pytest.mark.parametrize(
    "hidden_dtype, weight_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
    ids=["bf16-bf16", "bf16-fp32", "fp32-fp32"],
)
def test_fused_matches_materialized_logits(tp_group, device, chunk_size, with_oov_targets, hidden_dtype, weight_dtype):
    if device == "cpu" and chunk_size in (1, 64):
        pytest.skip("chunk_size does not change the op; the CPU run keeps 7 and 512 (upstream's four run on the GPU)")
    torch.manual_seed(0)
    B, S, V = 4, 32, 4096
    target_high = V + 1024 if with_oov_targets else V
    hidden = torch.randn(B, S, H, dtype=hidden_dtype).to(device)
    weight = (torch.randn(V, H, dtype=weight_dtype) * (H**-0.5)).to(device)
    target = torch.randint(0, target_high, (B, S), dtype=torch.long).to(device)
    if with_oov_targets:
        assert bool(((target >= V)).any())
    _assert_equivalent(hidden, weight, target, 0, V, tp_group, chunk_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param((1, 1, 1024, 4, "default"), id="seq1"),
        pytest.param((2, 8, 1024, 32, "all_in"), id="all_in_vocab"),
        pytest.param((2, 8, 1024, 32, "all_out"), id="all_out_vocab"),
        pytest.param((2, 8, 8, 4, "default"), id="tiny_vocab"),
    ],
)
def test_fused_matches_materialized_logits_edge_cases(tp_group, device, case):
    B, S, V, chunk_size, mask_mode = case
    torch.manual_seed(1)
    hidden = torch.randn(B, S, H, dtype=torch.bfloat16).to(device)
    weight = (torch.randn(V, H, dtype=torch.float32) * (H**-0.5)).to(device)
    if mask_mode == "all_out":
        target = torch.full((B, S), V + 5, dtype=torch.long).to(device)
    else:
        target = torch.randint(0, V, (B, S), dtype=torch.long).to(device)
    _assert_equivalent(hidden, weight, target, 0, V, tp_group, chunk_size)


@needs_gpu
@pytest.mark.gpu
def test_fused_forward_matches_liger_flce(tp_group):
    liger = pytest.importorskip("liger_kernel.ops.fused_linear_cross_entropy")
    torch.manual_seed(2)
    B, S, V = 2, 16, 4096
    hidden = torch.randn(B, S, H, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(V, H, dtype=torch.bfloat16, device="cuda") * (H**-0.5)
    target = torch.randint(0, V, (B, S), device="cuda", dtype=torch.long)
    out_f, _, _, _ = _fused_fb(hidden, weight, target, 0, V, tp_group, 64)
    flce = liger.LigerFusedLinearCrossEntropyFunction.apply
    ce = flce(hidden.reshape(B * S, H), weight, target.reshape(B * S), None, None, -100, 0.0, 0.0, "none")
    ce = ce[0] if isinstance(ce, tuple) else ce
    torch.testing.assert_close(out_f.reshape(-1), (-ce).float(), atol=1e-2, rtol=1e-2)


def test_inference_only_and_bad_arguments(tp_group):
    hidden = torch.randn(2, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(20, 16, dtype=torch.bfloat16)
    target = torch.randint(0, 20, (2, 4))
    out = L.FusedLinearLogprob.apply(hidden, weight, target, 0, 20, 8, tp_group, True)
    assert out.shape == (2, 4) and out.dtype == torch.float32 and not out.requires_grad
    with pytest.raises(ValueError, match="rows"):
        L.FusedLinearLogprob.apply(hidden, weight, target, 0, 19, 8, tp_group, False)
    with pytest.raises(ValueError, match="chunk_size"):
        L.FusedLinearLogprob.apply(hidden, weight, target, 0, 20, 0, tp_group, False)
    with pytest.raises(ValueError, match="target"):
        L.FusedLinearLogprob.apply(hidden, weight, target[:, :3], 0, 20, 8, tp_group, False)
    # A non-contiguous hidden (Megatron's [S, B, H] transposed) is accepted, as upstream.
    hs = torch.randn(4, 2, 16, dtype=torch.bfloat16).transpose(0, 1)
    out = L.FusedLinearLogprob.apply(hs, weight, target, 0, 20, 8, None, False)
    lp64, _, _ = float64_reference(hs, weight, target, 0, 20, torch.ones(2, 4))
    close(out, lp64, 0.0, 2e-6, "transposed hidden")


# ---------------------------------------------------------------------------------------------
# Tensor parallel
# ---------------------------------------------------------------------------------------------

TRITON_CASES = [(c, o, d) for d in ("fp32", "bf16") for c in (8, 1000) for o in (False, True)]


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_triton_matches_stock_logits_path_cpu(world_size):
    """test 1 on CPU tensors over gloo: all 8 (dtype, chunk, OOV) cases of one TP size share one
    spawned group."""
    run_tp_cases(
        world_size,
        [("skyrl_triton_tp", dict(chunk_size=c, with_oov=o, dtype_str=d)) for c, o, d in TRITON_CASES],
        "cpu",
        "gloo",
    )


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_triton_matches_stock_logits_path_gpu_gloo(world_size):
    """test 1 as upstream runs it: gloo, every rank on cuda:0."""
    run_tp_cases(
        world_size,
        [("skyrl_triton_tp", dict(chunk_size=c, with_oov=o, dtype_str=d)) for c, o, d in TRITON_CASES],
        "cuda0",
        "gloo",
    )


def test_fused_linear_logprob_tp_cpu():
    """test 2's ``_distributed_main`` at TP = 2 over gloo on CPU tensors."""
    run_tp_cases(2, [("skyrl_fused_tp", {})], "cpu", "gloo")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_fused_linear_logprob_tp_nccl(nproc):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs >= {nproc} GPUs, have {torch.cuda.device_count()}")
    run_tp_cases(nproc, [("skyrl_fused_tp", {})], "cuda", "nccl")
