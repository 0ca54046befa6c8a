"""Attention over packed samples: plain causal, or within each document (`--document-mask`).

Plain causal attention calls `scaled_dot_product_attention(is_causal=True)` without a mask, which on a
GPU in bf16/fp16 takes the flash kernel (no [T, T] scores in memory).

Document masking on a CUDA device goes through `flex_attention` with a `BlockMask` built from the
batch's segment ids at the granularity of 128 x 128 tiles (`document_block_mask`): a tile below the
diagonal whose queries and keys all lie in one document is computed without a mask, a tile whose
documents cannot meet is skipped, and only the tiles where a document starts or the diagonal passes
evaluate the per-element rule (same document, key not after query). Nothing of size T x T is built, and
the skipped tiles cost nothing, so a batch of short documents is cheaper than causal attention over
the whole window. Elsewhere (CPU: torch 2.13's flex_attention has no backward there) and with dropout
(flex_attention has none), the mask is a dense [B, 1, T, T] boolean tensor given to SDPA.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

FLEX_BLOCK_SIZE = 128  # flex_attention's tile (its default)
FLEX_DEVICES = ("cuda",)  # where document masking runs through flex_attention


def document_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document segment (0 at every segment start); [B, T] int64."""
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device).expand_as(segment_ids)
    is_start = torch.ones_like(segment_ids, dtype=torch.bool)
    is_start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_index = torch.where(is_start, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def document_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask: True where query t may attend key s (s <= t, same segment)."""
    seq = segment_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def document_block_mask(segment_ids: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE) -> BlockMask:
    """The `document_attention_mask` rule as a flex_attention `BlockMask`, in O(B x (T / block_size)^2).

    Tiles are classified from each tile's smallest and largest segment id: a tile is full only when all
    its queries and keys share one id, skipped only when their id ranges do not overlap, and otherwise
    evaluated element by element. That is right for any ids, and tight for ids that never decrease along a
    sample (the loader's, up to its -1 padding at the end of a window).
    """
    batch, seq = segment_ids.shape
    blocks = -(-seq // block_size)
    # The last tile is filled with copies of the last id, which leaves its id range unchanged.
    filler = segment_ids[:, -1:].expand(batch, blocks * block_size - seq)
    tiles = torch.cat([segment_ids, filler], dim=1).view(batch, blocks, block_size)
    low, high = tiles.amin(dim=-1), tiles.amax(dim=-1)
    q_low, q_high, k_low, k_high = low[:, :, None], high[:, :, None], low[:, None, :], high[:, None, :]
    below = torch.ones(blocks, blocks, dtype=torch.bool, device=segment_ids.device).tril(-1)
    diagonal = torch.eye(blocks, dtype=torch.bool, device=segment_ids.device)
    full = below & (q_low == q_high) & (k_low == k_high) & (q_low == k_low)
    meet = (k_low <= q_high) & (q_low <= k_high)
    partial = (diagonal | (below & meet)) & ~full
    ids = segment_ids

    def same_document(b, h, q, kv):
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block_size,
                                    mask_mod=same_document, seq_lengths=(seq, seq))


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Q, K] booleans as BlockMask's (count [B, 1, Q], kv tile indices listed first [B, 1, Q, K])."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def document_mask(segment_ids: torch.Tensor, *, dropout: float) -> torch.Tensor | BlockMask:
    """The attention mask for `segment_ids` [B, T]: a BlockMask where flex_attention serves, else dense."""
    if segment_ids.device.type in FLEX_DEVICES and dropout == 0.0:
        return document_block_mask(segment_ids)
    return document_attention_mask(segment_ids)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None, *,
           dropout: float, enable_gqa: bool) -> torch.Tensor:
    """Attention of [B, H, T, D] queries over keys and values; causal when `mask` is None."""
    if isinstance(mask, BlockMask):
        # Inside a compiled block dynamo lowers flex_attention itself; called eagerly on a GPU it needs its own
        # compiled wrapper (eager flex_attention builds the whole score matrix).
        as_is = torch.compiler.is_compiling() or q.device.type != "cuda"
        kernel = flex_attention if as_is else _compiled_flex_attention()
        return kernel(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                          enable_gqa=enable_gqa)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)
