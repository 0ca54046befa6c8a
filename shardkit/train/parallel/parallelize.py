"""`parallelize`: the one place that applies the mesh's dimensions to the model, in a fixed order.

torchtitan's order: pipeline split (each rank keeps its stages' layers), then tensor parallelism
(`apply_tp`), then activation checkpointing (`apply_ac`) and `torch.compile` per block (`apply_compile`),
then data parallelism (FSDP2/HSDP over the dp dims of a TP or PP model, or DDP for plain replication).
The result, `ParallelModel`, is all the training loop needs: one call per micro-step (`forward_backward`),
an eval loss, and gradient clipping whose norm spans every stage and shard.

The loss: without tensor or pipeline parallelism the model computes it from its final hidden state a
chunk of tokens at a time (`shardkit.train.loss`), never holding the whole micro-batch's logits. Under
tensor parallelism the logits stay split by vocabulary and `loss_parallel` computes the loss on the
shards; a pipeline's last stage returns logits to the schedule's loss function.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.train.config import ParallelConfig
from shardkit.train.model import Transformer
from shardkit.train.parallel.activation_checkpointing import apply_ac
from shardkit.train.parallel.compile import apply_compile, cuda_graph_refusal
from shardkit.train.parallel.data_parallel import apply_ddp, apply_fsdp, gradient_sync, reshard_after_eval
from shardkit.train.parallel.mesh import check_model_fits
from shardkit.train.parallel.pipeline import TiedEmbedding, build_schedule, make_stages, pipeline_split, tie_embedding
from shardkit.train.parallel.runtime import Runtime
from shardkit.train.parallel.tensor import apply_tp


@dataclass
class ParallelModel:
    """The model as this rank holds it, and how one micro-step runs on it.

    Attributes:
        model: what the optimizer and checkpoints see (the whole model, DDP-wrapped, FSDP-sharded or
            tensor-split; under pipeline parallelism the owner of this rank's stages).
        parts: the modules whose forward runs (the model itself, or this rank's pipeline stages).
        runtime: the process layout.
        schedule: the pipeline schedule, or None without pipeline parallelism.
        tied: under pipeline parallelism with tied embeddings, this first or last stage's copy of the
            shared embedding (None elsewhere).
    """

    model: nn.Module
    parts: list[nn.Module]
    runtime: Runtime
    schedule: Any = None
    last_stage: bool = True
    tied: TiedEmbedding | None = None
    _scale: list[float] = field(default_factory=lambda: [1.0])

    @property
    def dims(self):
        return self.runtime.dims

    def _loss_context(self):
        # Vocabulary-parallel cross-entropy: logits stay sharded by vocabulary (forward and backward).
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None, *,
                         scale: float, sync: bool) -> torch.Tensor:
        """Forward and backward of one micro-step; gradients are scaled by `scale` (1 / grad_accum).

        Returns the micro-step's mean loss weighted so that its average over *all* ranks is the global
        loss (pipeline ranks other than the last stage hold none: they return 0, the last stage pp x loss).
        """
        if self.schedule is not None:
            loss = self._pipeline_step(inputs, targets, scale=scale)
            if sync and self.tied is not None:  # the step's last backward: both copies get the summed gradient
                self.tied.sum_gradients()
            return loss
        with gradient_sync(self.model, self.runtime.mode, enabled=sync), self._loss_context():
            loss = self._model_loss(inputs, targets, segment_ids, "mean")
            (loss * scale).backward()
        return _local(loss.detach())

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
        """Summed loss over the batch's targets (no grad), weighted like `forward_backward`'s."""
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            with self._loss_context():
                self.schedule.eval(inputs, target=targets, losses=losses, loss_kwargs={"reduction": "sum"})
            if not self.last_stage:
                return torch.zeros((), device=inputs.device)
            return _local(torch.stack(losses).sum()) * self.dims.pp
        with self._loss_context():
            return _local(self._model_loss(inputs, targets, segment_ids, "sum"))

    def _model_loss(self, inputs: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None,
                    reduction: str) -> torch.Tensor:
        if self.dims.tp > 1:  # vocabulary-split logits, inside `_loss_context`'s loss_parallel
            return self._cross_entropy(self.model(inputs, segment_ids), targets, reduction)
        return self.model(inputs, segment_ids, targets=targets, reduction=reduction)

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, *, scale: float) -> torch.Tensor:
        # The loss function multiplies each micro-batch's mean loss by scale / micro-batches (the
        # schedule's own rescaling would also rescale gradients accumulated by earlier calls).
        self._scale[0] = scale / self.dims.pp_microbatches
        losses: list[torch.Tensor] = []
        with self._loss_context():
            self.schedule.step(inputs, target=targets, losses=losses)
        if not self.last_stage:
            return torch.zeros((), device=inputs.device)
        mean = _local(torch.stack([loss.detach() for loss in losses]).sum()) / scale
        return mean * self.dims.pp

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = self._cross_entropy(logits, targets, reduction)
        return loss * (self._scale[0] if reduction == "mean" else 1.0)

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient norm over all parameters of all ranks; returns the norm before clipping."""
        # The last stage's copy of a tied embedding is the first stage's: its gradient counts once.
        duplicate = self.tied.weight if self.tied is not None and not self.tied.first else None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None and p is not duplicate]
        norm = torch.nn.utils.get_total_norm(grads, foreach=None)
        if hasattr(norm, "full_tensor"):  # sharded over dp_shard and/or tp: a DTensor whose sum spans them
            norm = norm.full_tensor()
        if self.dims.pp > 1:  # each stage holds other parameters: add the squares over the pipeline
            squared = norm ** 2
            dist.all_reduce(squared, group=self.runtime.group("pp"))
            norm = squared.sqrt()
        if math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(list(self.model.parameters()), max_norm, norm, foreach=None)
        return norm

    def broadcast_tied(self) -> None:
        """Make the last pipeline stage's copy of a tied embedding the first stage's (every rank calls it
        after building the model and after loading a checkpoint; a no-op without such a copy)."""
        if self.tied is not None:
            self.tied.broadcast()

    def reshard_after_eval(self) -> None:
        for part in self.parts:
            reshard_after_eval(part, self.runtime.mode)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the loss under tensor parallelism) as a plain tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def parallelize(model: Transformer, runtime: Runtime, config: ParallelConfig, *, param_dtype: torch.dtype | None,
                compile: bool, activation_checkpointing: bool, compile_mode: str = "default") -> ParallelModel:
    """Apply the mesh's dimensions to `model` (built whole and identically on every rank, on the device).

    `param_dtype` (bf16, fp16, or None for fp32) is the dtype FSDP2 computes in; other layouts autocast.

    Raises:
        ValueError: a `compile_mode` with CUDA graphs in a layout where they cannot run (naming why).
    """
    dims, mesh = runtime.dims, runtime.mesh
    check_model_fits(dims, model.config)
    refusal = compile and cuda_graph_refusal(compile_mode, device_type=runtime.device.type, dims=dims,
                                             activation_checkpointing=activation_checkpointing,
                                             document_mask=model.config.document_mask)
    if refusal:
        raise ValueError(refusal)
    result = ParallelModel(model=model, parts=[model], runtime=runtime)
    pipeline = None
    if dims.pp > 1:
        model, mine, ranges = pipeline_split(model, dims, mesh.get_local_rank("pp"))
        pipeline = (mine, ranges)
        result.last_stage = len(ranges) - 1 in mine
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if activation_checkpointing:
        apply_ac(model)
    if compile:
        apply_compile(model, compile_mode)
    parts: list[nn.Module] = [model]
    if pipeline is not None:
        parts = make_stages(model, *pipeline)
    if dims.data_parallel == "ddp":
        result.model = apply_ddp(model, runtime.device, config)
        parts = [result.model]
    elif dims.data_parallel in ("fsdp", "hsdp"):
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.data_parallel == "hsdp" else mesh["dp_shard"]
        apply_fsdp(parts, dp_mesh, param_dtype=param_dtype)
    result.model = result.model if dims.pp == 1 else model
    result.parts = parts
    if pipeline is not None:
        result.schedule = build_schedule(parts, pipeline[0], dims, device=runtime.device,
                                         pp_group=runtime.group("pp"), loss_fn=result.pipeline_loss)
        if model.config.tie_embeddings:
            result.tied = tie_embedding(model, mesh, pipeline[0], len(pipeline[1]))
    result.broadcast_tied()
    return result
