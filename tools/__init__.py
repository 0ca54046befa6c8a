"""The build side of shardkit (`shardkit build`, `shardkit tokenizer train`).

Corpus files -> `inputs` (files and ordered work units) -> `documents` (parse, check, tokenize with
`tokenizers`, in worker processes via `executors`) -> `packing` (deterministic samples) -> shards
via the core `ShardWriter` -> manifest, orchestrated by `build` with resume state in `state` and
accounting in `report`. Nothing here is imported by `import shardkit`.
"""
