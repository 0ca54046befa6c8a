"""Lightning with a StreamingDataLoader from `train_dataloader()` (issue 24: it works; this keeps it working):
Lightning stores the loader's state_dict() in its checkpoints and `fit(ckpt_path=...)` restores it, in a new
process, on two ranks (DDP over gloo, started by torchrun) and from two ranks to one (one rank: the document's
recipe, tests/test_doc_recipes.py); and the mistakes refused (issue 35): a torch DataLoader, which Lightning cannot
checkpoint, and Lightning running each process on its own under torchrun."""

from __future__ import annotations

import pytest

from integration_procs import (
    check_elastic,
    check_resumed,
    check_two_rank_epochs,
    dataset_url,  # noqa: F401 - a fixture: the module's dataset
    own_loader_steps,
    run_script,
    stopped_and_resumed,
    torchrun_worker_env,
)

pytest.importorskip("lightning")


def fit_two_steps(loader, tmp_path):
    """Lightning's fit on one CPU process, two steps over `loader` (what train_dataloader returns)."""
    import lightning as L
    import torch

    class TinyLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Embedding(512, 8)

        def train_dataloader(self):
            return loader

        def training_step(self, batch, index):
            return self.model(batch["tokens"].long()).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(TinyLM())
    return trainer


@pytest.mark.parametrize("workers", [0, 2])
def test_a_torch_dataloader_is_refused_and_a_stateful_one_is_not(dataset_url, tmp_path, workers):
    """A torch DataLoader has no state for Lightning's checkpoints: a resume would train its epoch again from the
    start (with workers, the dataset's own state never moves either). torchdata's StatefulDataLoader is saved."""
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset
    from shardkit.integrations.torchdata import StatefulDataLoader

    def dataset():
        return StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), batch_size=4)

    with pytest.raises(ValueError, match="^Lightning iterates this StreamingDataset through a torch DataLoader.*"
                                         "Return a StreamingDataLoader from train_dataloader"):
        fit_two_steps(DataLoader(dataset(), batch_size=None, num_workers=workers), tmp_path)
    assert fit_two_steps(StatefulDataLoader(dataset(), batch_size=None, num_workers=workers),
                         tmp_path).global_step == 2


@pytest.mark.slow
def test_lightning_not_distributed_under_torchrun_is_refused(dataset_url, tmp_path):
    """torchrun starts 2 processes, but Lightning's default devices on a CPU machine is 1: each process would
    train its own model on half the data (shardkit splits by torchrun's WORLD_SIZE)."""
    # Rank 0 of torchrun's 2 workers, alone: the refusal comes before any process group (no agent, no rank 1).
    refused = run_script("lightning_runs.py", dataset_url, tmp_path, "refused", "--steps", 4, "--default-devices",
                         check=False, env=torchrun_worker_env(0, 2))
    assert refused.returncode != 0
    assert "Lightning trains this process on its own, but the dataset splits the data over 2 ranks" in refused.stderr
    assert 'strategy="ddp"' in refused.stderr, refused.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_disjoint_complete_and_resumed_on_two_and_on_one(dataset_url, tmp_path):
    """Every run a new process; every step trains on what shardkit's own StreamingDataLoader reads at that step
    (computed in this process: the reference an uninterrupted Lightning run had to match, without starting one)."""
    head, tail = stopped_and_resumed("lightning_runs.py", dataset_url, tmp_path, steps=14, ranks=2)
    whole = own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=14, ranks=2, shuffle_window=50)
    assert {rank: steps[:10] for rank, steps in whole.items()} == head
    check_two_rank_epochs(whole)
    check_resumed(whole, head, tail)
    # 2 -> 1 ranks from the same checkpoint: Lightning restores the loader's global state on one process, which
    # continues the epoch's global order where the two ranks stopped.
    one = run_script("lightning_runs.py", dataset_url, tmp_path / "cut", "one", "--steps", 25, "--resume", 10)[0]
    whole_one = own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=36, shuffle_window=50)[0]
    check_elastic(head, one, whole_one)


