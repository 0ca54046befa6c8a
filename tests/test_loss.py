"""The chunked linear + cross-entropy: the plain path's loss and gradients (fp32 to rounding, bf16 autocast to
bf16's precision), for both reductions, ignored targets and the padded vocabulary; the model's loss path; and
the memory it saves, measured from torch's own allocation events."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.train import loss as loss_module
from shardkit.train.config import ModelConfig
from shardkit.train.loss import IGNORE_INDEX, linear_cross_entropy
from shardkit.train.model import Transformer
from memory_peak import peak_tensor_bytes

TOKENS, D_MODEL, VOCAB, PADDING = 700, 32, 1000, 24


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, D_MODEL, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(VOCAB, D_MODEL, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, VOCAB - PADDING, (TOKENS,), generator=gen)
    targets[::5] = IGNORE_INDEX
    bias = torch.zeros(VOCAB).masked_fill(torch.arange(VOCAB) >= VOCAB - PADDING, float("-inf"))
    return hidden, weight, targets, bias


def _plain(hidden, weight, targets, bias, reduction):
    return F.cross_entropy((F.linear(hidden, weight).float() + bias), targets, reduction=reduction)


def _loss_and_grads(fn, hidden, weight, *args, scale=1.0):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, *args)
    (loss * scale).backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_tokens", [96, 700, 4096])  # a remainder chunk, one exact chunk, fewer tokens
def test_fp32_loss_and_gradients_match_the_plain_path(reduction, chunk_tokens):
    hidden, weight, targets, bias = _inputs()

    def chunked(h, w, t, b, r):
        return linear_cross_entropy(h, w, t, bias=b, reduction=r, chunk_tokens=chunk_tokens)

    # An incoming gradient other than 1 (the loop scales by 1 / grad_accum) must reach both gradients.
    expected = _loss_and_grads(_plain, hidden, weight, targets, bias, reduction, scale=0.25)
    actual = _loss_and_grads(chunked, hidden, weight, targets, bias, reduction, scale=0.25)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: no gradients computed, the same loss
        torch.testing.assert_close(chunked(hidden, weight, targets, bias, reduction), expected[0],
                                   rtol=1e-5, atol=1e-7)


def test_padded_rows_and_ignored_targets_get_nothing():
    hidden, weight, targets, bias = _inputs()
    _, grad_hidden, grad_weight = _loss_and_grads(
        lambda h, w: linear_cross_entropy(h, w, targets, bias=bias, chunk_tokens=96), hidden, weight)
    assert not grad_weight[VOCAB - PADDING:].any()  # padded vocabulary rows: no gradient
    assert not grad_hidden[targets == IGNORE_INDEX].any()  # positions without a target: no gradient
    assert grad_hidden[targets != IGNORE_INDEX].abs().sum(dim=1).min() > 0


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("autocast, inputs, loss_scale", [
    (torch.bfloat16, torch.float32, 1.0),  # bf16 autocast
    (torch.float16, torch.float32, 65536.0),  # fp16 autocast and its loss scale
    (None, torch.float16, 65536.0),  # FSDP's fp16 parameters: no autocast, the matrix and hidden state in fp16
])
def test_16_bit_matches_the_plain_path_to_its_precision(device, autocast, inputs, loss_scale):
    """With fp16, a loss scale of 65536 does not fit in fp16 and a softmax times 1 / (tokens counted)
    underflows it: the gradients must still be the plain path's, neither zero nor inf. The rows of vocabulary
    entries that are no target get gradient only from the softmax, the smallest terms."""
    tokens, vocab, never = 8192, 1000, 400
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, D_MODEL, generator=gen).to(device, inputs).requires_grad_()
    weight = (torch.randn(vocab, D_MODEL, generator=gen) * 0.1).to(device, inputs).requires_grad_()
    targets = torch.randint(0, vocab - never, (tokens,), generator=gen).to(device)
    bias = torch.zeros(vocab, device=device)
    with torch.autocast(device, dtype=autocast or torch.float16, enabled=autocast is not None):
        expected = _loss_and_grads(_plain, hidden, weight, targets, bias, "mean", scale=loss_scale)
        actual = _loss_and_grads(lambda h, w, t, b: linear_cross_entropy(h, w, t, bias=b, chunk_tokens=1000),
                                 hidden, weight, targets, bias, scale=loss_scale)
    assert actual[1].dtype == hidden.dtype and actual[2].dtype == weight.dtype
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-3, atol=0)
    for got, want in (*zip(actual[1:], expected[1:]), (actual[2][-never:], expected[2][-never:])):
        got, want = got.float(), want.float()
        assert torch.isfinite(got).all() and got.abs().max() > 0
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_the_models_loss_path_matches_its_logits(monkeypatch):
    """`Transformer(tokens, targets=...)` (the path the trainer takes) gives the loss and every parameter's
    gradient of cross-entropy on its logits, with the padded vocabulary and tied embeddings."""
    monkeypatch.setattr(loss_module, "LOGITS_PER_CHUNK", 7 * 256)  # 7 tokens per chunk: several chunks
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=250, seq_len=16, n_layer=2, n_head=2, d_model=16))
    assert model.padding_bias is not None
    tokens = torch.randint(0, 250, (3, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :4] = IGNORE_INDEX

    def grads():
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
    plain.backward()
    expected = grads()
    model.zero_grad()
    chunked = model(inputs, targets=targets)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-7)
    for name, grad in grads().items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-7, msg=name)
    total = model(inputs, targets=targets, reduction="sum")
    torch.testing.assert_close(total, plain * (targets != IGNORE_INDEX).sum(), rtol=1e-5, atol=1e-5)


def test_peak_memory_holds_a_chunk_not_the_logits():
    """Forward and backward of the loss: the plain path holds several [tokens, vocab] fp32 tensors at
    once; the chunked one about one chunk's worth on top of its inputs and gradients."""
    tokens, vocab, chunk = 2048, 4096, 128
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, D_MODEL, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, D_MODEL, generator=gen) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    logits_bytes = tokens * vocab * 4

    def run(fn):
        return peak_tensor_bytes(lambda: fn().backward())

    plain = run(lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets))
    chunked = run(lambda: linear_cross_entropy(hidden, weight, targets, chunk_tokens=chunk))
    assert plain >= 2 * logits_bytes
    # Inputs and their gradients (fp32 d_model x vocab) plus a few chunk-sized tensors.
    assert chunked <= 4 * (tokens + vocab) * D_MODEL * 4 + 6 * chunk * vocab * 4, (chunked, plain)
    assert chunked < logits_bytes
