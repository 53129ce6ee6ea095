"""SkyRL's materialised-logits references, ported for the tests (not collected by pytest).

From NovaSky-AI/SkyRL ``skyrl/backends/skyrl_train/distributed/megatron/model_utils.py``
(Apache-2.0; itself from NeMo-RL / NeMo-Aligner): ``_compute_distributed_log_softmax``,
``DistributedLogprob`` and ``ChunkedDistributedLogprob`` — the "stock" path that SkyRL's
``tests/backends/skyrl_train/gpu/gpu_ci/megatron/test_fused_linear_logprob.py`` and
``test_fused_linear_logprob_triton.py`` hold their fused ops to. Unchanged in substance; the
``scatter_add_`` fast paths are written with plain indexing.
"""

import torch
import torch.distributed as dist


@torch.no_grad()
def _compute_distributed_log_softmax(vocab_parallel_logits, group):
    logits_max = torch.amax(vocab_parallel_logits, dim=-1, keepdim=True)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    vocab_parallel_logits = vocab_parallel_logits - logits_max
    sum_exp_logits = vocab_parallel_logits.exp().sum(-1, keepdim=True).float()
    dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=group)
    return vocab_parallel_logits - sum_exp_logits.log_().to(vocab_parallel_logits.dtype)


class ChunkedDistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only=False):
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0
        seq_size = int(vocab_parallel_logits.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        all_log_probs = []
        for chunk_idx in range(num_chunks):
            s, e = chunk_idx * chunk_size, min(seq_size, (chunk_idx + 1) * chunk_size)
            logits = vocab_parallel_logits[:, s:e, :].to(dtype=torch.float32)
            log_probs = _compute_distributed_log_softmax(logits, group=tp_group)
            log_probs = torch.gather(log_probs, -1, masked_target[:, s:e].unsqueeze(-1)).squeeze(-1)
            log_probs[target_mask[:, s:e]] = 0.0
            dist.all_reduce(log_probs, op=dist.ReduceOp.SUM, group=tp_group)
            all_log_probs.append(log_probs)
        log_probs = torch.cat(all_log_probs, dim=1)
        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits, target_mask, masked_target)
            ctx.chunk_size = chunk_size
            ctx.tp_group = tp_group
        return log_probs

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_output = grad_outputs[0]
        vocab_parallel_logits, target_mask, masked_target = ctx.saved_tensors
        chunk_size, tp_group = ctx.chunk_size, ctx.tp_group
        seq_size = int(vocab_parallel_logits.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        grad_input = torch.empty(vocab_parallel_logits.shape, dtype=torch.float32, device=vocab_parallel_logits.device)
        for chunk_idx in range(num_chunks):
            s, e = chunk_idx * chunk_size, min(seq_size, (chunk_idx + 1) * chunk_size)
            logits = vocab_parallel_logits[:, s:e, :].to(dtype=torch.float32)
            softmax = _compute_distributed_log_softmax(logits, group=tp_group).exp()
            g = grad_output[:, s:e].unsqueeze(-1)
            chunk_grad = -softmax * g
            valid = ~target_mask[:, s:e]
            onehot = torch.zeros_like(chunk_grad)
            onehot.scatter_(-1, masked_target[:, s:e].unsqueeze(-1), 1.0)
            chunk_grad = chunk_grad + onehot * valid.unsqueeze(-1) * g
            grad_input[:, s:e, :] = chunk_grad
        return grad_input, None, None, None, None, None, None


def fused_reference(hidden, weight, target, vstart, vend, tp_group, chunk_size, grad_seed=None):
    """SkyRL's ``_reference_fb`` (test_fused_linear_logprob.py): logits = hidden.to(w.dtype) @ wᵀ
    through ``ChunkedDistributedLogprob``, backward with ``grad_seed`` (default: linspace(0.5,
    1.5)). Returns ``(logprob, grad_hidden, grad_weight, grad_seed)``."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logits = torch.matmul(h.to(w.dtype), w.t())
    out = ChunkedDistributedLogprob.apply(logits, target, vstart, vend, chunk_size, tp_group, False)
    if grad_seed is None:
        grad_seed = torch.linspace(0.5, 1.5, steps=out.numel(), device=out.device, dtype=out.dtype).reshape(out.shape)
    out.backward(grad_seed)
    return out.detach(), h.grad.detach(), w.grad.detach(), grad_seed


def stock_shifted(hidden, weight, target, vstart, vend, chunk_size, group):
    """SkyRL's ``_stock_shifted`` (test_fused_linear_logprob_triton.py): logits ``h @ wᵀ`` in the
    inputs' dtype (bf16 logits are rounded to bf16 there), chunked when ``chunk_size < S``."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logits = h @ w.t()
    seq_len = logits.shape[1]
    cs = chunk_size if (chunk_size is not None and chunk_size < seq_len) else seq_len
    lp = ChunkedDistributedLogprob.apply(logits, target, vstart, vend, cs, group, False)
    grad_seed = torch.linspace(0.5, 1.5, steps=lp.numel(), device=lp.device, dtype=lp.dtype).reshape(lp.shape)
    lp.backward(grad_seed)
    return lp.detach(), h.grad.detach(), w.grad.detach(), grad_seed


def float64_reference(hidden, weight_full, target, vstart, vend, grad_seed):
    """SkyRL's contract in float64 over the full vocabulary: log-prob of in-vocab targets, 0 for
    targets outside it; d-logits ``g·(onehot − p)`` with no one-hot for those; ``grad_hidden``
    this rank's partial sum over ``[vstart, vend)``, ``grad_weight`` those rows."""
    B, S, H = hidden.shape
    h = hidden.detach().to(torch.float64).reshape(B * S, H)
    w = weight_full.detach().to(torch.float64)
    V = w.shape[0]
    t = target.reshape(-1)
    z = h @ w.T
    logp = torch.log_softmax(z, -1)
    oov = (t < 0) | (t >= V)
    tc = t.clamp(0, V - 1)
    lp = torch.where(oov, torch.zeros_like(t, dtype=torch.float64), logp.gather(1, tc[:, None]).squeeze(1))
    g = grad_seed.reshape(-1).to(torch.float64)
    onehot = torch.zeros_like(z)
    rows = (~oov).nonzero().squeeze(1)
    onehot[rows, t[rows]] = 1.0
    dl = g[:, None] * (onehot - logp.exp())
    dh = dl[:, vstart:vend] @ w[vstart:vend]
    dw = dl[:, vstart:vend].T @ h
    return lp.reshape(B, S), dh.reshape(B, S, H), dw
