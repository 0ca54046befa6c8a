"""`shardkit trace` on a raw-text run whose lane ran dry after the checkpoint the trace starts from (issue 45): the
checkpoint's state does not know the lane, so the source replays the run's steps from it, finds the lane dry where
the loader did, and maps the later ids to the lanes and samples the run trained (before: the lane's LaneRanDry
error at the step it ran dry in, and another lane's samples after it)."""

from __future__ import annotations

import json
import shutil

import numpy as np

from shardkit.cli import main
from shardkit.cli.trace_raw import loader_state_before, raw_run
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.order.lanes import position_lanes
from shardkit.loaders.state.envelope import decode
from test_raw_dry_lanes import DAMAGED, gz_corpus, lane_of  # noqa: F401  (fixture)
from test_raw_text import take
from test_train_raw import run
from train_runs import sample_ids

LANES, BATCH, STEPS = 8, 2, 6
OPTIONS = dict(tokenizer="byte", seq_len=64, lanes=LANES, on_corrupt="skip")


def test_a_lane_that_ran_dry_after_the_checkpoint_is_traced_as_the_run_read_it(gz_corpus, tmp_path,  # noqa: F811
                                                                               capsys):
    dataset = StreamingDataset(str(gz_corpus), **OPTIONS)
    dry_lane = lane_of(dataset, f"part{DAMAGED}.jsonl.gz")
    loader = StreamingDataLoader(dataset, batch_size=BATCH)
    given = [{int(i): t.numpy() for i, t in zip(b["sample_id"], b["tokens"])} for b in take(loader, STEPS)]
    assert loader.counters()["dry_lanes"] == 1
    # The damaged file's lane holds no sample: found at the step that reads its first one (position dry_lane).
    dry_step = dry_lane // BATCH + 1
    assert 2 <= dry_step < STEPS, "the lanes' dealing changed: pick a layout that runs the lane dry after step 1"

    run_dir = tmp_path / "run"
    run(None, run_dir, STEPS, data={"data": str(gz_corpus), "tokenizer": "byte", "lanes": LANES,
                                    "batch_size": BATCH, "loader": {"on_corrupt": "skip"}},
        checkpoint_every=1, keep=STEPS)
    capsys.readouterr()
    logged = sample_ids(run_dir)
    assert [sorted(step) for step in given] == [logged[s] for s in range(1, STEPS + 1)]
    for late in range(dry_step, STEPS + 1):  # the newest checkpoint before the steps from dry_step on: dry_step - 1
        shutil.rmtree(run_dir / "checkpoints" / f"step_{late:08d}")
    raw = raw_run(run_dir, None, None)
    for step in range(dry_step, STEPS + 1):
        saved_step, state = loader_state_before(raw, step)
        assert saved_step == dry_step - 1 and "dry_lanes" not in decode(state)["raw_text"]  # it knows no dry lane
        made = raw.dataset.provenance(logged[step], state=state).samples
        for sample_id, tokens in given[step - 1].items():
            np.testing.assert_array_equal(made[sample_id].tokens, tokens)
        code = main(["trace", str(run_dir), "--step", str(step), "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        result = json.loads(out)
        assert result["replayed"]["from_checkpoint_step"] == dry_step - 1
        lanes, indexes = position_lanes(np.array(logged[step]), LANES, {dry_lane: 0})
        assert sorted((s["sample_id"], s["lane"], s["lane_sample"]) for s in result["samples"]) == \
            list(zip(logged[step], lanes.tolist(), indexes.tolist()))
        assert dry_lane not in {s["lane"] for s in result["samples"]}
    # Without any checkpoint the order is replayed from the start: the same samples.
    last = raw.dataset.provenance(logged[STEPS]).samples
    for sample_id, tokens in given[STEPS - 1].items():
        np.testing.assert_array_equal(last[sample_id].tokens, tokens)
