"""Trainer configuration: one frozen, keyword-only dataclass per component, nested in `TrainConfig`.

Every field carries its help text in `metadata["help"]`; `shardkit.train.options` turns the fields
into command-line options one-to-one (`--lr 3e-4` or `--optimizer.lr 3e-4`), so `--help` is this
file's documentation. Checks live in `__post_init__` and name the option to change.

Field names are unique across sections so that the short form `--NAME` is never ambiguous.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp", "hsdp")
COMM_HOOKS = ("none", "bf16", "powersgd")
SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "bf16", "fp32")
MODEL_STYLES = ("gpt2", "llama")


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field whose help text (and allowed values) the CLI shows."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decoder-only transformer (see `shardkit.train.model` for the two styles)."""

    style: str = option("llama", "architecture: 'llama' (RoPE, RMSNorm, SwiGLU, no biases) or 'gpt2' "
                        "(learned positions, LayerNorm, GELU MLP, biases)", choices=MODEL_STYLES)
    vocab_size: int | None = option(None, "vocabulary size; default: the dataset manifest's tokenizer.vocab_size")
    seq_len: int | None = option(None, "context length; default: the dataset manifest's seq_len")
    n_layer: int = option(2, "number of transformer blocks")
    n_head: int = option(4, "attention heads per block")
    n_kv_head: int | None = option(None, "key/value heads (grouped-query attention, llama style); default n_head")
    d_model: int = option(64, "width of the residual stream")
    d_ff: int | None = option(None, "hidden width of the MLP; default 4*d_model (gpt2) or ~8/3*d_model (llama)")
    dropout: float = option(0.0, "dropout probability (0 keeps training bitwise reproducible)")
    rope_theta: float = option(10000.0, "RoPE base (llama style)")
    norm_eps: float = option(1e-5, "epsilon of the normalisation layers")
    init_std: float = option(0.02, "standard deviation of the weight init")
    tie_embeddings: bool = option(True, "share the token embedding with the output projection")
    document_mask: bool = option(False, "mask attention so tokens attend only within their own document "
                                 "(needs shards that store document boundaries)")

    def __post_init__(self) -> None:
        _check(self.style in MODEL_STYLES, f"--style must be one of {MODEL_STYLES}, got {self.style!r}")
        for name in ("n_layer", "n_head", "d_model"):
            _check(getattr(self, name) >= 1, f"--{name} must be >= 1, got {getattr(self, name)}")
        _check(self.d_model % self.n_head == 0,
               f"--d_model ({self.d_model}) must be divisible by --n_head ({self.n_head})")
        _check((self.d_model // self.n_head) % 2 == 0 or self.style != "llama",
               f"RoPE needs an even head size: change --d_model or --n_head (head size {self.d_model // self.n_head})")
        kv = self.n_kv_head or self.n_head
        _check(kv >= 1 and self.n_head % kv == 0,
               f"--n_head ({self.n_head}) must be a multiple of --n_kv_head ({self.n_kv_head})")
        _check(self.style == "llama" or kv == self.n_head, "--n_kv_head is only supported with --style llama")
        for name in ("vocab_size", "seq_len", "d_ff"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"--{name} must be >= 1, got {value}")
        _check(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        _check(self.init_std > 0, f"--init_std must be positive, got {self.init_std}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden_size(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.style == "gpt2":
            return 4 * self.d_model
        return 64 * ((8 * self.d_model // 3 + 63) // 64)  # SwiGLU: same parameters as a 4x GELU MLP


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training and evaluation samples come from (shardkit datasets, any fsspec URL)."""

    data: str = option("", "training dataset URL (a directory or prefix holding shardkit.json)")
    eval_data: str | None = option(None, "held-out dataset URL evaluated every --eval_every steps")
    batch_size: int = option(8, "samples per rank per micro-step")
    shuffle: bool = option(True, "shuffle the training samples (deterministically from --data_seed)")
    data_seed: int = option(0, "seed of the sample order")
    cache_dir: str | None = option(None, "node-local shard cache; default: the loader's default")
    num_workers: int = option(0, "loader worker processes per rank")
    eval_batches: int = option(8, "batches per rank in one evaluation")
    storage_options: str | None = field(default=None, repr=False, metadata={
        "help": "JSON object of fsspec options for --data and --eval_data, e.g. '{\"endpoint_url\": \"http://...\"}' "
                "(may hold credentials: never printed nor saved in the run directory)", "choices": None})

    def __post_init__(self) -> None:
        if self.storage_options is not None:
            try:
                parsed = json.loads(self.storage_options)
            except json.JSONDecodeError:
                parsed = None
            _check(isinstance(parsed, dict), "--storage_options must be a JSON object (its value is not shown)")
        _check(self.batch_size >= 1, f"--batch_size must be >= 1, got {self.batch_size}")
        _check(self.num_workers >= 0, f"--num_workers must be >= 0, got {self.num_workers}")
        _check(self.eval_batches >= 1, f"--eval_batches must be >= 1, got {self.eval_batches}")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = option(3e-4, "peak learning rate")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of --lr")
    warmup_steps: int | None = option(None, "linear warm-up steps; default min(100, --steps // 10)")
    schedule: str = option("cosine", "after warm-up: 'cosine' decay, 'wsd' (warmup-stable-decay) or 'constant'",
                           choices=SCHEDULES)
    decay_fraction: float = option(0.2, "wsd: fraction of all steps spent in the final linear decay")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only; not norms, biases or embeddings)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0 disables clipping)")

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"--lr must be positive, got {self.lr}")
        _check(0 <= self.min_lr_ratio <= 1, f"--min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.warmup_steps is None or self.warmup_steps >= 0,
               f"--warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.schedule in SCHEDULES, f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        _check(0 < self.decay_fraction <= 1, f"--decay_fraction must be in (0, 1], got {self.decay_fraction}")
        _check(self.weight_decay >= 0, f"--weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "--beta1 and --beta2 must be in [0, 1)")
        _check(self.grad_clip >= 0, f"--grad_clip must be >= 0 (0 disables), got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is replicated or sharded over the ranks torchrun starts."""

    parallel: str = option("auto", "'ddp', 'fsdp' (FSDP2), 'hsdp' (shard in a node, replicate across nodes), "
                           "'none' (one process), or 'auto' (ddp when several ranks)", choices=PARALLEL_MODES)
    comm_hook: str = option("none", "ddp gradient communication: 'none', 'bf16' (compress to bf16) or "
                            "'powersgd' (low-rank)", choices=COMM_HOOKS)
    powersgd_rank: int = option(4, "matrix rank of the PowerSGD approximation")
    shard_size: int | None = option(None, "hsdp: ranks per shard group; default: ranks per node (LOCAL_WORLD_SIZE)")
    backend: str = option("auto", "process-group backend: 'auto' (nccl on GPU, gloo on CPU), 'gloo' or 'nccl'",
                          choices=("auto", "gloo", "nccl"))

    def __post_init__(self) -> None:
        _check(self.parallel in PARALLEL_MODES, f"--parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        _check(self.comm_hook in COMM_HOOKS, f"--comm_hook must be one of {COMM_HOOKS}, got {self.comm_hook!r}")
        _check(self.comm_hook == "none" or self.parallel in ("ddp", "auto"),
               f"--comm_hook {self.comm_hook} applies to --parallel ddp only, not {self.parallel}")
        _check(self.powersgd_rank >= 1, f"--powersgd_rank must be >= 1, got {self.powersgd_rank}")
        _check(self.shard_size is None or self.shard_size >= 1, f"--shard_size must be >= 1, got {self.shard_size}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """torch.distributed.checkpoint saves of the whole training state."""

    checkpoint_dir: str | None = option(None, "where checkpoints go; default RUN_DIR/checkpoints")
    checkpoint_every: int = option(0, "save every N steps (0: only at the end and on SIGTERM/SIGINT)")
    keep: int = option(3, "keep the newest K complete checkpoints, delete older ones")
    async_save: bool = option(False, "save in the background (dcp.async_save); training continues meanwhile")
    resume: str = option("auto", "'auto' (newest complete checkpoint if any), 'none', or a checkpoint directory")
    save_final: bool = option(True, "save a checkpoint after the last step")

    def __post_init__(self) -> None:
        _check(self.checkpoint_every >= 0, f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
        _check(self.keep >= 1, f"--keep must be >= 1, got {self.keep}")
        _check(bool(self.resume), "--resume must be 'auto', 'none' or a checkpoint directory")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What the run writes: stdout lines, RUN_DIR/metrics.jsonl, TensorBoard, sample-id logs."""

    run_dir: str | None = option(None, "output directory; default runs/PRESET-DATASETNAME")
    log_every: int = option(10, "print a metrics line every N steps (every step goes to metrics.jsonl)")
    tensorboard: bool = option(True, "also write TensorBoard events when tensorboard is installed")
    log_sample_ids: bool = option(False, "write the sample ids each rank consumes per step to RUN_DIR/samples/")
    metrics_port: int = option(0, "serve Prometheus metrics at http://HOST:PORT/metrics, each rank on PORT + its "
                               "local rank (0: off)")
    starvation_window: int = option(50, "steps over which the data-wait fraction is averaged for the starvation "
                                    "warning")
    starvation_threshold: float = option(0.5, "warn once when the data-wait fraction over --starvation_window steps "
                                         "exceeds this (1 disables the warning)")

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, f"--log_every must be >= 1, got {self.log_every}")
        _check(0 <= self.metrics_port < 65536, f"--metrics_port must be in 0-65535, got {self.metrics_port}")
        _check(self.starvation_window >= 1, f"--starvation_window must be >= 1, got {self.starvation_window}")
        _check(0 < self.starvation_threshold, f"--starvation_threshold must be > 0, got {self.starvation_threshold}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole run: the training loop's own options plus one section per component."""

    preset: str = option("tiny", "model preset: " + ", ".join(("tiny", "gpt2-124m", "gpt2-350m", "llama-1b")))
    steps: int = option(1000, "optimizer steps to train for")
    grad_accum: int = option(1, "micro-steps per optimizer step (gradients sync only on the last)")
    precision: str = option("auto", "'bf16' autocast / FSDP mixed precision, 'fp32', or 'auto' (bf16 on GPU)",
                            choices=PRECISIONS)
    compile: bool = option(False, "torch.compile each transformer block")
    activation_checkpointing: bool = option(False, "recompute block activations in the backward pass")
    eval_every: int = option(0, "evaluate on --eval_data every N steps (0: only at the end)")
    seed: int = option(1234, "seed of the weight init and dropout")
    device: str = option("auto", "'auto' (cuda when available), 'cuda' or 'cpu'", choices=("auto", "cuda", "cpu"))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(self.preset in PRESETS, f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        _check(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        _check(self.grad_accum >= 1, f"--grad_accum must be >= 1, got {self.grad_accum}")
        _check(self.precision in PRECISIONS, f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        _check(self.eval_every >= 0, f"--eval_every must be >= 0, got {self.eval_every}")
        if self.optimizer.warmup_steps is None:  # resolved here so that config.json records the value used
            object.__setattr__(self, "optimizer", dataclasses.replace(
                self.optimizer, warmup_steps=min(100, self.steps // 10)))
        _check(self.optimizer.warmup_steps < self.steps or self.steps == 1,
               f"--warmup_steps ({self.optimizer.warmup_steps}) must be smaller than --steps ({self.steps})")

    def to_dict(self) -> dict[str, Any]:
        """All values, with `storage_options` redacted (it may hold credentials)."""
        values = dataclasses.asdict(self)
        if values["data"]["storage_options"] is not None:
            values["data"]["storage_options"] = "<redacted>"
        return values


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
    "parallelism": ParallelConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}

# Presets fill in the model section (and a sensible learning rate); anything given explicitly wins.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # ~0.1M parameters with a byte vocabulary: runs a step in milliseconds on a CPU.
    "tiny": {"model": {"style": "llama", "n_layer": 2, "n_head": 4, "d_model": 64}, "optimizer": {"lr": 3e-3}},
    # GPT-2 small (124M with the 50257 vocabulary) and medium (350M), as in the GPT-2 paper.
    "gpt2-124m": {"model": {"style": "gpt2", "n_layer": 12, "n_head": 12, "d_model": 768}, "optimizer": {"lr": 6e-4}},
    "gpt2-350m": {"model": {"style": "gpt2", "n_layer": 24, "n_head": 16, "d_model": 1024}, "optimizer": {"lr": 3e-4}},
    # Llama-3.2-1B's shape: 16 layers, width 2048, 32 query / 8 key-value heads, SwiGLU 8192, tied embeddings.
    "llama-1b": {"model": {"style": "llama", "n_layer": 16, "n_head": 32, "n_kv_head": 8, "d_model": 2048,
                           "d_ff": 8192, "rope_theta": 500000.0}, "optimizer": {"lr": 3e-4}},
}


def config_from_dict(values: dict[str, Any], *, source: str = "configuration") -> TrainConfig:
    """Build a `TrainConfig` from nested {section: {field: value}} values over the chosen preset.

    Raises:
        ValueError: unknown section or field (naming it and `source`), or a failed check.
    """
    top_fields = {f.name for f in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    preset = values.get("preset", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"{source}: --preset must be one of {sorted(PRESETS)}, got {preset!r}")
    merged: dict[str, dict[str, Any]] = {name: dict(PRESETS[preset].get(name, {})) for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: section {key!r} must be a table/object of options")
            known = {f.name for f in dataclasses.fields(SECTIONS[key])}
            for name, item in value.items():
                if name not in known:
                    raise ValueError(f"{source}: unknown option {key}.{name} (known: {', '.join(sorted(known))})")
                merged[key][name] = item
        elif key in top_fields:
            top[key] = value
        else:
            raise ValueError(f"{source}: unknown option {key!r}")
    sections = {name: SECTIONS[name](**merged[name]) for name in SECTIONS}
    return TrainConfig(**top, **sections)
