"""shardkit's loader inside the training frameworks people already use (`docs/INTEGRATIONS.md`).

One small module per framework; each imports its framework when it is itself imported, never before
(`import shardkit.integrations` imports none of them):

- `batches`: the causal-LM fields every adapter builds from a batch.
- `huggingface`: `ShardkitTrainer`, a transformers `Trainer` whose every rank reads its own share once and
  whose loader state lives in the Trainer's own `checkpoint-N` directories.
- `accelerate`: `checkpoint_loader`, a `StreamingDataLoader` (not prepared) saved and restored by accelerate's
  `save_state`/`load_state`, for loops that use accelerate without the Trainer.
- `loader_state`: the loader state as a JSON file inside a framework's checkpoint folder (shared by the two above).
- `torchtitan`: `ShardkitDataLoader`, a torchtitan `BaseDataLoader` that resumes on another data-parallel size.
- `torchdata`: torchdata's `StatefulDataLoader`, refusing on load a state saved with another number of workers.

torch's `DataLoader` and Lightning need no adapter: see the document.
The integrations use the loaders and the core only (tests/test_architecture.py).
"""
