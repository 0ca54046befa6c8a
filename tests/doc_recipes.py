"""The Python recipes of docs/INTEGRATIONS.md as a test runs them: each block as written, with only what
tests/test_doc_commands.py changes in a shell command (the dataset URL and the sizes, set on the recipe's own
`NAME = value` lines) and one line added after a line of the recipe that records each step's sample ids in `SEEN`
(through the documented `sample_id` of a batch or an adapter's `on_sample_ids` hook).

| recipe line | run as |
| --- | --- |
| `DATASET = "s3://bucket/dataset"` | the test's dataset (60 samples of 17 tokens) |
| `BATCH_SIZE = 8`; `MAX_STEPS, SAVE_EVERY = ...` | 4; the run's steps, a checkpoint every 5 steps |
| torchtitan: `SEQ_LEN, VOCAB = 2048, 50304` | 16, 512 |
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "INTEGRATIONS.md"
BATCH_SIZE = 4
SAVE_EVERY = 5


@dataclass(frozen=True)
class Recipe:
    """Where a recipe is and how it runs.

    Attributes:
        section: the heading of its section.
        record_after: the recipe line after which the recording line goes (the line, stripped).
        record: the recording line (indented like the line after which it goes).
        block: its Python block within the section.
        sizes: sizes of its own, beside the common ones (`NAME = value` lines).
        multi_rank_env: the environment its documented multi-rank launch sets on CPU machines.
        launcher: how its documented one-process launch starts it ("torchrun": with torchrun and one process).
        dataset_options: the `StreamingDataset` options it passes (shardkit's own loader reads with the same).
    """

    section: str
    record_after: str
    record: str
    block: int = 0
    sizes: dict[str, str] = field(default_factory=dict)
    multi_rank_env: dict[str, str] = field(default_factory=dict)
    launcher: str = "python"
    dataset_options: dict = field(default_factory=dict)


RECIPES = {
    "huggingface": Recipe(
        "transformers `Trainer` and accelerate",
        "trainer = ShardkitTrainer(model=model, args=args, train_dataset=dataset)",
        "trainer.on_sample_ids = lambda step, ids: SEEN.append([step, ids.tolist()])",
        multi_rank_env={"ACCELERATE_USE_CPU": "true"}, dataset_options={"shuffle_window": 8192}),
    "accelerate": Recipe(
        "accelerate without the Trainer", "step += 1", 'SEEN.append([step, batch["sample_id"].tolist()])',
        multi_rank_env={"ACCELERATE_USE_CPU": "true"}),
    "torchtitan": Recipe(
        "torchtitan", "checkpointer.load(step=-1)  # the latest checkpoint, if any, the loader included",
        "dataloader.on_sample_ids = lambda step, ids: SEEN.append([step, ids.tolist()])", block=1,
        sizes={"SEQ_LEN, VOCAB": "16, 512"}, launcher="torchrun"),
    "torchdata": Recipe(
        "torchdata `StatefulDataLoader` and torch `DataLoader`", "step += 1",
        'SEEN.append([step, batch["sample_id"].tolist()])'),
    "lightning": Recipe(
        "Lightning", 'tokens = batch["tokens"].long()',
        'SEEN.append([self.global_step + 1, batch["sample_id"].tolist()])'),
}
# The blocks that are not a training run: recipe name -> (section, block).
CONFIG_BLOCKS = {"torchtitan-config": ("torchtitan", 0)}


def python_blocks(section: str) -> list[str]:
    """The Python blocks of the document's section `## section`, as written."""
    parts = re.split(r"^## (.*)\n", DOC.read_text(), flags=re.M)
    bodies = dict(zip(parts[1::2], parts[2::2]))
    if section not in bodies:
        raise KeyError(f"{DOC} has no section '## {section}'")
    return re.findall(r"^```python\n(.*?)^```", bodies[section], flags=re.S | re.M)


def all_python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def with_values(script: str, values: dict[str, str]) -> str:
    """`script` with each `NAME = ...` line of `values` set to its value (each line must be there once)."""
    for name, value in values.items():
        script, found = re.subn(rf"^{re.escape(name)} = .*$", f"{name} = {value}", script, flags=re.M)
        if found != 1:
            raise ValueError(f"{DOC}: the recipe has {found} lines '{name} = ...', the test sets one")
    return script


def with_line_after(script: str, anchor: str, line: str) -> str:
    """`script` with `line` added after its one line that reads `anchor` (stripped), at that line's indent."""
    lines = script.splitlines(keepends=True)
    found = [i for i, text in enumerate(lines) if text.strip() == anchor]
    if len(found) != 1:
        raise ValueError(f"{DOC}: the recipe has {len(found)} lines {anchor!r}, the test records after one")
    at = found[0]
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    return "".join(lines[:at + 1] + [f"{indent}{line}\n"] + lines[at + 1:])


def runnable(name: str, *, dataset: str, steps: int) -> str:
    """Recipe `name` as a test runs it: on `dataset`, `steps` steps, recording every step's ids in `SEEN`."""
    recipe = RECIPES[name]
    script = python_blocks(recipe.section)[recipe.block]
    script = with_values(script, {"DATASET": repr(dataset), "BATCH_SIZE": str(BATCH_SIZE),
                                  "MAX_STEPS, SAVE_EVERY": f"{steps}, {SAVE_EVERY}", **recipe.sizes})
    return with_line_after(script, recipe.record_after, recipe.record)
