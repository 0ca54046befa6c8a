"""The build side of shardkit (`shardkit build`, `shardkit tokenizer train`).

Corpus files -> `shardkit.text.inputs` (files and ordered work units) -> `shardkit.text.documents` (parse,
check, tokenize with `shardkit.text.tokenizers`, in worker processes via `executors`) ->
`shardkit.text.packing` (deterministic samples) -> shards via the core `ShardWriter` -> manifest, orchestrated
by `build` with resume state in `state` and accounting in `report`. The text handling lives in `shardkit.text`
because the loaders use it too. Nothing here is imported by `import shardkit`.
"""
