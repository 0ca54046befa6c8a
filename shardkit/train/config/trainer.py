"""`TrainConfig`: the whole run, one section per component (the modules beside this one), and the checks
that span sections; the presets; the step size once the dataset and the mesh are known."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shardkit.options import option
from shardkit.train.config.checks import MAX_MICRO_STEPS, check
from shardkit.train.config.checkpoint import CheckpointConfig
from shardkit.train.config.compile import CUDA_GRAPH_MODES, CompileConfig
from shardkit.train.config.data import DataConfig
from shardkit.train.config.model import ModelConfig
from shardkit.train.config.observability import LoggingConfig
from shardkit.train.config.optimizer import OptimizerConfig
from shardkit.train.config.parallelism import DilocoConfig, ParallelConfig
from shardkit.train.config.precision import PrecisionConfig
from shardkit.train.config.training import TrainingConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole run: the preset, and one section per component, each read by that component.

    Build one with `config_from_dict` (nested {section: {option: value}}, as a config file holds them, over
    a preset), with the sections (`TrainConfig(training=TrainingConfig(steps=10), data=DataConfig(data=URL))`),
    or from the former flat keywords with `TrainConfig.from_keywords(steps=10, data=DataConfig(data=URL))`.
    """

    preset: str = option("tiny", "model preset: " + ", ".join(("tiny", "gpt2-124m", "gpt2-350m", "llama-1b")))
    training: TrainingConfig = field(default_factory=TrainingConfig)
    mixed_precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        check(self.preset in PRESETS, f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        check(self.parallelism.parallel == "diloco" or self.diloco == DilocoConfig(),
              "the diloco options (--sync-every, --outer-lr, ...) apply to --parallel diloco only, "
              f"not {self.parallelism.parallel}")
        steps = self.training.steps
        if self.optimizer.warmup_steps is None:  # resolved here so that config.json records the value used
            object.__setattr__(self, "optimizer", dataclasses.replace(self.optimizer, warmup_steps=min(100, steps // 10)))
        check(self.optimizer.warmup_steps < steps or steps == 1,
              f"--warmup-steps ({self.optimizer.warmup_steps}) must be smaller than --steps ({steps})")
        # Checked here, not when the loader opens, so that `shardkit tune` refuses it before any trial starts.
        check(self.data.tokenizer is None or self.model.seq_len is not None,
              "--tokenizer (training from raw text) needs --seq-len: there is no manifest to take it from")
        self._check_cuda_graphs()
        self._check_fp16_layout()

    def _check_cuda_graphs(self) -> None:
        """What the options alone rule out for the CUDA-graph modes; the layout and the device are checked once
        resolved (`shardkit.train.parallel.compile.cuda_graph_refusal`)."""
        mode = self.compile.compile_mode
        if mode not in CUDA_GRAPH_MODES:
            return
        # CUDA graph trees lose gradients accumulated over micro-steps (pytorch issues 96693, 169545).
        check(self.training.grad_accum == 1, f"--compile-mode {mode} captures CUDA graphs, which lose gradients "
                                             "accumulated over micro-steps: use --grad-accum 1 or --compile-mode default")
        check(self.data.loader.max_tokens is None,
              f"--compile-mode {mode} captures CUDA graphs for fixed shapes, and --max-tokens gives "
              "batches of varying shapes: use --compile-mode default")

    def _check_fp16_layout(self) -> None:
        """The layouts fp16 does not compose with. ('auto' may pick fp16 on a GPU without bf16: the trainer
        checks its choice again, with the precision resolved.)"""
        if self.mixed_precision.precision != "fp16":
            return
        # PowerSGD keeps the compression error of each step and adds it to the next: the inf/NaN of one
        # overflowing step would stay in that error and make every later step overflow too.
        check(self.parallelism.comm_hook != "powersgd",
              "--comm-hook powersgd does not compose with --precision fp16 (dynamic loss scaling): an overflowing "
              "step poisons PowerSGD's error feedback; use --comm-hook none or bf16, or --precision bf16/fp32")

    @classmethod
    def from_keywords(cls, **keywords: Any) -> TrainConfig:
        """A `TrainConfig` from the keywords it took before it had a training, mixed_precision and compile
        section (`steps=`, `precision=`, `compile=`, `seed=`, ...) next to the sections and `preset=`; no
        preset is applied (as with the constructor).

        Raises:
            TypeError: a keyword that is neither a section, `preset`, nor a field of a loop section.
        """
        owners = loop_option_sections()
        given: dict[str, dict[str, Any]] = {}
        direct: dict[str, Any] = {}
        for name, value in keywords.items():
            if name == "preset" or isinstance(value, SECTIONS.get(name, ())):  # `compile=` takes either
                direct[name] = value
            elif name in owners:
                given.setdefault(owners[name], {})[name] = value
            elif name in SECTIONS:
                raise TypeError(f"TrainConfig.from_keywords(): {name}= takes a {SECTIONS[name].__name__}, got "
                                f"{type(value).__name__}")
            else:
                raise TypeError(f"TrainConfig.from_keywords() got an unexpected keyword {name!r}: give a section "
                                f"({', '.join(SECTIONS)}), preset, or a field of {', '.join(LOOP_SECTIONS)}")
        return cls(**direct, **{section: SECTIONS[section](**values) for section, values in given.items()})

    def to_dict(self) -> dict[str, Any]:
        """All values, nested by section, with `storage_options` redacted (it may hold credentials)."""
        values = dataclasses.asdict(self)
        if values["data"]["storage_options"] is not None:
            values["data"]["storage_options"] = "<redacted>"
        return values


# Section name -> its dataclass, in the order `--help` shows them.
SECTIONS: dict[str, type] = {
    "training": TrainingConfig, "mixed_precision": PrecisionConfig, "compile": CompileConfig, "model": ModelConfig,
    "data": DataConfig, "optimizer": OptimizerConfig, "parallelism": ParallelConfig, "diloco": DilocoConfig,
    "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}
# The sections whose fields were TrainConfig's own before it had them: a config file (or an older run's
# config.json) may still give those fields at the top level.
LOOP_SECTIONS = ("training", "mixed_precision", "compile")


def loop_option_sections() -> dict[str, str]:
    """Each option of the loop sections -> its section (`steps` -> `training`)."""
    return {f.name: section for section in LOOP_SECTIONS for f in dataclasses.fields(SECTIONS[section])}

# Presets fill in the model section (and a sensible learning rate); anything given explicitly wins. The GPU
# presets' micro-batch (--batch-size, samples per rank per micro-step at seq_len 1024) is sized for an 80 GB
# GPU in bf16 from the memory arithmetic in docs/PARALLELISM.md ("How big a step is"), with room left for the
# allocator and torch.compile; benchmarks/bench_train.py measures the peak.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # ~0.1M parameters with a byte vocabulary: runs a step in milliseconds on a CPU.
    "tiny": {"model": {"style": "llama", "n_layer": 2, "n_head": 4, "d_model": 64}, "optimizer": {"lr": 3e-3}},
    # GPT-2 small (124M with the 50257 vocabulary) and medium (350M), as in the GPT-2 paper.
    "gpt2-124m": {"model": {"style": "gpt2", "n_layer": 12, "n_head": 12, "d_model": 768}, "optimizer": {"lr": 6e-4},
                  "data": {"batch_size": 32}},
    "gpt2-350m": {"model": {"style": "gpt2", "n_layer": 24, "n_head": 16, "d_model": 1024}, "optimizer": {"lr": 3e-4},
                  "data": {"batch_size": 16}},
    # Llama-3.2-1B's shape: 16 layers, width 2048, 32 query / 8 key-value heads, SwiGLU 8192, tied embeddings.
    "llama-1b": {"model": {"style": "llama", "n_layer": 16, "n_head": 32, "n_kv_head": 8, "d_model": 2048,
                           "d_ff": 8192, "rope_theta": 500000.0}, "optimizer": {"lr": 3e-4},
                 "data": {"batch_size": 8}},
}


def with_step_size(config: TrainConfig, *, seq_len: int, dp_size: int) -> TrainConfig:
    """`config` with --grad-accum resolved from --global-batch-tokens (unchanged without it), once the
    sequence length (the dataset's) and the data-parallel size (the mesh's) are known.

    Raises:
        ValueError: the micro-batches do not divide --global-batch-tokens, make more micro-steps than
            `MAX_MICRO_STEPS`, or --grad-accum disagrees.
    """
    training = config.training
    if training.global_batch_tokens is None:
        return config
    micro = config.data.batch_size * seq_len * dp_size
    accum, left = divmod(training.global_batch_tokens, micro)
    if left or accum == 0:
        raise ValueError(f"--global-batch-tokens {training.global_batch_tokens} is not a multiple of one micro-step's "
                         f"{micro} tokens (--batch-size {config.data.batch_size} x seq_len {seq_len} x {dp_size} "
                         f"data-parallel ranks): use a multiple of {micro}, or change --batch-size")
    check(accum <= MAX_MICRO_STEPS, f"--global-batch-tokens {training.global_batch_tokens} makes {accum:,} "
          f"micro-steps of {micro} tokens per optimizer step, over the upper bound of {MAX_MICRO_STEPS:,}: give "
          "fewer tokens per step or a larger --batch-size")
    if training.grad_accum is not None and training.grad_accum != accum:
        raise ValueError(f"--grad-accum {training.grad_accum} disagrees with --global-batch-tokens "
                         f"{training.global_batch_tokens}, which needs {accum} micro-steps of {micro} tokens: "
                         "give only one of them")
    return dataclasses.replace(config, training=dataclasses.replace(training, grad_accum=accum))


def describe_step(config: TrainConfig, *, seq_len: int, dp_size: int) -> str:
    """What one optimizer step holds, for the log."""
    accum = config.training.grad_accum
    tokens = config.data.batch_size * seq_len * accum * dp_size
    return (f"one optimizer step holds {tokens:,} tokens: --batch-size {config.data.batch_size} x seq_len {seq_len} "
            f"x --grad-accum {accum} micro-steps x {dp_size} data-parallel rank(s)")
