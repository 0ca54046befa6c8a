"""The read side's shape: stages with one state contract, a small dataset, a loader that talks to one plan.

Each stage with resume fields (`shardkit.loaders.state.loader_state.Stage`: the step sources, the quarantine, the mixture and
the read plan's order) is run, saved at every point, restored into a fresh one and run on: the shared helper
`resume_contract.check_stage_resume` (torchdata's `run_test_save_load_state` idea), in-process. The rest reads the
source with `ast`: `StreamingDataset` stays at most 15 public methods and 300 lines, the data loader reaches the
dataset only through its plan, and only the batch mode table asks whether batches are cut by a token budget.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from loader_helpers import write_fixed
from resume_contract import check_stage_resume
from shardkit.loaders import StreamingDataLoader, StreamingDataset, Stream
from shardkit.loaders.sources.built.batch_modes import BATCH_MODES, FixedBatches, TokenBudgetBatches, batch_mode
from shardkit.loaders.config import LoaderConfig
from shardkit.loaders.order.effective import effective_order
from shardkit.loaders.order.quarantine import Quarantine, QuarantineSources
from shardkit.loaders.order.remix import Mixture, MixtureStreams
from shardkit.loaders.state.loader_state import LoaderState
from shardkit.loaders.order.steps import FixedSteps, TokenBudgetSteps

LOADERS = Path(__file__).resolve().parents[1] / "loaders"
BASE = dict(epoch=0, samples_consumed=0, dataset="data", num_samples=240, seed=0, shuffle=True, num_partitions=1,
            block_size=None, shuffle_window=1000, partial_batches="drop", epoch_size=None, global_batch_size=8,
            world_size=2)


def complete(fields: dict) -> LoaderState:
    """A whole loader state around one stage's fields."""
    return LoaderState(**{**BASE, **fields})


# -- each stage's state contract, in-process --------------------------------------------------
def test_fixed_steps_restore_at_every_point():
    states = check_stage_resume(FixedSteps, [lambda s: s.advance(4, None, 2)] * 3, complete)
    assert [s["samples_consumed"] for s in states] == [0, 8, 16, 24]


def test_token_budget_steps_restore_mid_window_and_across_world_sizes():
    marks = [((0, 1, 0), 2), ((0, 2, 0), 2), ((0, 1, 0), 3), ((0, 2, 1), 3), ((64, 1, 0), 3)]
    steps = [lambda s, m=m, w=w: s.advance(1, np.array(m), w) for m, w in marks]
    states = check_stage_resume(lambda: TokenBudgetSteps(64), steps, complete)
    assert states[3]["window_segments"] == ((2, 2), (3, 1)), "a second world size reads on from the first one's steps"
    assert states[-1] == {"samples_consumed": 64, "window_segments": ((3, 1),)}


def _quarantine() -> Quarantine:
    """A quarantine over a pure order of 6 shards of 40 samples, one shard listed up front (no I/O)."""
    sizes = np.full(6, 40, dtype=np.int64)

    def order(epoch, partitions, entries):
        return effective_order([sizes], LoaderConfig(seed=3).order_config(partitions), epoch, quarantine=entries)

    sources = QuarantineSources(order=order, rank_shards=lambda *a, **k: [], shard_ends=np.cumsum(sizes),
                                shard_sizes=sizes, describe=lambda s: (f"shard-{s}", 40, "stream"),
                                verify=lambda s: None, agreement_group=lambda: None, listed=(1,), listed_path="list")
    return Quarantine(sources)


def test_quarantine_restores_its_entries_at_every_point():
    steps = [lambda q: q.add([3], epoch=0, consumed=50, num_partitions=1, why="corrupt"),
             lambda q: q.add([4], epoch=1, consumed=10, num_partitions=1, why="corrupt")]
    states = check_stage_resume(_quarantine, steps, complete)
    assert states[-1]["quarantine"][0] == (1, 0, 0) and [e[0] for e in states[-1]["quarantine"]] == [1, 3, 4]
    with pytest.raises(ValueError, match="quarantines shard 9, but the dataset has 6"):
        _quarantine().restore(complete({"quarantine": [(9, 0, 0)]}))


def test_mixture_record_restores_before_and_after_it_is_pinned():
    streams = MixtureStreams(urls=["a", "b"], fingerprints=["fa", "fb"], weights=[1.0, 2.0], epoch_size=240,
                             policy="drop")
    states = check_stage_resume(lambda: Mixture(lambda: streams, mixed=True), [lambda m: m.pin(8)], complete)
    assert states[0]["mixture"]["global_batch"] is None and states[1]["mixture"]["global_batch"] == 8
    assert Mixture(lambda: streams, mixed=False).state() == {"mixture": None}


@pytest.fixture(scope="module")
def two_streams(tmp_path_factory):
    root = tmp_path_factory.mktemp("shape")
    write_fixed(str(root / "a"), 120, per_shard=40)
    write_fixed(str(root / "b"), 120, per_shard=40, offset=120)
    return [Stream(str(root / "a"), weight=1.0), Stream(str(root / "b"), weight=2.0)], str(root / "cache")


