"""One transformers Trainer run over a StreamingDataset through ShardkitTrainer (started by
tests/test_integrations_hf.py, alone or under torchrun): records the sample ids of every micro-batch per rank,
optionally stops after a step.

    python hf_runs.py DATASET FOLDER IDS_JSON --steps N [--stop-at K] [--resume [checkpoint-N]] [--dispatch 0|1]
        [--split 0|1] [--batch B] [--gas G] [--ignore-data-skip] [--no-cpu-setting]

--no-cpu-setting leaves out use_cpu=True: under torchrun on a machine without GPUs accelerate then runs each process
on its own (the mistake ShardkitTrainer refuses).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from integration_procs import run_parser, write_ids  # noqa: E402
from loader_helpers import ids_from_tokens  # noqa: E402
from shardkit import StreamingDataset  # noqa: E402
from shardkit.integrations.huggingface import ShardkitTrainer  # noqa: E402


class StopAt(TrainerCallback):
    """Stop training right after the checkpoint of step `step` (the run a crash or preemption cuts short)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True
        return control


class RecordingTrainer(ShardkitTrainer):
    """Records (optimizer step about to run, sample ids) of every micro-batch the model trains on."""

    seen: list

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append([self.state.global_step, ids_from_tokens(inputs["input_ids"].cpu()).tolist()])
        return super().training_step(model, inputs, num_items_in_batch)


def main() -> None:
    parser = run_parser()
    parser.add_argument("--resume", nargs="?", const="last", help="resume: the last checkpoint, or this checkpoint-N")
    parser.add_argument("--dispatch", type=int, choices=(0, 1))
    parser.add_argument("--split", type=int, choices=(0, 1), default=0)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--ignore-data-skip", action="store_true")
    parser.add_argument("--no-cpu-setting", action="store_true")
    opts = parser.parse_args()
    torch.manual_seed(0)
    accelerator_config = {"split_batches": bool(opts.split)}
    if opts.dispatch is not None:
        accelerator_config["dispatch_batches"] = bool(opts.dispatch)
    args = TrainingArguments(output_dir=opts.folder, max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                             gradient_accumulation_steps=opts.gas, save_steps=opts.save_steps, logging_steps=1000,
                             report_to=[], use_cpu=not opts.no_cpu_setting, learning_rate=1e-3, seed=0,
                             save_only_model=False,
                             accelerator_config=accelerator_config, disable_tqdm=True,
                             ignore_data_skip=opts.ignore_data_skip)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
                                       eos_token_id=0))
    dataset = StreamingDataset(opts.dataset, cache_dir=os.path.join(opts.folder, "cache"), shuffle_window=50)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset,
                               callbacks=[StopAt(opts.stop_at)] if opts.stop_at else [])
    trainer.seen = []
    resume = None if opts.resume is None else True if opts.resume == "last" else os.path.join(opts.folder, opts.resume)
    trainer.train(resume_from_checkpoint=resume)
    write_ids(opts.ids, trainer.seen)


if __name__ == "__main__":
    main()
