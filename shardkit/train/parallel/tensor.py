"""Tensor parallelism (Megatron-LM's split, with sequence parallelism) for both model styles.

Per block: q, k, v and the MLP's input projections are split by columns (each rank holds
n_head / tp query and kv heads and 1/tp of the MLP width), the attention output and MLP down
projections by rows; their partial outputs are reduce-scattered along the sequence, so the norms
and the residual stream between blocks hold 1/tp of the positions (sequence parallelism: activation
memory / tp, and an all-gather + reduce-scatter pair per sub-layer instead of one all-reduce, the
same bytes). The token embedding is split by vocabulary rows and the output projection by vocabulary
columns; the loss is computed on vocabulary-sharded logits (`loss_parallel`), so the [B, T, vocab]
logits are never gathered, which pays for any vocabulary much larger than d_model. The vocabulary
split is the padded one (`ModelConfig.padded_vocab_size`), so GPT-2's 50257 tokens split over any
power-of-two tp; the padding's -inf bias is split with the logits.
"""

from __future__ import annotations

from torch import nn

from shardkit.train.model import blocks_of


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Split `model` (a `Transformer` or a pipeline stage's owner) over `tp_mesh` in place.

    Heads, kv-heads, the MLP width, the vocabulary and the sequence length must divide the tp size
    (`mesh.check_model_fits` says which option to change).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    config = model.config
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if model.pos_emb is not None:
            # Positions are [T] (or [B, T] with document masking): its output shards along T too.
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1 if config.document_mask else 0))
    if model.lm_head is not None:
        plan["norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    if model.lm_head is not None and model.padding_bias is not None:
        # Added to logits split by vocabulary (Shard(-1)): each rank holds the padding of its columns.
        model.padding_bias = distribute_tensor(model.padding_bias, tp_mesh, [Shard(0)])
    for block in blocks_of(model):
        block_plan = {
            "norm1": SequenceParallel(), "norm2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
        if block.mlp.gate is not None:
            block_plan["mlp.gate"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, block_plan)
    if config.tie_embeddings and model.tok_emb is not None and model.lm_head is not None:
        # Both are [vocab, d_model] split along the vocabulary (Shard(0)): one DTensor serves both,
        # as one tensor did before. parallelize_module made them two parameters; tie them again.
        model.lm_head.weight = model.tok_emb.weight
    model.sequence_shards = tp_mesh.size()
