"""Text handling that the build side and the read side share: one reader, one tokenizer loader, one packer of
each kind.

`inputs` (corpus files and their ordered work units) -> `documents` (parse, check and tokenize a unit with a
`tokenizers` spec) -> `packing` (documents into samples, deterministically). `shardkit build` runs these
offline (`shardkit.tools`); a loader that reads raw text runs the same code on the fly, so both give each
document the same tokens. This layer imports only the core; neither side is imported here, and nothing here is
imported by `import shardkit` (tokenizer packages load only when a spec needs them).
"""
