"""Document masking through flex_attention: the block mask means exactly the dense mask (read tile by tile as
the kernel reads it), builds nothing of size T x T, and gives the dense path's outputs through the model and
through torch's compiled kernel (CPU forward; flex_attention has no CPU backward in torch 2.13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.train import attention
from shardkit.train.attention import document_attention_mask, document_block_mask
from shardkit.train.config import ModelConfig
from shardkit.train.model import Transformer
from memory_peak import peak_tensor_bytes


def segments(lengths: list[list[int]], seq: int) -> torch.Tensor:
    """Segment ids [B, seq] from document lengths per row; the rest of a row is padding (-1)."""
    rows = []
    for row in lengths:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) if row else torch.empty(0)
        rows.append(torch.cat([ids, torch.full((seq - len(ids),), -1)]).long())
    return torch.stack(rows)


LAYOUTS = {
    # Documents that span tiles, start mid-tile, end exactly at a tile edge; padding at the end.
    "mixed": segments([[5, 40, 16, 3, 29, 7], [100], [16, 16, 16, 16, 16, 10]], 100),
    "one_document": segments([[64], [64]], 64),
    "tiny_documents": segments([[1] * 50 + [13]], 70),
    "padding_only_tail": segments([[33, 1]], 90),
}


def kernel_view(block_mask, seq: int, block: int) -> torch.Tensor:
    """The [B, T, T] mask a flex kernel applies: full tiles all True, listed partial tiles by mask_mod,
    unlisted tiles False."""
    kv_num, kv_idx = block_mask.kv_num_blocks[:, 0], block_mask.kv_indices[:, 0]
    full_num, full_idx = block_mask.full_kv_num_blocks[:, 0], block_mask.full_kv_indices[:, 0]
    batch, q_blocks = kv_num.shape
    out = torch.zeros(batch, seq, seq, dtype=torch.bool)
    q = torch.arange(seq)
    for b in range(batch):
        for qb in range(q_blocks):
            rows = slice(qb * block, min(seq, (qb + 1) * block))
            for kb in full_idx[b, qb, :full_num[b, qb]].tolist():
                out[b, rows, kb * block:(kb + 1) * block] = True
            for kb in kv_idx[b, qb, :kv_num[b, qb]].tolist():
                cols = torch.arange(kb * block, min(seq, (kb + 1) * block))
                allowed = block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q[rows][:, None], cols[None, :])
                out[b, rows, cols[0]:cols[-1] + 1] = allowed
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block", [8, 16, 128])
def test_block_mask_means_the_dense_mask(layout, block):
    ids = LAYOUTS[layout]
    seq = ids.shape[1]
    block_mask = document_block_mask(ids, block_size=block)
    assert torch.equal(kernel_view(block_mask, seq, block), document_attention_mask(ids)[:, 0])
    if block == 8 and layout == "mixed":
        # Tiles inside one long document are computed unmasked, tiles between documents skipped.
        assert block_mask.full_kv_num_blocks.sum() > 0
        assert (block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).sum() < ids.shape[0] * (seq // 8) ** 2 / 2


def test_building_the_block_mask_allocates_nothing_of_size_t_squared():
    seq = 4096
    ids = segments([[1000, 3000, 96]] * 2, seq)
    dense = peak_tensor_bytes(lambda: document_attention_mask(ids))
    flex = peak_tensor_bytes(lambda: document_block_mask(ids))
    assert dense >= 2 * seq * seq  # one byte per [B, T, T] element
    assert flex < 2 * seq * seq / 100, flex


def _model(**extra):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, seq_len=100, n_layer=2, n_head=4, d_model=32, document_mask=True, **extra)
    return Transformer(config).eval()


@pytest.mark.parametrize("extra", [{}, {"n_kv_head": 2}, {"style": "gpt2"}])
def test_the_model_gives_the_dense_paths_outputs_through_flex_attention(monkeypatch, extra):
    model = _model(**extra)
    ids = LAYOUTS["mixed"].int()
    tokens = torch.randint(0, 97, ids.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dense = model(tokens, ids)
        monkeypatch.setattr(attention, "FLEX_DEVICES", ("cuda", "cpu"))
        flex = model(tokens, ids)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)
    assert attention.document_mask(ids, dropout=0.1).dtype == torch.bool  # flex_attention has no dropout


@pytest.mark.slow  # compiles torch's CPU flex_attention kernel
def test_compiled_flex_kernel_matches_dense_sdpa():
    """The compiled kernel honours the tiles (full tiles skip mask_mod, unlisted tiles are skipped): a wrong
    tile classification changes its output, unlike eager flex_attention, which reads only mask_mod."""
    ids = LAYOUTS["mixed"]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 100, 16, generator=gen) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=document_attention_mask(ids))
    kernel = torch.compile(attention.flex_attention, dynamic=False)
    with torch.no_grad():
        actual = kernel(q, k, v, block_mask=document_block_mask(ids, block_size=16))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex_attention's backward, "
                                                                 "SDPA's flash kernel)")


@CUDA
def test_training_through_flex_attention_matches_the_dense_mask_on_cuda(monkeypatch):
    """The trainer's CUDA path (compiled flex_attention, forward and backward) against the dense-mask SDPA."""
    ids = LAYOUTS["mixed"].cuda()
    tokens = torch.randint(0, 97, (3, 101), generator=torch.Generator().manual_seed(4)).cuda()
    results = []
    for devices in (("cuda",), ()):
        monkeypatch.setattr(attention, "FLEX_DEVICES", devices)
        model = _model(n_kv_head=2).cuda().train()
        assert isinstance(attention.document_mask(ids, dropout=0.0), torch.Tensor) == (devices == ())
        loss = model(tokens[:, :-1], ids, targets=tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (flex_loss, flex_grads), (dense_loss, dense_grads) = results
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-5)
    for flex, dense in zip(flex_grads, dense_grads):
        torch.testing.assert_close(flex, dense, rtol=1e-3, atol=1e-4)


