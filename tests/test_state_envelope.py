"""Loader state version 2 (`shardkit.loaders.state.envelope`): one envelope nested by stream for every source, damaged
states refused naming the field (issue 45 item 5), and raw text's identity by relative file names and sizes and by
tokenizer content (issue 45 item 7). Version 1 states still load: tests/test_state_fixtures.py replays states the previous release wrote."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest

from loader_helpers import write_fixed
from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.state.envelope import decode, encode
from shardkit.loaders.state.loader_state import LoaderState
from shardkit.tools.build import run_build
from test_build import config, write_corpus

RAW = dict(tokenizer="byte", seq_len=256, unit_bytes=2048, lanes=4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("envelope") / "in", docs=60)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("built")
    for name, offset in (("a", 0), ("b", 1000)):
        write_fixed(str(root / name), 60, per_shard=20, offset=offset)
    small = root / "text"
    small.mkdir()
    (small / "c.jsonl").write_text("".join(json.dumps({"text": f"built document {i} " * 9}) + "\n" for i in range(8)))
    run_build(config([small], root / "byte", tokenizer="byte", seq_len=16))  # to mix with raw text (byte ids)
    return root


def ids(loader, steps):
    it = iter(loader)
    return [next(it)["sample_id"].tolist() for _ in range(steps)]


def saved_after(loader, steps):
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader.state_dict()


def raw_loader(url, **overrides):
    return StreamingDataLoader(StreamingDataset(str(url), **{**RAW, **overrides}), batch_size=3)


def test_a_raw_state_nests_its_lanes_under_its_stream_and_holds_no_built_field(corpus):
    loader = raw_loader(corpus)
    state = saved_after(loader, 2)
    assert state["version"] == 2 and state["source"] == "raw"
    assert state["identity"] == loader.dataset.source.identity()
    assert state["position"] == {"epoch": 0, "samples": 6}
    assert state["order"] == {"seed": 0, "shuffle": True, "lanes": 4}  # no placeholders of built-only fields
    [(key, stream)] = state["streams"].items()
    assert key == state["identity"] and stream["kind"] == "raw" and len(stream["cursors"]) == 4
    assert not {"num_samples", "block_size", "raw_text", "samples_consumed", "num_partitions"} & state.keys()
    assert json.loads(json.dumps(state)) == state


def test_a_built_mixture_keys_its_streams_by_identity(built):
    streams = [Stream(str(built / "a"), weight=0.75), Stream(str(built / "b"), weight=0.25)]
    loader = StreamingDataLoader(StreamingDataset(streams), batch_size=4)
    state = saved_after(loader, 2)
    assert state["source"] == "built" and state["position"]["samples"] == 8
    assert list(state["streams"]) == loader.dataset.source.stream_identities()
    assert [s["url"] for s in state["streams"].values()] == [str(built / "a"), str(built / "b")]
    assert [s["weight"] for s in state["mixture"]["streams"]] == [0.75, 0.25]


@pytest.mark.parametrize("case", ["built", "token_budget", "mixture", "raw", "raw_mixture"])
def test_every_kind_of_state_decodes_to_what_it_encodes_and_resumes(case, corpus, built):
    def make():
        if case == "built":
            return StreamingDataLoader(StreamingDataset(str(built / "a"), shuffle=True), batch_size=4)
        if case == "token_budget":
            return StreamingDataLoader(StreamingDataset(str(built / "a"), max_tokens=64), batch_size=None)
        if case == "mixture":
            return StreamingDataLoader(StreamingDataset([Stream(str(built / "a"), weight=0.5),
                                                                 Stream(str(built / "b"), weight=0.5)]), 4)
        if case == "raw":
            return raw_loader(corpus)
        streams = [Stream(str(corpus), weight=0.7, raw_text=True), Stream(str(built / "byte"), weight=0.3)]
        return StreamingDataLoader(StreamingDataset(streams, tokenizer="byte", seq_len=16, lanes=3), 4)

    whole = ids(make(), 5)
    state = saved_after(make(), 2)
    assert encode(decode(state)) == state
    assert LoaderState.from_dict(state).to_dict() == state
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert ids(resumed, 3) == whole[2:]


# -- damaged states (issue 45 item 5) -----------------------------------------------------------------------
def _edit(path, value):
    def edit(state):
        target = state
        for key in path[:-1]:
            target = target[key] if not callable(key) else key(target)
        target[path[-1]] = value
    return edit


def _stream(state):
    return next(iter(state["streams"].values()))


DAMAGE = {  # edit, what the message names
    "negative samples": (_edit(("position", "samples"), -3), "position.samples"),
    "samples a string": (_edit(("position", "samples"), "6"), "position.samples"),
    "samples 10**30": (_edit(("position", "samples"), 10**30), "position.samples"),
    "negative cursor": (_edit((_stream, "cursors", 0, 3), -1), "cursors[0]"),
    "huge cursor": (_edit((_stream, "cursors", 1, 1), 10**30), "cursors[1]"),
    "cursor a float": (_edit((_stream, "cursors", 1, 2), 0.5), "cursors[1]"),
    "cursor ahead of the position": (_edit((_stream, "cursors", 0, 1), 40), "lane 0 has delivered 40 samples"),
    "lane beyond the corpus": (_edit((_stream, "cursors", 3, 0), 9), "this corpus has 4 lanes"),
    "unit beyond the lane": (_edit((_stream, "cursors", 2, 3), 50), "stands at unit 50"),
    "world size zero": (_edit(("topology", "world_size"), 0), "topology.world_size"),
    "streams not a dict": (_edit(("streams",), [1, 2]), "streams must be a dict"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_raw_state_is_refused_naming_the_field_and_adopts_nothing(damage, corpus):
    edit, named = DAMAGE[damage]
    fresh = ids(raw_loader(corpus), 2)
    state = copy.deepcopy(saved_after(raw_loader(corpus), 2))
    edit(state)
    loader = raw_loader(corpus)
    with pytest.raises(ValueError, match="loader state|cannot resume") as refused:
        loader.load_state_dict(state)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert ids(loader, 2) == fresh  # the refused state left the loader at its start


# -- raw text's identity (issue 45 item 7) ----------------------------------------------------------------
def test_a_corpus_moved_elsewhere_resumes_exactly(corpus, tmp_path):
    whole = ids(raw_loader(corpus), 5)
    state = saved_after(raw_loader(corpus), 2)
    moved = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(corpus, moved)
    resumed = raw_loader(moved)
    resumed.load_state_dict(state)
    assert ids(resumed, 3) == whole[2:]


def test_an_edited_file_or_another_setting_is_refused_naming_what_differs(corpus, tmp_path):
    state = saved_after(raw_loader(corpus), 2)
    copy_ = tmp_path / "edited"
    shutil.copytree(corpus, copy_)
    victim = sorted(p for p in copy_.rglob("*") if p.is_file())[0]
    victim.write_bytes(victim.read_bytes() + b'{"text": "one more document"}\n')
    with pytest.raises(ValueError, match="files: saved"):
        raw_loader(copy_).load_state_dict(state)
    touched = tmp_path / "touched"  # the same bytes, another modification time (a copy on another node): resumes
    shutil.copytree(corpus, touched)
    victim = sorted(p for p in touched.rglob("*") if p.is_file())[0]
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    raw_loader(touched).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len: saved 256, now 128"):
        raw_loader(corpus, seq_len=128).load_state_dict(state)


def _train_tokenizer(path, texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path))


def test_a_tokenizer_retrained_in_place_is_refused_naming_the_tokenizer(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    _train_tokenizer(path, ["the quick brown fox jumps over the lazy dog " * 20] * 50)
    options = dict(tokenizer=str(path), eos_id=1)
    state = saved_after(raw_loader(corpus, **options), 2)
    raw_loader(corpus, **options).load_state_dict(state)  # the same file: fine
    _train_tokenizer(path, ["pack my box with five dozen liquor jugs " * 20] * 50)  # same path, same vocab size
    with pytest.raises(ValueError, match="tokenizer: saved"):
        raw_loader(corpus, **options).load_state_dict(state)
