"""The training section (`--steps`, `--grad-accum`, `--global-batch-tokens`, `--eval-every`, `--seed`,
`--skip-steps`, `--device`): the loop's own options, read by `shardkit.train.loop` and `shardkit.train.step`
(how many steps, how many micro-steps each, when to evaluate, which steps to skip, where to run)."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option
from shardkit.train.config.checks import MAX_GLOBAL_BATCH_TOKENS, MAX_MICRO_STEPS, MAX_STEPS, check, check_at_most
from shardkit.train.step_ranges import format_steps, parse_steps


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The training loop: how long it runs, what one optimizer step holds, when it evaluates."""

    steps: int = option(1000, "optimizer steps to train for; resuming with another value rescales the "
                        "learning-rate schedule to the new total from the next step (the run prints the change)")
    grad_accum: int | None = option(None, "micro-steps per optimizer step (gradients sync only on the last); "
                                    "default 1, or what --global-batch-tokens implies")
    global_batch_tokens: int | None = option(
        None, "tokens per optimizer step over all data-parallel ranks, e.g. 524288 (0.5M, GPT-2/3-small's): the "
        "gradient accumulation is derived as N / (--batch-size x seq_len x data-parallel ranks), which must divide "
        "N exactly; a --grad-accum given as well must equal it")
    eval_every: int = option(0, "evaluate on --eval-data every N steps (0: only at the end)")
    seed: int = option(1234, "seed of the weight init and dropout")
    skip_steps: str = option("", "steps whose batches are drawn and dropped without an optimizer step (after a "
                             "loss spike), e.g. '1200-1260,3100'; every other step gets the batch it would have "
                             "had, the step counter and learning-rate schedule advance as usual; kept in the "
                             "checkpoint, so a resumed run goes on skipping them")
    device: str = option("auto", "'auto' (cuda when available), 'cuda' or 'cpu'", choices=("auto", "cuda", "cpu"))

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        check(self.grad_accum is None or self.grad_accum >= 1, f"--grad-accum must be >= 1, got {self.grad_accum}")
        check(self.global_batch_tokens is None or self.global_batch_tokens >= 1,
              f"--global-batch-tokens must be >= 1, got {self.global_batch_tokens}")
        check_at_most("steps", self.steps, MAX_STEPS, "optimizer steps")
        check_at_most("grad-accum", self.grad_accum, MAX_MICRO_STEPS, "micro-steps per optimizer step")
        check_at_most("global-batch-tokens", self.global_batch_tokens, MAX_GLOBAL_BATCH_TOKENS,
                      "tokens per optimizer step")
        if self.grad_accum is None and self.global_batch_tokens is None:
            object.__setattr__(self, "grad_accum", 1)
        check(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        object.__setattr__(self, "skip_steps", format_steps(parse_steps(self.skip_steps)))
