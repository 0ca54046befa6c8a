"""Every layout of the mesh trains like one process (real torchrun processes, CPU, gloo, fp32).

One single-process run over the same global batches (12 samples a step) is the reference that all
layouts share. Each layout must reproduce its first 5 losses within 1e-4 relative, and its ranks
must consume every sample id of a step exactly once across the data-parallel ranks (tensor and
pipeline peers of one dp rank read the same batch). One 2-D layout is SIGKILLed after its step-3
checkpoint and must resume bit for bit; checkpoints resume into other layouts within 1e-4; and the
collectives counted for `tp 2` match the design of tensor + sequence parallelism.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import shared_path
from shardkit.train.checkpoint import MARKER_NAME, find_latest
from train_runs import check_ok, losses, torchrun, write_byte_dataset, write_gpt2_dataset

# All on one xdist worker (pyproject's `--dist loadgroup`): the layouts' runs (`runs`), a module fixture several tests share,
# is then made once, not once per worker that runs one of them.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_parallel_layouts")]

GLOBAL_BATCH, STEPS, N_LAYER, SEQ_LEN, D_MODEL = 12, 5, 4, 32, 64
# One model for every layout, with the defaults a GPT-2-tokenized dataset gets: GPT-2's vocabulary (50257,
# which the model pads to 50304 so that tp splits it) and tied embeddings (pipeline stages share the matrix
# between the first and the last stage); 4 layers (2 x 2 interleaved stages). The byte dataset's tokens are
# ids of that vocabulary too.
VOCAB = 50257
MODEL = ("--n-layer", str(N_LAYER), "--vocab-size", str(VOCAB), "--checkpoint-every", "3")

LAYOUTS = {  # name: (processes, dp ranks, options)
    "tp2": (2, 1, ("--tp", "2")),
    "pp2_interleaved1f1b": (2, 1, ("--pp", "2", "--pp-schedule", "interleaved1f1b")),
    "tp2_dp_shard2": (4, 2, ("--tp", "2", "--dp-shard", "2")),
    "pp2_dp_shard2_gpipe": (4, 2, ("--pp", "2", "--dp-shard", "2", "--pp-schedule", "gpipe")),
    "pp2_dp_shard2_1f1b": (4, 2, ("--pp", "2", "--dp-shard", "2", "--pp-schedule", "1f1b")),
    "pp2_tp2": (4, 1, ("--pp", "2", "--tp", "2")),
    "dp_replicate2_dp_shard2": (4, 4, ("--dp-replicate", "2", "--dp-shard", "2")),
}
GPT2 = {  # the other model style (learned positions, LayerNorm, biases), against its own reference
    "gpt2_single": (1, 1, ("--style", "gpt2")),
    "gpt2_tp2": (2, 1, ("--style", "gpt2", "--tp", "2")),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    write_byte_dataset(str(root / "bytes"))
    return str(root / "bytes")


def launch(run_dir: Path, data: str, layout: str, **kwargs):
    nproc, dp, options = {**LAYOUTS, **GPT2}.get(layout, (1, 1, ()))
    return torchrun(run_dir, data, nproc=nproc, parallel="auto", batch_size=GLOBAL_BATCH // dp, steps=STEPS,
                    checkpoint_every=3, extra=(*MODEL, *options), **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """Uninterrupted runs, one per layout (and the single-process reference), each made once."""
    done: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in done:
            run_dir = tmp_path_factory.mktemp(layout) / "run"
            check_ok(launch(run_dir, data, layout))
            done[layout] = run_dir
        return done[layout]

    return get


def rank_ids(run_dir: Path) -> dict[int, list[list[int]]]:
    """step -> the distinct sample-id lists the ranks consumed (peers of one dp rank log the same list)."""
    by_step: dict[int, list[list[int]]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            lists = by_step.setdefault(record["step"], [])
            if record["ids"] not in lists:
                lists.append(record["ids"])
    return by_step


def assert_close(actual: dict[int, float], expected: dict[int, float], steps, rel: float = 1e-4):
    for step in steps:
        assert actual[step] == pytest.approx(expected[step], rel=rel), (step, actual, expected)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(runs, layout):
    reference, run_dir = runs("single"), runs(layout)
    assert_close(losses(run_dir), losses(reference), range(1, STEPS + 1))
    dp = LAYOUTS[layout][1]
    expected = rank_ids(reference)
    for step, lists in rank_ids(run_dir).items():
        # dp distinct lists (one per data-parallel rank), together the reference step's samples, once each.
        assert len(lists) == dp, (step, lists)
        assert sorted(i for ids in lists for i in ids) == sorted(expected[step][0]), step


def test_gpt2_style_tensor_parallel_matches_one_process(runs):
    assert_close(losses(runs("gpt2_tp2")), losses(runs("gpt2_single")), range(1, STEPS + 1))


def test_sigkill_after_checkpoint_resumes_bitwise_in_a_2d_layout(tmp_path, data, runs):
    reference = runs("tp2_dp_shard2")
    # Every rank SIGKILLs itself before step 5; torchrun restarts the job, which resumes at step 3.
    result = check_ok(launch(tmp_path / "run", data, "tp2_dp_shard2", fault="step:5", max_restarts=1))
    assert "resumed from" in result.stdout
    assert losses(tmp_path / "run") == losses(reference)  # bitwise, every step


# A pipeline's checkpoint holds the tied matrix once (both stages save the same entry) and resumes unsplit;
# an unsplit one resumes into a pipeline, whose last stage loads its copy from that entry.
@pytest.mark.parametrize("source, target", [("tp2_dp_shard2", "dp_shard4"), ("pp2_dp_shard2_gpipe", "tp2_dp_shard2"),
                                            ("tp2_dp_shard2", "pp2_tp2")])
def test_checkpoint_resumes_in_another_layout(tmp_path, data, runs, source, target):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs(source) / "checkpoints" / "step_00000003", run_dir / "checkpoints" / "step_00000003")
    nproc, options = (4, ("--dp-shard", "4")) if target == "dp_shard4" else (4, LAYOUTS[target][2])
    dp = 4 if target == "dp_shard4" else LAYOUTS[target][1]
    result = check_ok(torchrun(run_dir, data, nproc=nproc, parallel="auto", batch_size=GLOBAL_BATCH // dp,
                               steps=STEPS, checkpoint_every=3, extra=(*MODEL, *options)))
    assert "resumed from" in result.stdout
    resumed = losses(run_dir)
    assert sorted(resumed) == [4, 5]
    assert_close(resumed, losses(runs("single")), [4, 5])


def test_tp2_collectives_match_the_design(runs):
    """Sequence parallelism: per block and sub-layer one all-gather (into attention / the MLP) and one
    reduce-scatter (out of them) of a [B, T, d_model] activation in the forward, mirrored in the
    backward; plus the embedding's reduce-scatter and the output projection's all-gather. All-reduces
    carry only norm-weight gradients and loss / grad-norm scalars, never activations."""
    record = json.loads((runs("tp2") / "metrics.jsonl").read_text().splitlines()[0])
    activation = GLOBAL_BATCH * SEQ_LEN * D_MODEL * 4  # fp32 bytes of one [B, T, d_model] tensor
    per_direction = 2 * N_LAYER + 1
    assert record["comm_count_all_gather"] == record["comm_count_reduce_scatter"] == 2 * per_direction
    assert record["comm_bytes_all_gather"] == record["comm_bytes_reduce_scatter"] == 2 * per_direction * activation
    assert 0 < record["comm_bytes_all_reduce"] < activation
    assert "comm_bytes_send_recv" not in record


def test_gpt2_tokenized_dataset_trains_with_tp2_out_of_the_box(tmp_path):
    """No model option: the manifest's 50257 ids are padded to 50304 rows, which --tp 2 splits; the
    checkpoint records both sizes."""
    pytest.importorskip("tokenizers")
    data = str(tmp_path / "gpt2")
    write_gpt2_dataset(data, str(shared_path("tokenizers/gpt2_hf_tokenizer.json")))
    run_dir = tmp_path / "run"
    check_ok(torchrun(run_dir, data, nproc=2, parallel="auto", batch_size=4, steps=3, checkpoint_every=3,
                      extra=("--tp", "2")))
    marker = json.loads((find_latest(run_dir / "checkpoints") / MARKER_NAME).read_text())
    assert (marker["model"]["vocab_size"], marker["model"]["padded_vocab_size"]) == (50257, 50304)
    assert sorted(losses(run_dir)) == [1, 2, 3]
