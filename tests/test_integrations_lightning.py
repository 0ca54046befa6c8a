"""Lightning with a StreamingDataLoader from `train_dataloader()` (issue 24: it works; this keeps it working):
Lightning stores the loader's state_dict() in its checkpoints and `fit(ckpt_path=...)` restores it, in a new
process, on one and two ranks (DDP over gloo, started by torchrun)."""

from __future__ import annotations

import pytest

from integration_procs import (
    SAMPLES,
    check_resumed,
    check_two_rank_epochs,
    dataset_url,  # noqa: F401 - a fixture: the module's dataset
    ids_of,
    whole_and_resumed,
)

pytest.importorskip("lightning")


def test_lightning_checkpoint_resumes_the_loader(dataset_url, tmp_path):
    whole, head, tail = whole_and_resumed("lightning_runs.py", dataset_url, tmp_path, steps=20)
    check_resumed(whole, head, tail)
    whole = whole[0]
    assert sorted(ids_of(whole, 1, 16)) == list(range(SAMPLES))


@pytest.mark.slow
def test_two_ranks_disjoint_complete_and_resumed(dataset_url, tmp_path):
    whole, head, tail = whole_and_resumed("lightning_runs.py", dataset_url, tmp_path, steps=14, ranks=2)
    check_two_rank_epochs(whole)
    check_resumed(whole, head, tail)
