"""`shardkit tokenizer train`: a byte-level BPE trained on the documents of build inputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from shardkit.text.documents import parse_unit
from shardkit.text.inputs import expand_inputs, iter_units
from shardkit.text.tokenizers import train_bpe


def train_from_inputs(inputs: Sequence[str], *, vocab_size: int, output: str, text_field: str = "text",
                      txt_mode: str = "file", min_frequency: int = 2, max_documents: int | None = None,
                      max_doc_chars: int = 10_000_000, storage_options: dict[str, Any] | None = None) -> dict[str, int]:
    """Train a byte-level BPE on the accepted documents of `inputs` (read as `shardkit build` reads them).

    Returns:
        {"vocab_size", "documents", "rejected"}.
    """
    files = expand_inputs(inputs, storage_options)
    counts = {"documents": 0, "rejected": 0}

    def texts() -> Iterator[str]:
        for unit in iter_units(files, text_field=text_field, txt_mode=txt_mode, max_doc_chars=max_doc_chars,
                               storage_options=storage_options):
            _, accepted, rejected, _ = parse_unit(unit, text_field=text_field, max_doc_chars=max_doc_chars)
            counts["rejected"] += len(rejected)
            for text in accepted:
                if max_documents is not None and counts["documents"] >= max_documents:
                    return
                counts["documents"] += 1
                yield text

    tokenizer = train_bpe(texts(), vocab_size=vocab_size, output=output, min_frequency=min_frequency)
    if counts["documents"] == 0:
        raise ValueError(f"no usable documents in {', '.join(inputs)} to train on")
    return {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), **counts}
