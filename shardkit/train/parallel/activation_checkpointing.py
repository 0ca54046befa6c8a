"""`apply_ac`: activation checkpointing as a step of `parallelize`, not a flag the model reads.

Each transformer block is wrapped in torch's `checkpoint_wrapper` (non-reentrant `torch.utils.checkpoint`,
as torchtitan does): the forward keeps only each block's input, and the backward recomputes the block's
activations from it, so activation memory is one block's worth plus a [B, T, d_model] tensor per block.
Applied after tensor parallelism (whose plan names the block's own submodules) and before
`torch.compile` and FSDP, which then compile and shard the wrapped block.

The wrapper adds `_checkpoint_wrapped_module.` to the names `named_parameters()` gives. `state_dict()`
(the wrapper's own hooks) and DCP's `get_state_dict` leave it out, so a checkpoint saved with activation
checkpointing holds the same keys as one saved without, and loads either way; code that keys state of its
own by parameter name goes through `parameter_name`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX, checkpoint_wrapper


def apply_ac(model: nn.Module) -> None:
    """Wrap every block of `model` (a `Transformer`, or a pipeline stage's owner) in place."""
    for name, block in list(model.blocks.named_children()):
        model.blocks.register_module(name, checkpoint_wrapper(block))


def parameter_name(name: str) -> str:
    """A parameter's name as the model without activation checkpointing has it."""
    return name.replace(_CHECKPOINT_PREFIX, "")
