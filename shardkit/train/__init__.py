"""The bundled trainer: GPT-style pre-training on shardkit datasets under torchrun.

    torchrun --nproc_per_node N -m shardkit.train --data URL [--config FILE] [--OPTION VALUE ...]

Modules, in the order a run uses them: `config` and `options` (what to run), `parallel` (process
group, DDP / FSDP2 / HSDP), `model` (the transformer), `optim` (AdamW and the schedule), `data`
(streaming loaders), `checkpoint` and `rng` (exact resumption), `metrics` and `plot` (what a run
reports), `loop` (build, train, close) and `faults` (fault injection for the resumption tests).
Nothing is imported here, so `import shardkit.train` stays light.
"""
