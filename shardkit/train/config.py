"""Trainer configuration: one frozen, keyword-only dataclass per component, nested in `TrainConfig`.

Every field carries its help text in `metadata["help"]`; `shardkit.train.options` turns the fields
into command-line options one-to-one (`--lr 3e-4` or `--optimizer.lr 3e-4`), so `--help` is this
file's documentation. Checks live in `__post_init__` and name the option to change.

Field names are unique across sections so that the short form `--NAME` is never ambiguous.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass, field
from typing import Any

from shardkit.loaders.config import LoaderConfig
from shardkit.loaders.order.schedule import Schedule, parse_schedule
from shardkit.train.step_ranges import format_steps, parse_steps
from shardkit.options import option, option_name, parse_storage_options, storage_options_option

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp", "hsdp", "diloco")
OPTIMIZERS = ("adamw", "sgd")
SYNC_DTYPES = ("fp32", "bf16")
COMM_HOOKS = ("none", "bf16", "powersgd")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
MODEL_STYLES = ("gpt2", "llama")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_at_most(option: str, value: int | None, bound: int, unit: str) -> None:
    """Refuse a size option over its upper bound (None: not given), naming the option and the bound."""
    _check(value is None or value <= bound, f"--{option} {value} is over its upper bound of {bound:,} {unit}: "
           "a value this large never finishes a loop (a typo or an overflowed expression?)")


# float32's largest finite and smallest normal numbers (torch.finfo(torch.float32).max and .tiny).
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38
# fp16: optimizer steps in a row with overflowing gradients before the run stops. From the default scale
# (2**16) 16 halvings reach the floor of 1; 16 more steps that overflow at scale 1 leave no doubt.
MAX_OVERFLOW_STEPS = 32

MAX_PARAMETERS = 10**13  # 10 trillion: beyond any one training run (40 TB of fp32 weights alone)
# Megatron pads to 128 x tensor-parallel size; 2**20 leaves room for any --tp while a padded vocabulary
# stays within reach of the parameter bound below (2**40 asked for 281 TB of embedding rows).
MAX_VOCAB_MULTIPLE = 2**20
# Upper bounds of the size options that set a loop count, each far beyond any real run, so that a typo or an
# overflowed expression (--global-batch-tokens 2**70: 4.6e18 micro-steps, no step ever made) is refused at once.
MAX_STEPS = 10**9  # optimizer steps: 1,000 times the longest published pre-training runs
MAX_MICRO_STEPS = 2**20  # micro-steps per optimizer step (--grad-accum, or what --global-batch-tokens implies)
MAX_GLOBAL_BATCH_TOKENS = 2**40  # tokens per optimizer step: 10,000 times GPT-3's 3.2M
MAX_BATCH_SIZE = 2**20  # samples per rank per micro-step
MAX_EVAL_BATCHES = 2**20  # batches per rank in one evaluation
MAX_NUM_WORKERS = 1024  # loader processes per rank
MAX_PP_MICROBATCHES = 2**16  # micro-batches per pipeline step


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decoder-only transformer (see `shardkit.train.model` for the two styles).

    Every field is part of the model's identity, which a checkpoint records and a resume must match
    (`shardkit.train.checkpoint.model_differences`), except the fields whose metadata says
    `resumable_change=True`: those may change between a run and its resumption. A field added after
    checkpoints were saved without it names, in `absent`, the value those checkpoints imply (default:
    the field's default).
    """

    style: str = option("llama", "architecture: 'llama' (RoPE, RMSNorm, SwiGLU, no biases) or 'gpt2' "
                        "(learned positions, LayerNorm, GELU MLP, biases)", choices=MODEL_STYLES)
    vocab_size: int | None = option(None, "vocabulary size; default: the dataset manifest's tokenizer.vocab_size "
                                    "(the model pads it, see --make-vocab-size-divisible-by)")
    make_vocab_size_divisible_by: int = option(
        128, "the embedding and output projection hold the vocabulary rounded up to a multiple of this (Megatron's "
        "option; GPT-2's 50257 becomes 50304): the padded rows' logits are -inf, so they never enter the loss nor "
        "a sample; a multiple of 128 suits tensor cores and every power-of-two --tp up to 128; 1: no padding",
        # Compared on resume through the padded size it gives (a checkpoint records that too); checkpoints
        # saved before padding existed hold exactly --vocab-size rows.
        resumable_change=True, absent=1)
    seq_len: int | None = option(None, "context length; default: the dataset manifest's seq_len")
    n_layer: int = option(2, "number of transformer blocks")
    n_head: int = option(4, "attention heads per block")
    n_kv_head: int | None = option(None, "key/value heads (grouped-query attention, llama style); default n_head")
    d_model: int = option(64, "width of the residual stream")
    d_ff: int | None = option(None, "hidden width of the MLP; default 4*d_model (gpt2) or ~8/3*d_model (llama)")
    dropout: float = option(0.0, "dropout probability (0 keeps training bitwise reproducible); may change when "
                            "resuming", resumable_change=True)
    rope_theta: float = option(10000.0, "RoPE base (llama style)")
    norm_eps: float = option(1e-5, "epsilon of the normalisation layers")
    init_std: float = option(0.02, "standard deviation of the weight init")
    tie_embeddings: bool = option(True, "share the token embedding with the output projection")
    document_mask: bool = option(False, "mask attention so tokens attend only within their own document "
                                 "(needs shards that store document boundaries)")

    def __post_init__(self) -> None:
        _check(self.style in MODEL_STYLES, f"--style must be one of {MODEL_STYLES}, got {self.style!r}")
        for name in ("n_layer", "n_head", "d_model"):
            _check(getattr(self, name) >= 1, f"{option_name(name)} must be >= 1, got {getattr(self, name)}")
        _check(self.d_model % self.n_head == 0,
               f"--d-model ({self.d_model}) must be divisible by --n-head ({self.n_head})")
        _check((self.d_model // self.n_head) % 2 == 0 or self.style != "llama",
               f"RoPE needs an even head size: change --d-model or --n-head (head size {self.d_model // self.n_head})")
        kv = self.n_kv_head or self.n_head
        _check(kv >= 1 and self.n_head % kv == 0,
               f"--n-head ({self.n_head}) must be a multiple of --n-kv-head ({self.n_kv_head})")
        _check(self.style == "llama" or kv == self.n_head, "--n-kv-head is only supported with --style llama")
        for name in ("vocab_size", "seq_len", "d_ff"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"{option_name(name)} must be >= 1, got {value}")
        _check(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        _check(self.init_std > 0, f"--init-std must be positive, got {self.init_std}")
        _check(1 <= self.make_vocab_size_divisible_by <= MAX_VOCAB_MULTIPLE,
               f"--make-vocab-size-divisible-by must be in 1-{MAX_VOCAB_MULTIPLE} (the vocabulary is padded to a "
               f"multiple of it), got {self.make_vocab_size_divisible_by}")
        # An absurd size would otherwise allocate (or loop over layers) for minutes before running out of memory.
        parameters = self.n_layer * (4 * self.d_model ** 2 + 3 * self.d_model * self.hidden_size) + (
            (self.padded_vocab_size or 0) + (self.seq_len or 0)) * self.d_model
        _check(parameters <= MAX_PARAMETERS,
               f"the model would have about {parameters:.3g} parameters (--n-layer {self.n_layer}, --d-model "
               f"{self.d_model}, --d-ff {self.hidden_size}), more than {MAX_PARAMETERS:.0e}: check those sizes")

    @property
    def padded_vocab_size(self) -> int | None:
        """Rows of the token embedding and output projection: `vocab_size` rounded up to a multiple of
        `make_vocab_size_divisible_by` (None while `vocab_size` is unset).

        Padded whatever the layout, as Megatron does, because a vocabulary that is a multiple of 128
        keeps the output projection's matmul on tensor-core-friendly shapes, and because a size that
        does not depend on --tp keeps checkpoints loadable in every layout (Megatron pads to 128 x tp).
        """
        if self.vocab_size is None:
            return None
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

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


# A trailing ":<number>" of a --data entry is its mixture weight; URLs hold ':' too (s3://b/x, host:port).
_WEIGHTED_ENTRY = re.compile(r"^(?P<url>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")
_SCHEME_AND_HOST = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*$")
# A trailing ":[[step,weight],...]" (optionally ":linear:[[...]]") is a weight schedule.
_SCHEDULED_ENTRY = re.compile(r"^(?P<url>.+?):(?P<schedule>(?:[A-Za-z]+:)?\[.*\])$")


def _split_outside_brackets(text: str) -> list[str]:
    parts, current, depth = [], [], 0
    for char in text:
        depth += (char == "[") - (char == "]")
        if depth == 0 and (char == "," or char.isspace()):
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p for p in parts if p]


def data_entries(text: str) -> list[tuple[str, float | Schedule]]:
    """The (URL, weight) entries of a `--data` value: URLs separated by commas or spaces (outside
    brackets), each with an optional trailing `:WEIGHT` (default 1) or `:[[STEP,WEIGHT],...]` schedule.

    Raises:
        ValueError: an empty entry, a weight that is not positive or a bad schedule, naming the entry.
    """
    entries: list[tuple[str, float | Schedule]] = []
    # Split on commas and spaces outside brackets: a schedule's JSON holds commas.
    for entry in _split_outside_brackets(text):
        scheduled = _SCHEDULED_ENTRY.match(entry)
        if scheduled is not None:
            entries.append((scheduled["url"], parse_schedule(scheduled["schedule"], what=f"--data entry {entry!r}")))
            continue
        match = _WEIGHTED_ENTRY.match(entry)
        # "http://host:9000" ends in a port, not a weight: a weight follows a path.
        if match is None or _SCHEME_AND_HOST.match(match["url"]):
            entries.append((entry, 1.0))
            continue
        weight = float(match["weight"])
        _check(0 < weight < math.inf, f"--data entry {entry!r}: the weight after the last ':' must be positive "
                                      "and finite")
        entries.append((match["url"], weight))
    _check(bool(entries) and all(url for url, _ in entries), f"--data {text!r} holds an empty entry")
    fixed = [weight for _, weight in entries if isinstance(weight, float)]
    _check(math.isfinite(sum(fixed)) and all(w / sum(fixed) > 0 for w in fixed),
           f"--data weights {', '.join(f'{w:g}' for w in fixed)}: their sum must be finite and each share of it "
           "above zero; scale them down (only their ratios matter)")
    return entries


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training and evaluation samples come from (shardkit datasets, any fsspec URL), and how the
    loader orders, batches and caches them."""

    data: str = option("", nargs="+", help=(
        "training dataset URL (a directory or prefix holding shardkit.json), or a mixture: several "
                "URL:WEIGHT entries separated by spaces or commas, e.g. --data s3://b/web:0.7 s3://b/code:0.3 "
                "(only a trailing :NUMBER is a weight); a weight may be a schedule by loader step, as JSON: "
                "URL:[[0,0.9],[10000,0.5]] (piecewise constant) or URL:linear:[[0,0.9],[10000,0.5]]"))
    allow_mixture_change: bool = option(False, "on resume, continue from the checkpoint's position with the "
                                        "--data streams and weights given now, although they differ from the saved "
                                        "mixture (no sample of a stream's current epoch is repeated; the loader "
                                        "state records the change); without it such a resume is refused")
    eval_data: str | None = option(None, "held-out dataset URL evaluated every --eval-every steps")
    data_service: str | None = option(None, "read the training batches from a `shardkit serve` data service at this "
                                      "address (grpc://HOST:PORT) serving --data: its workers tokenize and batch, "
                                      "the service decides the data options (docs/SERVICE.md); the token comes from "
                                      "$SHARDKIT_SERVICE_TOKEN", metavar="URL")
    tokenizer: str | None = option(None, "train straight from raw text: --data names text inputs (JSONL / .gz / "
                                   ".zst, Parquet, .txt; files, directories, globs or URLs), tokenized with this "
                                   "tokenizer spec (as `shardkit build --tokenizer`) and packed on the fly; needs "
                                   "--seq-len; --eval-data then names raw text too. Weighted entries mix: an entry "
                                   "holding shardkit.json is a built dataset (of this tokenizer and --seq-len), any "
                                   "other raw text, e.g. --data built/:0.7 'code/*.jsonl.zst':0.3")
    pack: str = option("concat", "with --tokenizer: 'concat' or 'bestfit' (documents into seq_len + 1 windows)",
                       choices=("concat", "bestfit"))
    text_field: str = option("text", "with --tokenizer: the JSON key / Parquet column holding the text")
    lanes: int = option(64, "with --tokenizer: independent streams the inputs' work units are dealt into (kept on "
                        "resume; at most the number of units)")
    batch_size: int = option(8, "samples per rank per micro-step")
    cache_dir: str | None = option(None, "node-local shard cache; default: the loader's default")
    num_workers: int = option(0, "loader worker processes per rank")
    eval_batches: int = option(8, "batches per rank in one evaluation")
    storage_options: str | None = storage_options_option(
        "fsspec options for --data and --eval-data: a JSON object, e.g. '{\"endpoint_url\": \"http://...\"}', or "
        "KEY=VALUE; repeatable (may hold credentials: never printed nor saved in the run directory)")
    # Every LoaderConfig field is a data option of the same name (--shuffle, --shuffle-window, --cache-limit,
    # ...), except the order's seed, which is --data-seed (--seed seeds the weights). The evaluation set is
    # always read unshuffled.
    loader: LoaderConfig = field(default_factory=LoaderConfig, metadata={
        "help": "the loader's order, batching and cache options", "flatten": True, "rename": {"seed": "data_seed"}})

    def __post_init__(self) -> None:
        parse_storage_options(self.storage_options)  # a ValueError names the option, never the value
        if self.data:
            data_entries(self.data)
        _check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        _check(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        _check(self.eval_batches >= 1, f"--eval-batches must be >= 1, got {self.eval_batches}")
        _check(self.lanes >= 1, f"--lanes must be >= 1, got {self.lanes}")
        _check_at_most("batch-size", self.batch_size, MAX_BATCH_SIZE, "samples per rank per micro-step")
        _check_at_most("num-workers", self.num_workers, MAX_NUM_WORKERS, "loader processes per rank")
        _check_at_most("eval-batches", self.eval_batches, MAX_EVAL_BATCHES, "batches per rank")
        _check(self.data_service is None or (self.num_workers == 0 and self.tokenizer is None),
               "--data-service: the service's workers read the data: drop --num-workers and --tokenizer (give "
               "those to shardkit serve)")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The (inner) optimizer, AdamW or plain SGD, and its learning-rate schedule."""

    optimizer_name: str = option("adamw", "'adamw', or 'sgd' (plain SGD, no momentum; weight decay is then "
                                 "coupled L2)", choices=OPTIMIZERS)
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
        _check(self.optimizer_name in OPTIMIZERS,
               f"--optimizer-name must be one of {OPTIMIZERS}, got {self.optimizer_name!r}")
        _check(self.lr > 0, f"--lr must be positive, got {self.lr}")
        _check(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.warmup_steps is None or self.warmup_steps >= 0,
               f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        _check(self.schedule in SCHEDULES, f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        _check(0 < self.decay_fraction <= 1, f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        _check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "--beta1 and --beta2 must be in [0, 1)")
        _check(self.grad_clip >= 0, f"--grad-clip must be >= 0 (0 disables), got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is replicated, sharded, split by tensors and by layers over the ranks torchrun starts.

    The ranks form one device mesh (pp, dp_replicate, dp_shard, tp); the product of the four sizes is
    the world size, and one of them may be -1 ("the rest"). See docs/PARALLELISM.md.
    """

    parallel: str = option("auto", "shorthand for the data-parallel dims: 'ddp' (--dp-replicate -1), 'fsdp' "
                           "(--dp-shard -1), 'hsdp' (shard within --shard-size ranks, replicate across), 'diloco' "
                           "(--dp-replicate -1 without gradient sync: local SGD with an outer optimizer, see the "
                           "diloco options), 'none' (no data parallelism), or 'auto' (ddp, or fsdp when --tp/--pp > 1)", choices=PARALLEL_MODES)
    dp_replicate: int | None = option(None, "data-parallel replicas (gradients all-reduced); -1: the rest; "
                                      "default: from --parallel")
    dp_shard: int | None = option(None, "data-parallel ranks that shard parameters, gradients and optimizer "
                                  "state (FSDP2); -1: the rest; default: from --parallel")
    tp: int = option(1, "tensor-parallel ranks: each block's matrices split by heads and columns; -1: the rest")
    pp: int = option(1, "pipeline stages: the block stack split by layer ranges; -1: the rest")
    pp_schedule: str = option("1f1b", "pipeline schedule: 'gpipe', '1f1b', or 'interleaved1f1b' "
                              "(2 stages per rank)", choices=PP_SCHEDULES)
    pp_microbatches: int | None = option(None, "micro-batches per pipeline step (each --batch-size batch is "
                                         "split into them); default: --pp (2 x --pp when interleaved)")
    comm_stats: bool = option(True, "count the bytes each collective kind moves per step (metrics.jsonl); "
                              "a dispatch mode with a little CPU overhead per op")
    comm_hook: str = option("none", "ddp gradient communication: 'none', 'bf16' (compress to bf16) or "
                            "'powersgd' (low-rank)", choices=COMM_HOOKS)
    powersgd_rank: int = option(4, "matrix rank of the PowerSGD approximation")
    shard_size: int | None = option(None, "hsdp: ranks per shard group; default: ranks per node (LOCAL_WORLD_SIZE)")
    backend: str = option("auto", "process-group backend: 'auto' (nccl on GPU, gloo on CPU), 'gloo' or 'nccl'",
                          choices=("auto", "gloo", "nccl"))

    def __post_init__(self) -> None:
        _check(self.parallel in PARALLEL_MODES, f"--parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        _check(self.comm_hook in COMM_HOOKS, f"--comm-hook must be one of {COMM_HOOKS}, got {self.comm_hook!r}")
        _check(self.comm_hook == "none" or self.parallel in ("ddp", "auto"),
               f"--comm-hook {self.comm_hook} applies to --parallel ddp only, not {self.parallel}")
        _check(self.powersgd_rank >= 1, f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        _check(self.shard_size is None or self.shard_size >= 1, f"--shard-size must be >= 1, got {self.shard_size}")
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp}
        for name, size in sizes.items():
            _check(size is None or size == -1 or size >= 1, f"{option_name(name)} must be >= 1 or -1 (the rest), got {size}")
        rest = [name for name, size in sizes.items() if size == -1]
        _check(len(rest) <= 1, f"only one mesh dimension may be -1 (the rest), got {', '.join('--' + n for n in rest)}")
        _check(self.parallel == "auto" or (self.dp_replicate is None and self.dp_shard is None),
               f"--parallel {self.parallel} sets the data-parallel dims itself: drop it (or use --parallel auto) "
               "when giving --dp-replicate/--dp-shard")
        _check(self.pp_schedule in PP_SCHEDULES, f"--pp-schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        _check(self.pp_microbatches is None or self.pp_microbatches >= 1,
               f"--pp-microbatches must be >= 1, got {self.pp_microbatches}")
        _check_at_most("pp-microbatches", self.pp_microbatches, MAX_PP_MICROBATCHES, "micro-batches per step")


@dataclass(frozen=True, kw_only=True)
class DilocoConfig:
    """--parallel diloco: H local steps without gradient communication, then an outer optimizer step
    (SGD with Nesterov momentum) on the rank-averaged parameter change (see docs/PARALLELISM.md)."""

    sync_every: int = option(50, "H: inner optimizer steps between two synchronisations of a fragment")
    outer_lr: float = option(0.7, "outer optimizer learning rate (1 with momentum 0: plain parameter averaging)")
    outer_momentum: float = option(0.9, "outer optimizer momentum")
    outer_nesterov: bool = option(True, "Nesterov momentum in the outer optimizer")
    sync_fragments: int = option(1, "F: split the model into F fragments synchronised at staggered steps "
                                 "(streaming DiLoCo: the peak bandwidth drops by F)")
    sync_dtype: str = option("fp32", "dtype of the pseudo-gradient all-reduce: 'fp32' or 'bf16' (half the bytes)",
                             choices=SYNC_DTYPES)
    sync_delay: int = option(0, "1: launch the outer all-reduce asynchronously and apply it at the next "
                             "synchronisation of the fragment (bounded staleness 1); 0: apply it at once")

    def __post_init__(self) -> None:
        _check(self.sync_every >= 1, f"--sync-every must be >= 1, got {self.sync_every}")
        _check(self.outer_lr > 0, f"--outer-lr must be positive, got {self.outer_lr}")
        _check(0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        _check(1 <= self.sync_fragments <= self.sync_every,
               f"--sync-fragments must be between 1 and --sync-every ({self.sync_every}), got {self.sync_fragments}")
        _check(self.sync_dtype in SYNC_DTYPES, f"--sync-dtype must be one of {SYNC_DTYPES}, got {self.sync_dtype!r}")
        _check(self.sync_delay in (0, 1), f"--sync-delay must be 0 or 1, got {self.sync_delay}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """torch.distributed.checkpoint saves of the whole training state."""

    checkpoint_dir: str | None = option(None, "where checkpoints go; default RUN_DIR/checkpoints")
    checkpoint_every: int = option(0, "save every N steps (0: only at the end and on SIGTERM/SIGINT)")
    keep: int = option(3, "keep the newest K complete checkpoints, delete older ones")
    async_save: bool = option(False, "save in the background (dcp.async_save); training continues meanwhile")
    async_writer: str = option("process", "with --async-save: 'process' (DCP's writer process, off the trainer's GIL; "
                               "one process without a process group writes in a thread) or 'thread'",
                               choices=("process", "thread"))
    resume: str = option("auto", "'auto' (newest complete checkpoint if any), 'none', or a checkpoint directory")
    model_from_checkpoint: bool | None = option(
        None, "on resume, build the model the checkpoint records (as nanoGPT does) and ignore this run's model "
        "options; false: build it from the model options and refuse to resume when an architecture field differs "
        "from the checkpoint's; default: true when neither a model option nor --preset is given, else false")
    save_final: bool = option(True, "save a checkpoint after the last step")

    def __post_init__(self) -> None:
        _check(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        _check(self.keep >= 1, f"--keep must be >= 1, got {self.keep}")
        _check(self.async_writer in ("process", "thread"),
               f"--async-writer must be 'process' or 'thread', got {self.async_writer!r}")
        _check(bool(self.resume), "--resume must be 'auto', 'none' or a checkpoint directory")


def _is_address(text: str) -> bool:
    """An IP address or a host name (not looked up here: the server's bind names what fails)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", text) is not None


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What the run writes: stdout lines, RUN_DIR/metrics.jsonl, TensorBoard, sample-id logs."""

    run_dir: str | None = option(None, "output directory; default runs/PRESET-DATASETNAME")
    log_every: int = option(10, "print a metrics line every N steps (every step goes to metrics.jsonl)")
    tensorboard: bool = option(True, "also write TensorBoard events when tensorboard is installed")
    log_sample_ids: bool = option(False, "write the sample ids each rank consumes per step to RUN_DIR/samples/")
    metrics_port: int = option(0, "serve Prometheus metrics at http://HOST:PORT/metrics, each rank on PORT + its "
                               "local rank (0: off)")
    metrics_address: str = option("127.0.0.1", "address the metrics endpoints listen on: loopback by default; "
                                  "0.0.0.0 for every interface (see docs/OBSERVABILITY.md before exposing them)")
    starvation_window: int = option(50, "steps over which the data-wait fraction is averaged for the starvation "
                                    "warning")
    starvation_threshold: float = option(0.5, "warn once when the data-wait fraction over --starvation-window steps "
                                         "exceeds this (1 disables the warning)")

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")
        _check(0 <= self.metrics_port < 65536, f"--metrics-port must be in 0-65535, got {self.metrics_port}")
        _check(_is_address(self.metrics_address),
               f"--metrics-address must be an IP address or host name, got {self.metrics_address!r}")
        _check(self.starvation_window >= 1, f"--starvation-window must be >= 1, got {self.starvation_window}")
        _check(0 < self.starvation_threshold, f"--starvation-threshold must be > 0, got {self.starvation_threshold}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole run: the training loop's own options plus one section per component."""

    preset: str = option("tiny", "model preset: " + ", ".join(("tiny", "gpt2-124m", "gpt2-350m", "llama-1b")))
    steps: int = option(1000, "optimizer steps to train for; resuming with another value rescales the "
                        "learning-rate schedule to the new total from the next step (the run prints the change)")
    grad_accum: int | None = option(None, "micro-steps per optimizer step (gradients sync only on the last); "
                                    "default 1, or what --global-batch-tokens implies")
    global_batch_tokens: int | None = option(
        None, "tokens per optimizer step over all data-parallel ranks, e.g. 524288 (0.5M, GPT-2/3-small's): the "
        "gradient accumulation is derived as N / (--batch-size x seq_len x data-parallel ranks), which must divide "
        "N exactly; a --grad-accum given as well must equal it")
    precision: str = option("auto", "'bf16' or 'fp16' autocast / FSDP mixed precision (fp32 master weights and "
                            "optimizer; fp16 with dynamic loss scaling), 'fp32', or 'auto' (bf16 on GPUs with native "
                            "bf16, fp16 on older GPUs, fp32 on CPU; the log says which and why)", choices=PRECISIONS)
    loss_scale: float = option(65536.0, "fp16: initial loss scale; halved at every step whose gradients overflow "
                               "(that step's update is skipped), doubled after --loss-scale-growth-interval clean "
                               "steps in a row")
    loss_scale_growth_interval: int = option(2000, "fp16: clean steps in a row before the loss scale doubles")
    max_overflow_steps: int = option(
        MAX_OVERFLOW_STEPS, "fp16: stop the run (exit 1) after this many optimizer steps in a row whose gradients "
        "overflowed: the scale has been halved that often (it stops at a floor of min(1, --loss-scale)), so the "
        "inf/NaN comes from the model, not from fp16's range; resume from the last checkpoint with a lower --lr, "
        "--skip-steps over the bad batches, or --precision bf16")
    compile: bool = option(False, "torch.compile each transformer block")
    compile_mode: str = option("default", "torch.compile mode with --compile: 'reduce-overhead' and 'max-autotune' "
                               "also capture CUDA graphs (single GPU or DDP, one micro-step per step, no activation "
                               "checkpointing or document masking; refused elsewhere with the reason), "
                               "'max-autotune-no-cudagraphs' tunes kernels without them", choices=COMPILE_MODES)
    activation_checkpointing: bool = option(False, "recompute block activations in the backward pass")
    eval_every: int = option(0, "evaluate on --eval-data every N steps (0: only at the end)")
    seed: int = option(1234, "seed of the weight init and dropout")
    skip_steps: str = option("", "steps whose batches are drawn and dropped without an optimizer step (after a "
                             "loss spike), e.g. '1200-1260,3100'; every other step gets the batch it would have "
                             "had, the step counter and learning-rate schedule advance as usual; kept in the "
                             "checkpoint, so a resumed run goes on skipping them")
    device: str = option("auto", "'auto' (cuda when available), 'cuda' or 'cpu'", choices=("auto", "cuda", "cpu"))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(self.preset in PRESETS, f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        _check(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        _check(self.grad_accum is None or self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        _check(self.global_batch_tokens is None or self.global_batch_tokens >= 1,
               f"--global-batch-tokens must be >= 1, got {self.global_batch_tokens}")
        _check_at_most("steps", self.steps, MAX_STEPS, "optimizer steps")
        _check_at_most("grad-accum", self.grad_accum, MAX_MICRO_STEPS, "micro-steps per optimizer step")
        _check_at_most("global-batch-tokens", self.global_batch_tokens, MAX_GLOBAL_BATCH_TOKENS,
                       "tokens per optimizer step")
        if self.grad_accum is None and self.global_batch_tokens is None:
            object.__setattr__(self, "grad_accum", 1)
        _check(self.precision in PRECISIONS, f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        self._check_loss_scaling()
        self._check_compile_mode()
        _check(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        object.__setattr__(self, "skip_steps", format_steps(parse_steps(self.skip_steps)))
        _check(self.parallelism.parallel == "diloco" or self.diloco == DilocoConfig(),
               "the diloco options (--sync-every, --outer-lr, ...) apply to --parallel diloco only, "
               f"not {self.parallelism.parallel}")
        if self.optimizer.warmup_steps is None:  # resolved here so that config.json records the value used
            object.__setattr__(self, "optimizer", dataclasses.replace(
                self.optimizer, warmup_steps=min(100, self.steps // 10)))
        _check(self.optimizer.warmup_steps < self.steps or self.steps == 1,
               f"--warmup-steps ({self.optimizer.warmup_steps}) must be smaller than --steps ({self.steps})")
        # Checked here, not when the loader opens, so that `shardkit tune` refuses it before any trial starts.
        _check(self.data.tokenizer is None or self.model.seq_len is not None,
               "--tokenizer (training from raw text) needs --seq-len: there is no manifest to take it from")

    def _check_compile_mode(self) -> None:
        """What the options alone rule out; the layout and the device are checked once resolved
        (`shardkit.train.parallel.compile.cuda_graph_refusal`)."""
        _check(self.compile_mode in COMPILE_MODES,
               f"--compile-mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        _check(self.compile or self.compile_mode == "default", f"--compile-mode {self.compile_mode} needs --compile")
        if self.compile_mode not in ("reduce-overhead", "max-autotune"):
            return
        # CUDA graph trees lose gradients accumulated over micro-steps (pytorch issues 96693, 169545).
        _check(self.grad_accum == 1, f"--compile-mode {self.compile_mode} captures CUDA graphs, which lose gradients "
                                     "accumulated over micro-steps: use --grad-accum 1 or --compile-mode default")
        _check(self.data.loader.max_tokens is None,
               f"--compile-mode {self.compile_mode} captures CUDA graphs for fixed shapes, and --max-tokens gives "
               "batches of varying shapes: use --compile-mode default")

    def _check_loss_scaling(self) -> None:
        """Loss-scaling options, and the layouts fp16 does not compose with. ('auto' may pick fp16 on a GPU
        without bf16: the trainer checks its choice again, with the precision resolved.)"""
        # The scale lives in a float32 tensor: 1e39 would be inf there, 1e-39 a subnormal that turns the
        # gradients into NaN.
        _check(FLOAT32_TINY <= self.loss_scale <= FLOAT32_MAX,
               f"--loss-scale must be a normal float32 number, between {FLOAT32_TINY:.4g} and {FLOAT32_MAX:.4g}, "
               f"got {self.loss_scale:g}")
        _check(self.loss_scale_growth_interval >= 1,
               f"--loss-scale-growth-interval must be >= 1, got {self.loss_scale_growth_interval}")
        _check(self.max_overflow_steps >= 1, f"--max-overflow-steps must be >= 1, got {self.max_overflow_steps}")
        scaling = (self.loss_scale, self.loss_scale_growth_interval, self.max_overflow_steps)
        _check(self.precision in ("fp16", "auto") or scaling == (65536.0, 2000, MAX_OVERFLOW_STEPS),
               "--loss-scale, --loss-scale-growth-interval and --max-overflow-steps apply to --precision fp16 only, "
               f"not {self.precision}")
        if self.precision != "fp16":
            return
        # PowerSGD keeps the compression error of each step and adds it to the next: the inf/NaN of one
        # overflowing step would stay in that error and make every later step overflow too.
        _check(self.parallelism.comm_hook != "powersgd",
               "--comm-hook powersgd does not compose with --precision fp16 (dynamic loss scaling): an overflowing "
               "step poisons PowerSGD's error feedback; use --comm-hook none or bf16, or --precision bf16/fp32")

    def to_dict(self) -> dict[str, Any]:
        """All values, with `storage_options` redacted (it may hold credentials)."""
        values = dataclasses.asdict(self)
        if values["data"]["storage_options"] is not None:
            values["data"]["storage_options"] = "<redacted>"
        return values


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
    "parallelism": ParallelConfig, "diloco": DilocoConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}

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
    if config.global_batch_tokens is None:
        return config
    micro = config.data.batch_size * seq_len * dp_size
    accum, left = divmod(config.global_batch_tokens, micro)
    if left or accum == 0:
        raise ValueError(f"--global-batch-tokens {config.global_batch_tokens} is not a multiple of one micro-step's "
                         f"{micro} tokens (--batch-size {config.data.batch_size} x seq_len {seq_len} x {dp_size} "
                         f"data-parallel ranks): use a multiple of {micro}, or change --batch-size")
    _check(accum <= MAX_MICRO_STEPS, f"--global-batch-tokens {config.global_batch_tokens} makes {accum:,} micro-steps "
           f"of {micro} tokens per optimizer step, over the upper bound of {MAX_MICRO_STEPS:,}: give fewer tokens "
           "per step or a larger --batch-size")
    if config.grad_accum is not None and config.grad_accum != accum:
        raise ValueError(f"--grad-accum {config.grad_accum} disagrees with --global-batch-tokens "
                         f"{config.global_batch_tokens}, which needs {accum} micro-steps of {micro} tokens: "
                         "give only one of them")
    return dataclasses.replace(config, grad_accum=accum)


def describe_step(config: TrainConfig, *, seq_len: int, dp_size: int) -> str:
    """What one optimizer step holds, for the log."""
    tokens = config.data.batch_size * seq_len * config.grad_accum * dp_size
    return (f"one optimizer step holds {tokens:,} tokens: --batch-size {config.data.batch_size} x seq_len {seq_len} "
            f"x --grad-accum {config.grad_accum} micro-steps x {dp_size} data-parallel rank(s)")


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
            known = {name for name, _, _ in section_options(SECTIONS[key])}
            nested = {f.name for f in dataclasses.fields(SECTIONS[key]) if f.metadata.get("flatten")}
            for name, item in value.items():
                if name not in known and not (name in nested and isinstance(item, dict)):
                    raise ValueError(f"{source}: unknown option {key}.{name} (known: {', '.join(sorted(known))})")
                merged[key][name] = item
        elif key in top_fields:
            top[key] = value
        else:
            raise ValueError(f"{source}: unknown option {key!r}")
    if merged["checkpoint"].get("model_from_checkpoint") is None:
        # Nothing said about the model: a resumed run continues the checkpoint's model, not the preset's.
        merged["checkpoint"]["model_from_checkpoint"] = not values.get("model") and "preset" not in values
    sections = {name: build_section(SECTIONS[name], merged[name], source=source) for name in SECTIONS}
    return TrainConfig(**top, **sections)


def section_options(cls: type) -> list[tuple[str, tuple[str, ...], dataclasses.Field]]:
    """(option name, attribute path, field) for each option of section `cls`.

    A field marked `flatten` holds a component's own config dataclass (e.g. `LoaderConfig`): its
    fields become options of the section, renamed where `rename` says (to keep names unique).
    """
    options = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            rename = f.metadata.get("rename", {})
            options += [(rename.get(sub.name, sub.name), (f.name, sub.name), sub)
                        for sub in dataclasses.fields(f.default_factory)]
        else:
            options.append((f.name, (f.name,), f))
    return options


def build_section(cls: type, values: dict[str, Any], *, source: str = "configuration") -> Any:
    """Section `cls` from option values (flattened names, or a nested table per flattened field)."""
    paths = {name: path for name, path, _ in section_options(cls)}
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        path = paths.get(name)
        if path is None:  # a nested table such as {"loader": {...}} (config.json records this form)
            nested.setdefault(name, {}).update(value)
        elif len(path) == 1:
            own[name] = value
        else:
            nested.setdefault(path[0], {})[path[1]] = value
    for f in dataclasses.fields(cls):
        if f.name in nested:
            rename = f.metadata.get("rename", {})
            try:
                own[f.name] = f.default_factory(**nested[f.name])
            except TypeError as err:
                raise ValueError(f"{source}: {err}") from err
            except ValueError as err:  # messages start with the field's name: say the option instead
                message = str(err)
                first = message.split(" ", 1)[0]
                raise ValueError(f"{option_name(rename.get(first, first))}{message[len(first):]}") from err
    return cls(**own)
