"""A decoder-only transformer in two styles, Llama (default) and GPT-2.

Why Llama style by default: rotary position embeddings are relative, which suits packed samples.
A document that starts in the middle of a packed sample sees the same relative positions it would
see alone, and with document masking on, positions restart at 0 for every document, so each document
is computed exactly as if it were its own sample. RMSNorm and SwiGLU without biases are the
choices of current open models (Llama 3, Mistral, OLMo) and cost nothing extra. GPT-2 style (learned
absolute positions, LayerNorm, GELU, biases) stays available so that `gpt2-124m` and `gpt2-350m`
are the well-known reference models with their usual parameter counts and MFU figures.

Both styles attend through `shardkit.train.attention` (SDPA's flash kernel for causal attention on a
GPU, flex_attention with a block mask for document masking), compute the training loss a chunk of
tokens at a time without the whole logits (`shardkit.train.loss`), tie the output projection to the
token embedding, pad the vocabulary to `ModelConfig.padded_vocab_size` rows (the padded logits are
-inf), and use GPT-2's init: N(0, 0.02) weights, zero biases, and residual output projections scaled
by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from shardkit.train.attention import attend, document_mask, document_positions
from shardkit.train.config import ModelConfig
from shardkit.train.loss import linear_cross_entropy


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        # Not persistent: derived from the config, so checkpoints stay independent of max_len.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` ([T] or [B, T]) shaped to broadcast over [B, H, T, D/2]."""
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 1:
            return cos[None, None], sin[None, None]
        return cos[:, None], sin[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.head_dim = config.d_model // config.n_head
        bias = config.style == "gpt2"
        # Separate q, k and v projections (not one fused matrix) so that tensor parallelism can split
        # each by heads: a column split of a fused [q; k; v] matrix would hand one rank all of q.
        self.q = nn.Linear(config.d_model, self.n_head * self.head_dim, bias=bias)
        self.k = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=bias)
        self.v = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=bias)
        self.out = nn.Linear(config.d_model, config.d_model, bias=bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp query and key/value heads.
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = attend(q, k, v, mask, dropout=self.dropout if self.training else 0.0,
                   enable_gqa=self.n_kv_head != self.n_head)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, bias = config.hidden_size, config.style == "gpt2"
        # SwiGLU's gate is its own matrix (not fused with `up`) so tensor parallelism can split both by columns.
        self.gate = nn.Linear(config.d_model, hidden, bias=False) if config.style == "llama" else None
        self.up = nn.Linear(config.d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, config.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        norm = nn.RMSNorm if config.style == "llama" else nn.LayerNorm
        self.norm1, self.norm2 = norm(config.d_model, eps=config.norm_eps), norm(config.d_model, eps=config.norm_eps)
        self.attn, self.mlp = Attention(config), MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope, mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer(nn.Module):
    """Decoder-only language model.

    Args:
        config: the model configuration; `vocab_size` and `seq_len` must be set.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.vocab_size is None or config.seq_len is None:
            raise ValueError("the model needs --vocab-size and --seq-len (normally taken from the dataset manifest)")
        self.config = config
        # Tensor parallelism with sequence parallelism hands each block 1/tp of the sequence; positions
        # are computed for the whole sequence (see `shardkit.train.parallel.tensor`).
        self.sequence_shards = 1
        vocab_rows = config.padded_vocab_size
        self.tok_emb = nn.Embedding(vocab_rows, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model) if config.style == "gpt2" else None
        self.rope = (RotaryEmbedding(config.d_model // config.n_head, config.seq_len, config.rope_theta)
                     if config.style == "llama" else None)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        norm = nn.RMSNorm if config.style == "llama" else nn.LayerNorm
        self.norm = norm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, vocab_rows, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # 0 for real tokens, -inf for the padding rows, added to the logits: a padded token gets no
        # probability, so it neither enters the loss's normaliser nor can be sampled, and its rows get no
        # gradient from the output. Derived from the config (not saved); None without padding.
        padding = torch.zeros(vocab_rows).masked_fill(torch.arange(vocab_rows) >= config.vocab_size, float("-inf"))
        self.register_buffer("padding_bias", padding if vocab_rows > config.vocab_size else None, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scale = 1 / math.sqrt(2 * self.config.n_layer) if name.endswith(("attn.out", "mlp.down")) else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()

    def num_parameters(self, *, exclude_positions: bool = True) -> int:
        """Distinct parameters (a tied matrix counts once); learned position tables excluded by default
        because they cost no matmul FLOPs."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_positions and self.pos_emb is not None:
            total -= self.pos_emb.weight.numel()
        return total

    def forward(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None, *,
                targets: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        """Logits [B, T, padded vocab] for input ids [B, T] (-inf for the padding ids), or with `targets`
        the cross-entropy loss, computed without the whole logits (`shardkit.train.loss`).

        Args:
            tokens: input ids.
            segment_ids: document segment number per token [B, T]; used only when the config's
                `document_mask` is on, to keep attention within each document and restart positions.
            targets: next-token ids [B, T] (`IGNORE_INDEX` where there is none), or None for the logits.
            reduction: the loss's 'mean' over the counted targets, or 'sum'.
        """
        return forward_layers(self, tokens, segment_ids, targets=targets, reduction=reduction)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks `module` runs, in order (a pipeline stage keeps a `ModuleDict` of its
    layer range, so that parameter names stay `blocks.N...` as in the whole model)."""
    blocks = module.blocks
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def forward_layers(module: nn.Module, inputs: torch.Tensor, segment_ids: torch.Tensor | None = None, *,
                   targets: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
    """The forward pass over the layers `module` holds: a whole `Transformer`, or a pipeline stage
    whose `tok_emb` is None (its input is the previous stage's hidden state) or whose `lm_head` is
    None (it returns the hidden state). With `targets`, the loss instead of the logits."""
    config = module.config
    seq = inputs.shape[1] * (1 if module.tok_emb is not None else module.sequence_shards)
    if seq > config.seq_len:
        raise ValueError(f"input has {seq} tokens, more than the model's --seq-len {config.seq_len}")
    mask = None
    positions = torch.arange(seq, device=inputs.device)
    if config.document_mask:
        if segment_ids is None:
            raise ValueError("--document-mask needs segment ids: the dataset's shards store no document "
                             "boundaries (rebuild with boundaries or turn --document-mask off)")
        mask = document_mask(segment_ids, dropout=config.dropout)
        positions = document_positions(segment_ids)
    x = inputs
    if module.tok_emb is not None:
        x = module.tok_emb(inputs)
        if module.pos_emb is not None:
            x = x + module.pos_emb(positions)
        x = module.drop(x)
    rope = module.rope(positions) if module.rope is not None else None
    for block in blocks_of(module):
        x = block(x, rope, mask)
    if module.lm_head is None:
        return x
    if targets is not None:
        return linear_cross_entropy(module.norm(x), module.lm_head.weight, targets, bias=module.padding_bias,
                                    reduction=reduction)
    logits = module.lm_head(module.norm(x))
    return logits if module.padding_bias is None else logits + module.padding_bias


def tied_weights(config: ModelConfig) -> dict[str, str]:
    """State-dict names that hold the same tensor as another name ({alias: name}): a checkpoint saves
    the tensor once, under the name."""
    return {"lm_head.weight": "tok_emb.weight"} if config.tie_embeddings else {}


def flops_per_token(config: ModelConfig, num_parameters: int) -> float:
    """Training FLOPs per token: 6N + 12 * n_layer * d_model * seq_len.

    6N counts the forward (2N) and backward (4N) matmuls of every weight, the tied output projection
    included (N from `Transformer.num_parameters`). The second term is attention's score and value
    matmuls (PaLM, appendix B), counted over the full T x T matrix as PaLM, nanoGPT and torchtitan
    do, although causal kernels skip about half of it.
    """
    return 6.0 * num_parameters + 12.0 * config.n_layer * config.d_model * config.seq_len