@CUDA
def test_plain_causal_attention_is_eligible_for_the_flash_kernel():
    """With only FLASH_ATTENTION allowed, SDPA raises where the flash kernel cannot serve (a mask, fp32, ...)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    for style in ("gpt2", "llama"):
        model = Transformer(ModelConfig(style=style, vocab_size=97, seq_len=128, n_layer=1, n_head=4,
                                        d_model=256)).cuda()
        tokens = torch.randint(0, 97, (2, 128), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            model(tokens, targets=tokens).backward()


@pytest.mark.slow  # compiles two blocks with torch's CPU flex_attention kernel (forward only on CPU)
def test_compiled_blocks_take_each_batchs_block_mask_without_recompiling(monkeypatch):
    """The trainer's GPU shape on CPU: `--compile` blocks receive a new BlockMask (a new mask_mod closure over
    new segment ids) every batch; dynamo must take it as an input, not recompile per batch, and give the
    dense path's outputs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model()
    for block in model.blocks:
        block.compile()
    gen = torch.Generator().manual_seed(5)
    graphs = []
    for _ in range(3):
        lengths = torch.randint(1, 60, (40,), generator=gen)
        ids = torch.repeat_interleave(torch.arange(40), lengths)[:100].expand(2, 100).contiguous()
        tokens = torch.randint(0, 97, (2, 100), generator=gen)
        with torch.no_grad():
            monkeypatch.setattr(attention, "FLEX_DEVICES", ())
            dense = model(tokens, ids)
            monkeypatch.setattr(attention, "FLEX_DEVICES", ("cpu",))
            flex = model(tokens, ids)
        torch.testing.assert_close(flex[..., :97], dense[..., :97], rtol=1e-4, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2], graphs  # the first batch compiled both paths, later ones nothing
