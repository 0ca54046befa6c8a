"""Lightning with a StreamingDataLoader from `train_dataloader()` (issue 24: it works; this keeps it working):
Lightning stores the loader's state_dict() in its checkpoints and `fit(ckpt_path=...)` restores it, in a new
process, on one and two ranks (DDP over gloo, started by torchrun), and from two ranks to one."""

from __future__ import annotations

import pytest

from integration_procs import (
    SAMPLES,
    check_elastic,
    check_resumed,
    check_two_rank_epochs,
    dataset_url,  # noqa: F401 - a fixture: the module's dataset
    ids_of,
    run_script,
    whole_and_resumed,
)

pytest.importorskip("lightning")


def test_lightning_checkpoint_resumes_the_loader(dataset_url, tmp_path):
    whole, head, tail = whole_and_resumed("lightning_runs.py", dataset_url, tmp_path, steps=20)
    check_resumed(whole, head, tail)
    whole = whole[0]
    assert sorted(ids_of(whole, 1, 16)) == list(range(SAMPLES))


@pytest.mark.slow
def test_two_ranks_disjoint_complete_and_resumed_on_two_and_on_one(dataset_url, tmp_path):
    whole, head, tail = whole_and_resumed("lightning_runs.py", dataset_url, tmp_path, steps=14, ranks=2)
    check_two_rank_epochs(whole)
    check_resumed(whole, head, tail)
    # 2 -> 1 ranks from the same checkpoint: Lightning restores the loader's global state on one process, which
    # continues the epoch's global order where the two ranks stopped.
    one = run_script("lightning_runs.py", dataset_url, tmp_path / "cut", "one", "--steps", 25, "--resume", 10)[0]
    whole_one = run_script("lightning_runs.py", dataset_url, tmp_path / "whole-one", "whole-one", "--steps", 36)[0]
    check_elastic(head, one, whole_one)

