"""The Python fragments of docs/LOADING.md run against a real dataset, and the loader state it shows has the
keys a loader's `state_dict` has."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from loader_helpers import write_fixed

DOC = Path(__file__).resolve().parents[1] / "docs" / "LOADING.md"


def fragments() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_quickstart_fragment_reads_a_dataset_and_saves_the_loader_state(tmp_path):
    """The first fragment, its bucket and endpoint swapped for a local dataset: one epoch, 8 samples per step."""
    write_fixed(str(tmp_path / "corpus"), 40, per_shard=16)
    code = fragments()[0]
    for placeholder, local in (('"s3://bucket/corpus"', repr(str(tmp_path / "corpus"))),
                               ('"/local/nvme/shardkit"', repr(str(tmp_path / "cache"))),
                               ('{"endpoint_url": ...}', "None")):
        assert placeholder in code, placeholder  # the fragment changed: change this test with it
        code = code.replace(placeholder, local)
    namespace: dict = {"checkpoint": {}}
    exec(compile(code, str(DOC), "exec"), namespace)
    assert tuple(namespace["tokens"].shape) == (8, 17)
    assert namespace["checkpoint"]["loader"]["position"]["samples"] == 40


def test_the_documented_state_has_the_keys_of_a_loaders_state(tmp_path):
    from shardkit import StreamingDataLoader, StreamingDataset

    documented = next(f for f in fragments() if '"kind": "shardkit.StreamingDataLoader"' in f)
    keys = {node.value for node in ast.parse(documented, mode="eval").body.keys}
    write_fixed(str(tmp_path / "corpus"), 40, per_shard=16)
    loader = StreamingDataLoader(StreamingDataset(str(tmp_path / "corpus")), batch_size=4)
    next(iter(loader))
    assert keys == set(loader.state_dict()), "docs/LOADING.md's loader state is not what state_dict returns"


def test_the_mixture_schedule_fragment_builds_a_mixture(tmp_path):
    from shardkit import StreamingDataLoader, StreamingDataset

    namespace: dict = {"web": str(tmp_path / "web"), "code": str(tmp_path / "code")}
    write_fixed(namespace["web"], 40, per_shard=16)
    write_fixed(namespace["code"], 40, per_shard=16, offset=40)
    exec(compile(next(f for f in fragments() if "Schedule(" in f), str(DOC), "exec"), namespace)
    loader = StreamingDataLoader(StreamingDataset(namespace["streams"], epoch_size=60), batch_size=4)
    assert sum(len(batch["tokens"]) for batch in loader) == 60
