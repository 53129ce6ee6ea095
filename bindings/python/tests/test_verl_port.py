"""verl's two tests of ``linear_cross_entropy``, ported to ``lmhead_torch.linear_cross_entropy``.

Upstream (volcengine/verl):
- ``tests/utils/test_linear_cross_entropy.py`` — ``TestLinearCrossEntropy.verify_correctness``:
  bf16 ``hidden [1, N, H]``, ``weight [V, H]`` uniform(-0.5, 0.5), temperature 1.5, the kernel
  against ``run_torch_entropy`` (fp32 torch): logprobs ``atol 1e-3, rtol 2e-4``, entropy
  ``atol 5e-3, rtol 5e-4``; gradients for bf16 upstream grads ``g_entropy`` uniform(-0.5, 0.5),
  ``g_logprobs`` uniform(-1, 1): ``atol 2e-2, rtol 4e-2``; ``check_storage`` (peak memory).
  The five upstream shapes run on a GPU (``test_verl_shapes_gpu``); CPU runs smaller shapes.
- ``tests/utils/test_special_linear_cross_entropy_tp.py`` —
  ``TestLinearCrossEntropy_TensorParallel.verify_kernel_correctness``: TP over a process group,
  ``vocab_size`` rows per rank, inputs broadcast from rank 0, ``d_hidden`` all-reduced by the
  test; forward ``atol 1e-1, rtol 1e-2``, gradients ``atol 2e-2, rtol 4e-2``
  (``tp_workers.verl_tp``). Upstream runs it under torchrun with NCCL; here: gloo on CPU (CI),
  gloo with both ranks on one GPU, NCCL on two GPUs.

On CPU the float64 backend is also held to float64 references (``tol="tight"``). Reductions
``"sum"`` / ``"mean"`` are checked against ``run_torch_entropy(reduction=...)``.
"""

import pytest
import torch

import lmhead_torch as L
from refs import close
from tp_workers import run_tp_cases
from verl_ref import run_torch_entropy

# (batch_size, num_tokens, hidden_size, vocab_size) of upstream test cases 0-4.
UPSTREAM_SHAPES = [(1, 1937, 3584, 152064), (1, 2169, 896, 151936), (1, 1530, 2048, 32256), (1, 1388, 4096, 102400), (1, 8192, 4096, 102400)]
CPU_SHAPES = [(1, 97, 256, 1000), (1, 64, 128, 513), (2, 24, 128, 300)]

GPU = L.gpu_supported()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU" if not torch.cuda.is_available() else "the library does not support this CUDA GPU")


def _inputs(shape, device, seed):
    b, n, h, v = shape
    torch.manual_seed(seed)
    hidden = torch.empty((b, n, h), dtype=torch.bfloat16, device=device).uniform_(-0.5, 0.5).requires_grad_()
    weight = torch.empty((v, h), dtype=torch.bfloat16, device=device).uniform_(-0.5, 0.5).requires_grad_()
    labels = torch.randint(0, v, (b, n), device=device)
    g_entropy = torch.empty((b * n,), dtype=torch.bfloat16, device=device).uniform_(-0.5, 0.5)
    g_logprobs = torch.empty((b * n,), dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    return hidden, weight, labels, g_entropy, g_logprobs


def _verify(shape, device, seed, iterations=1, tight=False):
    """``verify_correctness``: the kernel vs ``run_torch_entropy`` with upstream tolerances (and,
    ``tight``, vs the float64 reference at the CPU backend's precision)."""
    temperature = 1.5
    for i in range(iterations):
        hidden, weight, labels, g_entropy, g_logprobs = _inputs(shape, device, seed + i)
        t_lp, t_ent = run_torch_entropy(hidden, weight, labels, temperature)
        k_lp, k_ent = L.linear_cross_entropy(hidden, weight, labels, temperature)
        n = shape[0] * shape[1]
        assert k_lp.shape == (n,) and k_ent.shape == (n,) and k_lp.dtype == torch.float32 and k_ent.dtype == torch.float32
        torch.testing.assert_close(t_lp, k_lp, atol=1e-3, rtol=2e-4)
        torch.testing.assert_close(t_ent, k_ent, atol=5e-3, rtol=5e-4)
        d_t_h, d_t_w = torch.autograd.grad((t_ent, t_lp), (hidden, weight), (g_entropy, g_logprobs), retain_graph=False)
        d_k_h, d_k_w = torch.autograd.grad((k_ent, k_lp), (hidden, weight), (g_entropy, g_logprobs), retain_graph=False)
        assert d_k_h.shape == hidden.shape and d_k_h.dtype == torch.bfloat16 and d_k_w.dtype == torch.bfloat16
        torch.testing.assert_close(d_t_h, d_k_h, atol=2e-2, rtol=4e-2)
        torch.testing.assert_close(d_t_w, d_k_w, atol=2e-2, rtol=4e-2)
        if tight:
            r_lp, r_ent = run_torch_entropy(hidden.detach().requires_grad_(), weight.detach().requires_grad_(), labels, temperature, dtype=torch.float64)
            close(k_lp, r_lp.detach(), 1e-6, 2e-6, "logprobs vs f64")
            close(k_ent, r_ent.detach(), 1e-6, 2e-6, "entropy vs f64")
            h64 = hidden.detach().double().requires_grad_()
            w64 = weight.detach().double().requires_grad_()
            r_lp, r_ent = run_torch_entropy(h64, w64, labels, temperature, dtype=torch.float64)
            r_dh, r_dw = torch.autograd.grad((r_ent, r_lp), (h64, w64), (g_entropy.double(), g_logprobs.double()))
            close(d_k_h, r_dh, 2.0**-8 + 1e-6, 1e-7, "d_hidden vs f64")
            close(d_k_w, r_dw, 2.0**-8 + 1e-6, 1e-7, "d_weight vs f64")


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=[f"{b}x{n}x{h}x{v}" for b, n, h, v in CPU_SHAPES])
def test_verl_correctness_cpu(shape):
    _verify(shape, "cpu", 7, tight=True)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", range(5))
