"""verl's float references, ported for the tests (not collected by pytest).

From volcengine/verl ``tests/utils/test_linear_cross_entropy.py`` (``run_torch_entropy``) and
``tests/utils/test_special_linear_cross_entropy_tp.py`` (``TorchEntropyTP``), Apache-2.0. The
computation is unchanged; ``dtype`` lets the tests run it in float64 as well as float32.
"""

import torch
import torch.distributed as dist


def run_torch_entropy(hidden, weight, labels, temperature, reduction="none", dtype=torch.float32):
    hidden = hidden.squeeze(0).to(dtype)
    if hidden.dim() > 2:
        hidden = hidden.reshape(-1, hidden.shape[-1])
    weight = weight.transpose(0, 1).to(dtype)
    logits = torch.matmul(hidden, weight)  # [num_tokens, vocab_size]
    logits /= temperature
    pd = torch.nn.functional.softmax(logits, dim=-1)
    entropy_a = torch.logsumexp(logits, dim=-1)
    entropy_b = torch.sum(pd * logits, dim=-1)
    entropy = entropy_a - entropy_b
    logprobs = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction=reduction)
    logprobs = torch.neg(logprobs)
    return logprobs, entropy


class TorchEntropyTP(torch.autograd.Function):
    """verl's TP reference: all-gathers the logits; backward returns this rank's partial d_hidden
    (verl all-reduces it outside) and this rank's d_weight rows."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, dist_process_group, dtype=torch.float32):
        ctx.original_hidden_shape = hidden.shape
        if len(hidden.shape) > 2:
            hidden = hidden.view(-1, hidden.shape[-1])
        if len(labels.shape) > 1:
            labels = labels.view(-1)
        logits = torch.matmul(hidden.to(dtype), weight.to(dtype).T)
        logits /= temperature
        world = dist.get_world_size(dist_process_group)
        whole_logits = torch.empty((logits.shape[0], logits.shape[1] * world), dtype=logits.dtype, device=logits.device)
        whole_logits_ref = [whole_logits[:, i * logits.shape[1] : (i + 1) * logits.shape[1]] for i in range(world)]
        parts = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(parts, logits, group=dist_process_group)
        for dst, src in zip(whole_logits_ref, parts):
            dst.copy_(src)
        pd = torch.nn.functional.softmax(whole_logits, dim=-1)
        entropy_a = torch.logsumexp(whole_logits, dim=-1)
        entropy_b = torch.sum(pd * whole_logits, dim=-1)
        entropy = entropy_a - entropy_b
        logprobs = torch.neg(torch.nn.functional.cross_entropy(whole_logits, labels, reduction="none"))
        ctx.save_for_backward(hidden, weight, labels, whole_logits, entropy_b)
        ctx.dist_process_group = dist_process_group
        ctx.temperature = temperature
        ctx.dtype = dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy):
        hidden, weight, labels, whole_logits, entropy_b = ctx.saved_tensors
        temperature, dtype = ctx.temperature, ctx.dtype
        vocab_size = weight.shape[0]
        rank = dist.get_rank(ctx.dist_process_group)
        maximum, _ = torch.max(whole_logits, dim=-1, keepdim=True)
        exp_logits = torch.exp(whole_logits - maximum)
        accumulate = exp_logits.sum(dim=-1, keepdim=True)
        pd = exp_logits / accumulate
        d_logits_entropy = g_entropy.to(dtype).unsqueeze(1) * (-pd * (whole_logits - entropy_b.unsqueeze(1)))
        one_hot = torch.zeros_like(whole_logits)
        one_hot.scatter_(1, labels.unsqueeze(1), 1)
        d_logits_logprobs = torch.neg(g_logprobs.to(dtype)).unsqueeze(1) * (pd - one_hot)
        d_logits = (d_logits_entropy + d_logits_logprobs) / temperature
        local_d_logits = d_logits[:, rank * vocab_size : (rank + 1) * vocab_size]
        d_hidden = torch.matmul(local_d_logits, weight.to(dtype)).view(ctx.original_hidden_shape)
        d_weight = torch.matmul(local_d_logits.T, hidden.to(dtype))
        return d_hidden, d_weight, None, None, None, None


def run_torch_entropy_tp(hidden, weight, labels, temperature, group, dtype=torch.float32):
    return TorchEntropyTP.apply(hidden, weight, labels, temperature, group, dtype)
