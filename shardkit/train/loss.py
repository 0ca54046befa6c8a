"""Cross-entropy of the output projection, a chunk of tokens at a time: the [tokens, vocab] logits are never whole.

The plain way (`lm_head`, then `F.cross_entropy(logits.float())`) holds, for gpt2-124m's 16 x 1024 tokens
and its 50304-row vocabulary, 16-bit logits (1.6 GB), their fp32 copy (3.3 GB), log-softmax's fp32 output
kept for the backward (3.3 GB) and the gradients of both (4.9 GB): memory traffic, not FLOPs, bounds it.
`linear_cross_entropy` takes the final hidden state and the projection matrix instead and, for each chunk
of tokens, computes the chunk's logits (in the autocast dtype, as `lm_head` would), its losses in fp32,
and at once, since the softmax is at hand, the chunk's gradients with respect to the hidden state and
the matrix (Liger-Kernel's fused linear cross-entropy, in plain torch). The backward only scales those
gradients by the incoming one. The three matmuls per chunk are the ones the plain forward and backward
do, so FLOPs are unchanged, and memory holds one chunk of logits (`LOGITS_PER_CHUNK` elements) plus the
two gradients in fp32 (tokens x d_model and vocab x d_model). The 16-bit matmuls see softmax - one-hot,
within [-1, 1]; the mean's 1 / count and the incoming gradient (with fp16, the loss scale) multiply the
fp32 gradients in the backward, so neither underflows nor overflows a 16-bit intermediate.

Padding rows of the vocabulary get a -inf bias (`Transformer.padding_bias`), so they take no probability
and no gradient, and targets equal to `IGNORE_INDEX` count neither in the loss nor in the mean's
denominator, as with `F.cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
# Logits per chunk (tokens x vocabulary rows): 2^25 is 128 MiB in fp32, 1334 tokens of gpt2's 50304-row
# vocabulary, large enough that the chunk's matmuls keep a GPU busy and small enough to be noise in memory.
LOGITS_PER_CHUNK = 2 ** 25
REDUCTIONS = ("mean", "sum")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: torch.Tensor | None = None, reduction: str = "mean",
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)` without the whole logits.

    Args:
        hidden: [..., d_model] final hidden states (after the final norm).
        weight: [vocab, d_model] output projection.
        targets: [...] target ids; `IGNORE_INDEX` marks positions without a target.
        bias: [vocab] added to the logits (the padding rows' -inf), or None.
        reduction: 'mean' over the counted targets, or 'sum'.
        chunk_tokens: tokens per chunk; default: `LOGITS_PER_CHUNK` logits' worth.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    chunk = chunk_tokens or max(1, LOGITS_PER_CHUNK // weight.shape[0])
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if needs_grad:
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, reduction, chunk)
    return _chunked(hidden, weight, bias, targets, reduction, chunk, gradients=False)[0]


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
             reduction: str, chunk: int, *, gradients: bool):
    """(loss, d loss / d hidden, d loss / d weight, scale): with `gradients`, the gradients of the summed loss
    in fp32, to be multiplied by `scale` (1 / the counted targets for the mean, else 1) and the incoming
    gradient; otherwise None."""
    counted = targets != IGNORE_INDEX
    count = counted.sum()
    # 0/0 gives NaN, as F.cross_entropy's mean over no target does.
    scale = 1.0 / count.float() if reduction == "mean" else torch.ones((), device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # fp32 accumulators, scaled in the backward (see the module's docstring: fp16's loss scale is 65536).
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if gradients else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if gradients else None
    # Cast once, not once per chunk: the dtype lm_head's matmul would run in (autocast's, or the inputs').
    dtype = _matmul_dtype(hidden, weight)
    matrix = weight.to(dtype)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        h, t, keep = hidden[rows].to(dtype), targets[rows], counted[rows]
        raw = F.linear(h, matrix)
        logits = raw.float() if bias is None else raw.float() + bias
        del raw
        safe = t.masked_fill(~keep, 0)
        picked = logits.gather(1, safe[:, None])[:, 0]
        # Softmax in place (logsumexp would allocate another chunk-sized tensor).
        top = logits.amax(dim=-1, keepdim=True)
        sums = logits.sub_(top).exp_().sum(dim=-1)
        total += torch.where(keep, sums.log() + top[:, 0] - picked, 0.0).sum()
        if not gradients:
            continue
        # d loss / d logits = softmax - one-hot, zero on ignored rows.
        probs = logits.div_(sums[:, None])
        probs[torch.arange(len(t), device=t.device), safe] -= 1.0
        grad_logits = probs.mul_(keep[:, None]).to(dtype)
        del probs, logits
        grad_hidden[rows] = grad_logits @ matrix
        grad_weight += grad_logits.t() @ h
    loss = total / count if reduction == "mean" else total
    return loss, grad_hidden, grad_weight, scale


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` computes in (autocast's when on, else the inputs')."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """The gradients are computed in the forward, chunk by chunk, while the softmax is at hand."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, reduction, chunk):
        loss, grad_hidden, grad_weight, scale = _chunked(hidden, weight, bias, targets, reduction, chunk,
                                                         gradients=True)
        ctx.save_for_backward(grad_hidden, grad_weight, scale)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, scale = ctx.saved_tensors
        factor = grad_loss.float() * scale
        return (grad_hidden * factor).to(ctx.dtypes[0]), (grad_weight * factor).to(ctx.dtypes[1]), \
            None, None, None, None
