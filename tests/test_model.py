"""The transformer: document masking isolates documents, init, weight tying, GQA, presets' sizes, the padded
vocabulary, RoPE's base."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardkit.train.config import ModelConfig, config_from_dict
from shardkit.train.attention import document_attention_mask, document_positions
from shardkit.train.model import Transformer, flops_per_token

VOCAB, SEQ = 97, 48


def make_model(style: str, document_mask: bool, **extra) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(style=style, vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=32,
                         document_mask=document_mask, **extra)
    return Transformer(config).eval()


def test_document_positions_and_mask():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    mask = document_attention_mask(seg)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[2].tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_document_mask_blocks_attention_across_documents(style):
    """Perturbing the tokens of one document changes no other document's logits when masking is on,
    and does change later documents' logits when it is off (so the check can fail)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    # Sample 0: three documents [0, 10), [10, 30), [30, 48); sample 1: one document.
    seg = torch.zeros(2, SEQ, dtype=torch.int32)
    seg[0, 10:30], seg[0, 30:] = 1, 2
    perturbed = tokens.clone()
    perturbed[0, 10:30] = (tokens[0, 10:30] + 1 + torch.randint(0, VOCAB - 1, (20,), generator=gen)) % VOCAB
    masked = make_model(style, document_mask=True)
    with torch.no_grad():
        before, after = masked(tokens, seg), masked(perturbed, seg)
    others = torch.ones(SEQ, dtype=torch.bool)
    others[10:30] = False
    assert torch.equal(before[0, others], after[0, others])  # documents 0 and 2: bitwise unchanged
    assert torch.equal(before[1], after[1])
    assert not torch.allclose(before[0, 10:30], after[0, 10:30])  # the perturbed document itself changes

    # A document alone in its own sample gives the same logits as inside the packed sample.
    alone = masked(tokens[:1, 30:], torch.zeros(1, SEQ - 30, dtype=torch.int32))
    torch.testing.assert_close(alone[0], before[0, 30:], rtol=1e-5, atol=1e-5)

    unmasked = make_model(style, document_mask=False)
    with torch.no_grad():
        before, after = unmasked(tokens, seg), unmasked(perturbed, seg)
    assert torch.equal(before[0, :10], after[0, :10])  # causality: earlier tokens never see later ones
    assert not torch.allclose(before[0, 30:], after[0, 30:], atol=1e-4)  # the leak masking prevents


def test_document_mask_requires_segment_ids():
    with pytest.raises(ValueError, match="--document-mask"):
        make_model("llama", document_mask=True)(torch.zeros(1, 4, dtype=torch.long))


def test_weight_tying_init_and_gqa():
    model = make_model("llama", document_mask=False, n_kv_head=2)
    assert model.lm_head.weight is model.tok_emb.weight
    attn = model.blocks[0].attn
    assert (attn.q.out_features, attn.k.out_features, attn.v.out_features) == (4 * 8, 2 * 8, 2 * 8)
    out_std = model.blocks[0].mlp.down.weight.std().item()
    assert 0.02 / 2 * 0.7 < out_std < 0.02 / 2 * 1.3  # residual projections scaled by 1/sqrt(2 * n_layer)
    logits = model(torch.randint(0, VOCAB, (2, SEQ)))
    assert logits.shape == (2, SEQ, 128)  # the vocabulary padded to a multiple of 128
    # Near-uniform predictions at init: the loss starts close to log(vocab) (the padding is never predicted).
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.randint(0, VOCAB, (2 * SEQ,)))
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.2


def test_padded_vocabulary_takes_no_probability_and_no_gradient():
    """GPT-2's 50257 becomes 50304 rows; here 97 becomes 128. The padding ids' logits are -inf, so the loss is
    the loss over the real vocabulary, a sampler never draws them, and their (tied) rows get no gradient."""
    assert ModelConfig(vocab_size=50257).padded_vocab_size == 50304
    assert ModelConfig(vocab_size=50257, make_vocab_size_divisible_by=1).padded_vocab_size == 50257
    model = make_model("llama", document_mask=False).train()
    assert model.tok_emb.weight.shape[0] == model.config.padded_vocab_size == 128
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    assert torch.isneginf(logits[..., VOCAB:]).all() and torch.isfinite(logits[..., :VOCAB]).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    real_only = torch.nn.functional.cross_entropy(logits[..., :VOCAB].flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(real_only.item(), rel=1e-6)
    drawn = torch.multinomial(logits[:, -1].detach().softmax(-1), 2000, replacement=True)
    assert drawn.max() < VOCAB
    loss.backward()
    grad = model.tok_emb.weight.grad
    assert grad[VOCAB:].abs().max() == 0 and grad[:VOCAB].abs().max() > 0


def test_rope_theta_is_honoured():
    """The rotary tables are not saved (derived from the config): a model built with another --rope-theta
    computes other positions, and the same theta gives the same tables."""
    base, other = (make_model("llama", document_mask=False, rope_theta=theta) for theta in (10000.0, 500.0))
    assert not torch.equal(base.rope.cos, other.rope.cos)
    tokens = torch.randint(0, VOCAB, (1, SEQ))
    other.load_state_dict(base.state_dict())
    assert not torch.allclose(base(tokens), other(tokens))
    assert torch.equal(make_model("llama", document_mask=False, rope_theta=500.0).rope.cos, other.rope.cos)
    angle = 1.0 / 500.0 ** (2 / 8)  # position 1, second frequency of head size 8
    assert other.rope.cos[1, 1].item() == pytest.approx(torch.cos(torch.tensor(angle)).item(), rel=1e-6)


def test_sequence_longer_than_model_is_rejected():
    with pytest.raises(ValueError, match="--seq-len"):
        make_model("gpt2", document_mask=False)(torch.zeros(1, SEQ + 1, dtype=torch.long))


@pytest.mark.parametrize("preset, vocab, expected", [
    ("tiny", 256, (0.05e6, 1e6)), ("gpt2-124m", 50257, (123e6, 125e6)), ("gpt2-350m", 50257, (350e6, 360e6)),
    ("llama-1b", 128256, (1.2e9, 1.3e9)),
])
def test_preset_sizes(preset, vocab, expected):
    config = dataclasses.replace(config_from_dict({"preset": preset}).model, vocab_size=vocab, seq_len=1024)
    with torch.device("meta"):  # no memory for the large presets
        model = Transformer(config)
    assert expected[0] < model.num_parameters() < expected[1]
    assert flops_per_token(config, model.num_parameters()) > 6 * model.num_parameters()