def test_verl_shapes_gpu(case):
    # Upstream iterates 5 times per case (MAX_TEST_CASES = 5); 2 keeps the run short.
    _verify(UPSTREAM_SHAPES[case], "cuda", 1000 * case, iterations=2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[needs_gpu, pytest.mark.gpu])])
@pytest.mark.parametrize("reduction", ["sum", "mean", "SUM"])
def test_verl_reductions(device, reduction):
    hidden, weight, labels, _, _ = _inputs((1, 40, 128, 300), device, 3)
    t_lp, _ = run_torch_entropy(hidden, weight, labels, 1.5, reduction=reduction.lower())
    k_lp, k_ent = L.linear_cross_entropy(hidden, weight, labels, 1.5, reduction)
    assert k_lp.dim() == 0 and k_lp.dtype == torch.float32 and k_ent.shape == (40,)
    torch.testing.assert_close(t_lp, k_lp, atol=1e-3, rtol=2e-4)
    d_t = torch.autograd.grad(t_lp, (hidden, weight))
    d_k = torch.autograd.grad(k_lp, (hidden, weight))
    for a, b in zip(d_t, d_k):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=4e-2)
    if reduction.lower() == "mean":
        s, _ = L.linear_cross_entropy(hidden, weight, labels, 1.5, "sum")
        torch.testing.assert_close(k_lp, s / 40)


def test_verl_bad_reduction():
    hidden, weight, labels, _, _ = _inputs((1, 4, 128, 30), "cpu", 3)
    with pytest.raises(ValueError, match="reduction"):
        L.linear_cross_entropy(hidden, weight, labels, 1.0, "avg")


def test_verl_returns_logprobs_not_their_negation():
    hidden, weight, labels, _, _ = _inputs((1, 16, 128, 64), "cpu", 4)
    lp, _ = L.linear_cross_entropy(hidden, weight, labels)
    assert bool((lp < 0).all())


@needs_gpu
@pytest.mark.gpu
def test_verl_storage_gpu():
    """``check_storage``: peak memory of the forward and backward, the kernel against torch
    (upstream prints them; here the kernel must stay below a quarter of torch's peak)."""
    shape = UPSTREAM_SHAPES[3]
    peaks = {}
    for name, fn in (("torch", run_torch_entropy), ("kernel", L.linear_cross_entropy)):
        torch.cuda.empty_cache()
        hidden, weight, labels, g_entropy, g_logprobs = _inputs(shape, "cuda", 5)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        lp, ent = fn(hidden, weight, labels, 1.5)
        torch.cuda.synchronize()
        fwd = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.grad((ent, lp), (hidden, weight), (g_entropy, g_logprobs))
        torch.cuda.synchronize()
        bwd = torch.cuda.max_memory_allocated() - base
        peaks[name] = (fwd, bwd)
        print(f"[INFO]: {name} forward peak {fwd / 2**20:.1f} MiB, backward peak {bwd / 2**20:.1f} MiB")
        del hidden, weight, lp, ent
    assert peaks["kernel"][0] < peaks["torch"][0] / 4
    assert peaks["kernel"][1] < peaks["torch"][1] / 4


# ---------------------------------------------------------------------------------------------
# Tensor parallel (test_special_linear_cross_entropy_tp.py)
# ---------------------------------------------------------------------------------------------


def test_verl_tp_cpu_gloo():
    run_tp_cases(
        2,
        [
            ("verl_tp", dict(num_tokens=96, hidden_size=256, vocab_size=512, tol="port", reference_dtype="fp32")),
            ("verl_tp", dict(num_tokens=64, hidden_size=128, vocab_size=300, tol="tight")),
        ],
        "cpu",
        "gloo",
    )


@needs_gpu
@pytest.mark.gpu
def test_verl_tp_one_gpu_gloo():
    run_tp_cases(2, [("verl_tp", dict(num_tokens=1530, hidden_size=2048, vocab_size=32256 // 2, reference_dtype="fp32"))], "cuda0", "gloo")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_verl_tp_nccl(case):
    b, n, h, v = UPSTREAM_SHAPES[case]
    run_tp_cases(2, [("verl_tp", dict(num_tokens=n, hidden_size=h, vocab_size=v, reference_dtype="fp32"))], "cuda", "nccl")