@pytest.fixture(scope="module")
def no_length_data(tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
    """What leaves a StreamingDataLoader without a length, so that Lightning reads one batch ahead of the training
    step: raw text, and built data in token-budget batches. {name: (DATASET argument, run options)}."""
    from loader_helpers import write_variable
    from test_build import write_corpus

    folder = tmp_path_factory.mktemp("no-length")
    corpus = write_corpus(folder / "corpus", docs=40)
    write_variable(str(folder / "variable"), 60, max_len=32, per_shard=20)
    return {"raw": (f"{corpus}/*.jsonl*", ["--raw"]),
            "token_budget": (str(folder / "variable"), ["--max-tokens", "128"])}


@pytest.mark.slow
@pytest.mark.parametrize("data", ["raw", "token_budget"])
def test_a_crash_after_a_checkpoint_resumes_with_the_next_step_without_a_length(no_length_data, tmp_path, data):
    """Issue 46 item 1: without a length Lightning's fetcher holds one batch it has not trained when a checkpoint
    takes the loader's state; that state counts only the batches the training step received. A run killed after
    step 7 (checkpoints every 5 steps) and resumed with `fit(ckpt_path="last")` in a new process trains step 6 on
    the uninterrupted run's step 6 (not its step 7), and so on to the end (12 steps: past the 9-batch epoch of the
    token-budget data)."""
    import json

    url, options = no_length_data[data]
    # The uninterrupted run: shardkit's own loader over the same data (raw: lightning_runs' byte tokenizer, 16-token
    # samples in 3 lanes, 4 a batch; token budget: 128 tokens a batch), read in this process.
    loader_options = (dict(tokenizer="byte", seq_len=16, lanes=3) if data == "raw" else
                      dict(max_tokens=128, batch_size=None))
    whole = own_loader_steps([url] if data == "raw" else url, None if data == "raw" else str(tmp_path / "own-cache"),
                             steps=12, **loader_options)[0]
    crashed = run_script("lightning_runs.py", url, tmp_path / "cut", "head", "--steps", 12, "--crash-at", 7,
                         *options, check=False)
    assert crashed.returncode == 3, crashed.stderr[-3000:]
    head = json.loads((tmp_path / "head.0").read_text())
    tail = run_script("lightning_runs.py", url, tmp_path / "cut", "tail", "--steps", 12, "--resume", "last",
                      *options)[0]
    assert head == whole[:7]
    assert [step for step, _ in tail] == list(range(6, 13))
    assert tail == whole[5:]


def test_a_stateful_dataloader_without_a_length_is_refused(tmp_path):
    """Lightning reads one batch ahead of a loader without a length; torchdata's StatefulDataLoader around a
    token-budget dataset would count that batch in its state: refused before training, naming StreamingDataLoader."""
    from loader_helpers import write_variable
    from shardkit import StreamingDataset
    from shardkit.integrations.torchdata import StatefulDataLoader

    write_variable(str(tmp_path / "variable"), 60, max_len=32, per_shard=20)
    dataset = StreamingDataset(str(tmp_path / "variable"), max_tokens=128, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="^Lightning reads one batch ahead of a loader without a length.*Return a "
                                         "StreamingDataLoader from train_dataloader"):
        fit_two_steps(StatefulDataLoader(dataset, batch_size=None), tmp_path)


def test_a_raw_text_loader_trains_under_lightning(tmp_path):
    """A raw-text StreamingDataLoader (no length: its lanes go on) from train_dataloader: Lightning trains to
    max_steps and the loader stands after the batches it handed out (one process)."""
    from shardkit import StreamingDataLoader, StreamingDataset
    from test_build import write_corpus

    corpus = write_corpus(tmp_path / "corpus", docs=40)
    loader = StreamingDataLoader(StreamingDataset([f"{corpus}/*.jsonl*"], tokenizer="byte", seq_len=16, lanes=3,
                                                  rank=0, world_size=1), batch_size=2)
    assert fit_two_steps(loader, tmp_path).global_step == 2
    assert loader.state_dict()["position"]["samples"] >= 4  # Lightning may fetch one batch ahead
