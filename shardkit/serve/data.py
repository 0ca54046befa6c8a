"""What a service serves: the dataset of `shardkit serve DATA ...`, as a JSON-able recipe every worker rebuilds.

A worker builds, for each stream it serves, the very `StreamingDataset` and `StreamingDataLoader` the consumer's
rank would build in process (same data, options and topology), so the batches are the in-process ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from shardkit.loaders.order.mixing import Stream
from shardkit.loaders.sources.service.parts import step_assembly


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The served data.

    Attributes:
        source: a dataset URL (or raw text inputs with `options["tokenizer"]`), or a mixture: a list of
            {"url", "weight", "raw_text"}.
        options: `StreamingDataset` keyword options (`LoaderConfig` fields, `tokenizer`, `seq_len`, ...).
    """

    source: str | list[dict[str, Any]]
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.options.get("on_corrupt") == "skip":
            # "skip" agrees on each step's unreadable units over the consumers' process group, which a worker
            # serving one rank does not hold.
            raise ValueError("on_corrupt='skip' is not served (its ranks agree over their process group): serve "
                             "with on_corrupt='raise'")
        for name in ("rank", "world_size", "local_rank", "local_world_size", "service"):
            if name in self.options:
                raise ValueError(f"{name}: the service takes it from each consumer's request, not from the data")

    def dataset_source(self) -> Any:
        if isinstance(self.source, str):
            return self.source
        return [Stream(entry["url"], entry.get("weight", 1.0), raw_text=bool(entry.get("raw_text")))
                for entry in self.source]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DataSpec:
        return cls(**json.loads(text))

    def loader(self, *, rank: int, world_size: int, local_rank: int, local_world_size: int,
               batch_size: int) -> Any:
        """The `StreamingDataLoader` of one consumer rank (no loader workers: the service's workers are the
        parallelism)."""
        from shardkit.loaders.dataloader import StreamingDataLoader
        from shardkit.loaders.dataset import StreamingDataset

        dataset = StreamingDataset(self.dataset_source(), rank=rank, world_size=world_size, local_rank=local_rank,
                                   local_world_size=local_world_size, **self.options)
        return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0)

    def describe(self) -> dict[str, Any]:
        """What a consumer needs to know of the data before any batch (its identity, shapes and records, and how
        it assembles a step read in parts: None where steps come whole)."""
        from shardkit.loaders.dataset import StreamingDataset

        dataset = StreamingDataset(self.dataset_source(), rank=0, world_size=1, **self.options)
        source = dataset.source
        return {"identity": source.identity(), "stream_identities": source.stream_identities(),
                "stream_records": source.stream_records(), "describe": source.describe(),
                "endless": bool(source.endless), "sample_length": source.sample_length,
                "assembly": step_assembly(source),
                "shapes": [[where, shape_fields(shape)] for where, shape in source.shapes()]}


def shape_fields(shape: Any) -> dict[str, Any]:
    """The fields of a stream's shape the trainer checks, as JSON (a tokenizer as its recorded dict)."""
    tokenizer = shape.tokenizer
    if hasattr(tokenizer, "to_dict"):
        tokenizer = tokenizer.to_dict()
    elif hasattr(tokenizer, "__dataclass_fields__"):
        tokenizer = asdict(tokenizer)
    return {"seq_len": shape.seq_len, "sample_length": shape.sample_length, "packing": shape.packing,
            "token_dtype": str(shape.token_dtype), "tokenizer": tokenizer}
