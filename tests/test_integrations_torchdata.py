"""StreamingDataset inside torchdata's StatefulDataLoader and torch's DataLoader (issue 24), in the loop a user writes
(tests/torchdata_runs.py): the state saved with torch.save and resumed in a new process, with 0 and 2 workers,
across an epoch end, on one and two ranks (gloo). In-process save/load details: tests/test_standalone_resume.py."""

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

pytest.importorskip("torchdata.stateful_dataloader")


@pytest.mark.parametrize("options", [("--workers", 0), ("--workers", 2), ("--plain",)],
                         ids=["stateful-0-workers", "stateful-2-workers", "dataloader-0-workers"])
def test_resume_in_a_new_process_continues_across_the_epoch_end(dataset_url, tmp_path, options):
    whole, head, tail = whole_and_resumed("torchdata_runs.py", dataset_url, tmp_path, *options, steps=20)
    check_resumed(whole, head, tail)
    whole = whole[0]
    assert sorted(ids_of(whole, 1, 16)) == list(range(SAMPLES))
    assert ids_of(whole, 16) != ids_of(whole, 1, 6)  # epoch 1 is another order, not epoch 0 again


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_disjoint_complete_and_resumed(dataset_url, tmp_path, workers):
    whole, head, tail = whole_and_resumed("torchdata_runs.py", dataset_url, tmp_path, "--workers", workers, steps=14,
                                          ranks=2)
    check_two_rank_epochs(whole)
    check_resumed(whole, head, tail)