def test_read_plan_restores_its_order_fields_and_refuses_another_order(two_streams):
    streams, cache = two_streams

    def plan():
        return StreamingDataset(streams, cache_dir=cache, rank=0, world_size=1, seed=4).source.engine

    states = check_stage_resume(plan, [lambda p: p.topology(), lambda p: p.mixture.pin(8)], complete)
    assert states[0]["num_partitions"] is None and states[1]["num_partitions"] == 1
    assert states[2]["mixture"]["global_batch"] == 8
    other = StreamingDataset(streams, cache_dir=cache, rank=0, world_size=1, seed=5).source.engine
    with pytest.raises(ValueError, match="another order .*seed: saved 4, now 5"):
        other.restore(complete(states[-1]))


def test_the_loader_state_is_the_composition_of_its_stages(two_streams):
    streams, cache = two_streams
    loader = StreamingDataLoader(StreamingDataset(streams, cache_dir=cache, rank=0, world_size=1), batch_size=4)
    next(iter(loader))
    state = loader.state_dict()
    plan = loader.source.engine  # the read plan: the epoch engine the source holds
    parts = {**plan.state(), **loader.feed._steps.state(), **loader.feed._quarantine.state()}
    assert LoaderState.from_dict(state) == complete(
        {**parts, "epoch": 0, "global_batch_size": 4, "world_size": 1})
    assert state["position"]["samples"] == 4 and state["mixture"]["global_batch"] == 4


# -- the batch mode is chosen once, from a table ----------------------------------------------
def test_the_batch_mode_comes_from_the_table():
    assert set(BATCH_MODES) == {"fixed", "token_budget"}
    fixed, tokens = batch_mode(LoaderConfig()), batch_mode(LoaderConfig(max_tokens=256))
    assert isinstance(fixed, FixedBatches) and isinstance(tokens, TokenBudgetBatches)
    assert isinstance(fixed.step_source(), FixedSteps) and isinstance(tokens.step_source(), TokenBudgetSteps)
    with pytest.raises(ValueError, match="pass batch_size=None"):
        tokens.samples_per_rank(8)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        fixed.samples_per_rank(0)
    with pytest.raises(TypeError, match="token-budget"):
        tokens.steps_left(100, start=0, global_batch=1)
    assert fixed.steps_left(100, start=0, global_batch=8) == 12
    assert tokens.finished(100, 100, 1) and not tokens.finished(99, 100, 1)
    assert fixed.finished(96, 100, 8) and not fixed.finished(88, 100, 8)  # drop: 4 left of a batch of 8


def _asks_for_token_budget(node: ast.AST) -> bool:
    """`<x>.max_tokens is None` / `is not None` (the question the batch mode answers)."""
    return (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "max_tokens"
            and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators))


def test_only_the_batch_mode_table_asks_whether_batches_are_cut_by_tokens():
    # config.py and sources/built/streams.py check the option itself (its value, its fit to the data), not the mode
    askers = {path.name for path in LOADERS.rglob("*.py")
              if any(_asks_for_token_budget(n) for n in ast.walk(ast.parse(path.read_text())))}
    assert askers <= {"batch_modes.py", "config.py", "streams.py"}, askers


# -- a small dataset, a loader that talks to the plan -----------------------------------------
def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)


def test_streaming_dataset_keeps_at_most_15_public_methods_and_300_lines():
    path = LOADERS / "dataset.py"
    methods = [n.name for n in _class(path, "StreamingDataset").body
               if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    assert len(methods) <= 15, f"StreamingDataset has {len(methods)} public methods: {methods}"
    lines = len(path.read_text().splitlines())
    assert lines <= 300, f"loaders/dataset.py has {lines} lines"


def _dataset_reaches(tree: ast.AST) -> set[str]:
    """Attributes read of `dataset` or `self.dataset`."""
    reaches = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "dataset") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "dataset"
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                reaches.add(node.attr)
    return reaches


def test_the_loader_reaches_the_dataset_only_through_its_source():
    reaches = _dataset_reaches(ast.parse((LOADERS / "dataloader.py").read_text()))
    assert reaches <= {"source"}, f"StreamingDataLoader reaches into the dataset's {sorted(reaches - {'source'})}"


def test_the_reach_check_sees_a_reach():
    source = ("class L:\n    def f(self, dataset):\n"
              "        return dataset.config, self.dataset.table, self.dataset.plan\n")
    assert _dataset_reaches(ast.parse(source)) == {"config", "table", "plan"}


def test_the_dataset_names_the_stored_and_the_output_token_dtype_apart(two_streams):
    streams, cache = two_streams
    dataset = StreamingDataset(streams[0].url, cache_dir=cache, rank=0, world_size=1, token_dtype="int64")
    assert dataset.stored_token_dtype == np.dtype("uint16") and dataset.config.token_dtype == "int64"
    assert not hasattr(dataset, "token_dtype")
    assert "token_dtype" in {f.name for f in dataclasses.fields(LoaderConfig)}
