"""A Lightning Trainer run whose `train_dataloader()` returns a StreamingDataLoader (started by
tests/test_integrations_lightning.py, alone or under torchrun): Lightning saves the loader's state_dict() in its
checkpoints and restores it with `fit(ckpt_path=...)`. Records the sample ids of every step per rank.

    python lightning_runs.py DATASET FOLDER IDS_JSON --steps N [--stop-at K] [--resume STEP] [--default-devices]

--default-devices leaves `devices` and `strategy` to Lightning (one process on a CPU machine, also under torchrun):
the mistake shardkit refuses.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from integration_procs import run_parser, write_ids  # noqa: E402
from shardkit import StreamingDataLoader, StreamingDataset  # noqa: E402


class TinyLM(L.LightningModule):
    def __init__(self, dataset: str, folder: str):
        super().__init__()
        self.dataset, self.folder = dataset, folder
        self.model = torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))
        self.seen = []

    def train_dataloader(self):
        dataset = StreamingDataset(self.dataset, shuffle_window=50, cache_dir=os.path.join(self.folder, "cache"))
        return StreamingDataLoader(dataset, batch_size=4)

    def training_step(self, batch, index):
        self.seen.append([self.global_step + 1, batch["sample_id"].tolist()])
        tokens = batch["tokens"].long()
        logits = self.model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StopAt(L.Callback):
    """Stop after the checkpoint of step `step` (what a preemption leaves)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def main() -> None:
    parser = run_parser()
    parser.add_argument("--resume", type=int, help="the checkpoint step to resume from")
    parser.add_argument("--default-devices", action="store_true")
    opts = parser.parse_args()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", 1))
    checkpoints = ModelCheckpoint(dirpath=os.path.join(opts.folder, "ckpt"), filename="{step}",
                                  every_n_train_steps=5, save_top_k=-1)
    layout = {} if opts.default_devices else dict(devices=world, num_nodes=1, strategy="ddp" if world > 1 else "auto")
    trainer = L.Trainer(max_steps=opts.steps, accelerator="cpu", **layout, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, max_epochs=-1,
                        callbacks=[checkpoints] + ([StopAt(opts.stop_at)] if opts.stop_at else []))
    module = TinyLM(opts.dataset, opts.folder)
    resume = None if opts.resume is None else os.path.join(opts.folder, "ckpt", f"step={opts.resume}.ckpt")
    trainer.fit(module, ckpt_path=resume)
    # write_ids also ends the process group: left to the interpreter's exit, gloo's threads were once torn down
    # mid-flight after a finished 2-rank run ("terminate called without an active exception", exit -6).
    write_ids(opts.ids, module.seen)


if __name__ == "__main__":
    main()
