"""A Lightning Trainer run whose `train_dataloader()` returns a StreamingDataLoader (started by
tests/test_integrations_lightning.py, alone or under torchrun): Lightning saves the loader's state_dict() in its
checkpoints and restores it with `fit(ckpt_path=...)`. Records the sample ids of every step per rank.

    python lightning_runs.py DATASET FOLDER IDS_JSON --steps N [--stop-at K] [--resume STEP|last] [--default-devices]
        [--raw | --max-tokens T] [--crash-at K]

--default-devices leaves `devices` and `strategy` to Lightning (one process on a CPU machine, also under torchrun):
the mistake shardkit refuses. --raw: DATASET is a glob of raw JSONL text (byte tokenizer, seq_len 16, 3 lanes);
--max-tokens: built data in token-budget batches. Both leave the loader without a length, so Lightning reads one
batch ahead of the training step. --crash-at K: the process dies (os._exit) after training step K, as a
preempted node does, its ids written first.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from integration_procs import run_parser, write_ids  # noqa: E402
from shardkit import StreamingDataLoader, StreamingDataset  # noqa: E402


class TinyLM(L.LightningModule):
    def __init__(self, dataset: str, folder: str, *, raw: bool = False, max_tokens: int | None = None):
        super().__init__()
        self.dataset, self.folder, self.raw, self.max_tokens = dataset, folder, raw, max_tokens
        self.model = torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))
        self.seen = []

    def train_dataloader(self):
        if self.raw:
            return StreamingDataLoader(StreamingDataset([self.dataset], tokenizer="byte", seq_len=16, lanes=3),
                                       batch_size=4)
        cache = os.path.join(self.folder, "cache")
        if self.max_tokens:
            return StreamingDataLoader(StreamingDataset(self.dataset, max_tokens=self.max_tokens, cache_dir=cache))
        dataset = StreamingDataset(self.dataset, shuffle_window=50, cache_dir=cache)
        return StreamingDataLoader(dataset, batch_size=4)

    def training_step(self, batch, index):
        self.seen.append([self.global_step + 1, batch["sample_id"].tolist()])
        tokens = batch["tokens"].long() % 512
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CrashAt(L.Callback):
    """Die after training step `step`, its ids written (a preemption between two checkpoints)."""

    def __init__(self, step: int, ids: str, module: TinyLM):
        self.step, self.ids, self.module = step, ids, module

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            with open(f"{self.ids}.{os.environ.get('RANK', 0)}", "w") as f:
                json.dump(self.module.seen, f)
            os._exit(3)


class StopAt(L.Callback):
    """Stop after the checkpoint of step `step` (what a preemption leaves)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def main() -> None:
    parser = run_parser()
    parser.add_argument("--resume", help="the checkpoint step to resume from, or 'last'")
    parser.add_argument("--default-devices", action="store_true")
    parser.add_argument("--raw", action="store_true")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--crash-at", type=int)
    opts = parser.parse_args()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", 1))
    checkpoints = ModelCheckpoint(dirpath=os.path.join(opts.folder, "ckpt"), filename="{step}",
                                  every_n_train_steps=5, save_top_k=-1, save_last=True)
    layout = {} if opts.default_devices else dict(devices=world, num_nodes=1, strategy="ddp" if world > 1 else "auto")
    module = TinyLM(opts.dataset, opts.folder, raw=opts.raw, max_tokens=opts.max_tokens)
    stops = [StopAt(opts.stop_at)] if opts.stop_at else []
    stops += [CrashAt(opts.crash_at, opts.ids, module)] if opts.crash_at else []
    trainer = L.Trainer(max_steps=opts.steps, accelerator="cpu", **layout, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, max_epochs=-1, callbacks=[checkpoints] + stops)
    resume = opts.resume if opts.resume in (None, "last") else os.path.join(opts.folder, "ckpt",
                                                                            f"step={opts.resume}.ckpt")
    trainer.fit(module, ckpt_path=resume)
    # write_ids also ends the process group: left to the interpreter's exit, gloo's threads were once torn down
    # mid-flight after a finished 2-rank run ("terminate called without an active exception", exit -6).
    write_ids(opts.ids, module.seen)


if __name__ == "__main__":
    main()
