"""What every section's `__post_init__` shares: the check that names an option, and the upper bounds of the
size options (each far beyond any real run, so that a typo or an overflowed expression is refused at once)."""

from __future__ import annotations


def check(condition: bool, message: str) -> None:
    """Raise `ValueError(message)` unless `condition`: the message names the option to change."""
    if not condition:
        raise ValueError(message)


def check_at_most(option: str, value: int | None, bound: int, unit: str) -> None:
    """Refuse a size option over its upper bound (None: not given), naming the option and the bound."""
    check(value is None or value <= bound, f"--{option} {value} is over its upper bound of {bound:,} {unit}: "
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
# Upper bounds of the size options that set a loop count (--global-batch-tokens 2**70: 4.6e18 micro-steps, no
# step ever made).
MAX_STEPS = 10**9  # optimizer steps: 1,000 times the longest published pre-training runs
MAX_MICRO_STEPS = 2**20  # micro-steps per optimizer step (--grad-accum, or what --global-batch-tokens implies)
MAX_GLOBAL_BATCH_TOKENS = 2**40  # tokens per optimizer step: 10,000 times GPT-3's 3.2M
MAX_BATCH_SIZE = 2**20  # samples per rank per micro-step
MAX_EVAL_BATCHES = 2**20  # batches per rank in one evaluation
MAX_NUM_WORKERS = 1024  # loader processes per rank
MAX_PP_MICROBATCHES = 2**16  # micro-batches per pipeline step
