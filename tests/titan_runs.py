"""A torchtitan-style training loop on CPU (started by tests/test_integrations_torchtitan.py, alone or under torchrun):
ShardkitDataLoader built from its Config the way torchtitan's Trainer builds it, model, optimizer and scheduler
from torchtitan's containers, state through torchtitan's CheckpointManager (DCP). Records the sample ids of
every step per rank. A run loads the latest checkpoint of FOLDER when there is one (torchtitan's resume).

    python titan_runs.py DATASET FOLDER IDS_JSON --steps N [--stop-at K] [--resume STEP]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402

from integration_procs import run_parser, write_ids  # noqa: E402
from loader_helpers import ids_from_tokens  # noqa: E402
from shardkit.integrations.torchtitan import ShardkitDataLoader  # noqa: E402


class TrainState:
    """The step counter torchtitan's Trainer saves as "train_state"."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main() -> None:
    parser = run_parser()
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--resume", type=int, default=-1, help="the checkpoint step to load (-1: the latest)")
    opts = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataloader = ShardkitDataLoader.Config(dataset_path=opts.dataset, num_workers=opts.workers,
                                           cache_dir=os.path.join(opts.folder, "cache")).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=16, local_batch_size=4, snapshot_every_n_steps=5)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))
    optimizers = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]).build(
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=opts.steps)
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, folder="checkpoint", interval=5, keep_latest_k=0).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder=opts.folder)
    checkpointer.load(step=opts.resume)
    seen = []
    batches = iter(dataloader)
    while train_state.step < opts.steps and train_state.step != opts.stop_at:
        inputs, labels = next(batches)
        train_state.step += 1
        seen.append([train_state.step, ids_from_tokens(inputs["input"]).tolist()])
        loss = torch.nn.functional.cross_entropy(model(inputs["input"]).flatten(0, 1), labels.flatten())
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        checkpointer.save(curr_step=train_state.step)
    checkpointer.close()
    write_ids(opts.ids, seen)


if __name__ == "__main__":
    main()
