"""The model section (`--n-layer`, `--d-model`, ...), read by `shardkit.train.model` to build the decoder-only
transformer and by `shardkit.train.checkpoint` to compare a resumed run's model with the checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option, option_name
from shardkit.train.config.checks import MAX_PARAMETERS, MAX_VOCAB_MULTIPLE, check

MODEL_STYLES = ("gpt2", "llama")


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
        check(self.style in MODEL_STYLES, f"--style must be one of {MODEL_STYLES}, got {self.style!r}")
        for name in ("n_layer", "n_head", "d_model"):
            check(getattr(self, name) >= 1, f"{option_name(name)} must be >= 1, got {getattr(self, name)}")
        check(self.d_model % self.n_head == 0,
               f"--d-model ({self.d_model}) must be divisible by --n-head ({self.n_head})")
        check((self.d_model // self.n_head) % 2 == 0 or self.style != "llama",
               f"RoPE needs an even head size: change --d-model or --n-head (head size {self.d_model // self.n_head})")
        kv = self.n_kv_head or self.n_head
        check(kv >= 1 and self.n_head % kv == 0,
               f"--n-head ({self.n_head}) must be a multiple of --n-kv-head ({self.n_kv_head})")
        check(self.style == "llama" or kv == self.n_head, "--n-kv-head is only supported with --style llama")
        for name in ("vocab_size", "seq_len", "d_ff"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{option_name(name)} must be >= 1, got {value}")
        check(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")
        check(self.init_std > 0, f"--init-std must be positive, got {self.init_std}")
        check(1 <= self.make_vocab_size_divisible_by <= MAX_VOCAB_MULTIPLE,
               f"--make-vocab-size-divisible-by must be in 1-{MAX_VOCAB_MULTIPLE} (the vocabulary is padded to a "
               f"multiple of it), got {self.make_vocab_size_divisible_by}")
        # An absurd size would otherwise allocate (or loop over layers) for minutes before running out of memory.
        parameters = self.n_layer * (4 * self.d_model ** 2 + 3 * self.d_model * self.hidden_size) + (
            (self.padded_vocab_size or 0) + (self.seq_len or 0)) * self.d_model
        check(parameters <= MAX_PARAMETERS,
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

