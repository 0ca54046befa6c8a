"""The model a checkpoint holds: its record in the marker (every `ModelConfig` field), and on resume the model to
build, matched field by field with the run's or taken from the checkpoint."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from shardkit.options import option_name
from shardkit.train.config import ModelConfig

logger = logging.getLogger(__name__)


def model_record(config: ModelConfig) -> dict[str, Any]:
    """What a checkpoint's marker records of the model: every `ModelConfig` field and the padded vocabulary."""
    return {**dataclasses.asdict(config), "padded_vocab_size": config.padded_vocab_size}


def saved_model_config(record: dict[str, Any], *, path: str | Path) -> ModelConfig:
    """The `ModelConfig` a checkpoint's model record describes. A field the record lacks (the checkpoint
    predates it) takes the value its metadata's `absent` names, else its default; names the record holds
    that are no field (e.g. `padded_vocab_size`) are derived or obsolete and not read."""
    values = {f.name: record[f.name] if f.name in record else f.metadata.get("absent", f.default)
              for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {path}: its model record is damaged ({err})") from err


def model_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """'--NAME: checkpoint A, this run B' for each architecture field that differs (every `ModelConfig`
    field but those declared `resumable_change`), and for the padded vocabulary."""
    differences = [f"{option_name(f.name)}: checkpoint {getattr(saved, f.name)}, this run {getattr(current, f.name)}"
                   for f in dataclasses.fields(ModelConfig)
                   if not f.metadata.get("resumable_change") and getattr(saved, f.name) != getattr(current, f.name)]
    if saved.padded_vocab_size != current.padded_vocab_size:
        differences.append(f"padded vocabulary (--vocab-size rounded up to a multiple of --make-vocab-size-divisible-by "
                           f"{saved.make_vocab_size_divisible_by} / {current.make_vocab_size_divisible_by}): "
                           f"checkpoint {saved.padded_vocab_size}, this run {current.padded_vocab_size}")
    return differences


def model_to_resume(path: str | Path, meta: dict[str, Any], current: ModelConfig, *, from_checkpoint: bool,
                    dataset_vocab: int) -> ModelConfig:
    """The model a run resumed from checkpoint `path` (marker `meta`) builds.

    `from_checkpoint`: the checkpoint's configuration, which must suit the dataset (same `seq_len`, a
    vocabulary at least the tokenizer's). Otherwise `current` (the run's options and the dataset's sizes),
    which must match the checkpoint's in every architecture field.

    Raises:
        ValueError: naming every field that differs, with both values.
    """
    record = meta.get("model")
    if not isinstance(record, dict):  # a marker without a model record: nothing to check against
        return current
    saved = saved_model_config(record, path=path)
    if from_checkpoint:
        problems = []
        if saved.seq_len != current.seq_len:
            problems.append(f"--seq-len: checkpoint {saved.seq_len}, the dataset's samples {current.seq_len}")
        if saved.vocab_size < dataset_vocab:
            problems.append(f"--vocab-size: checkpoint {saved.vocab_size}, the dataset's tokenizer {dataset_vocab}")
        if problems:
            raise ValueError(f"checkpoint {path} holds a model for other data: " + "; ".join(problems)
                             + "; resume with the dataset it was trained on, or use another --checkpoint-dir")
        logger.info("building the model checkpoint %s records (--model-from-checkpoint, on when no model option "
                    "is given): %s", path, " ".join(f"{option_name(k)} {v}" for k, v in dataclasses.asdict(saved).items()))
        return saved
    differences = model_differences(saved, current)
    if differences:
        raise ValueError(f"checkpoint {path} was saved for another model: " + "; ".join(differences)
                         + ". Resume with the checkpoint's values (or with no model option at all, which builds "
                         "the checkpoint's model), or use another --checkpoint-dir")
    return current
