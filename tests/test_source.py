"""The Source contract (`shardkit.loaders.source`): one `StreamingDataset` and one `StreamingDataLoader` over every
source (built shards, raw text, a mixture of both); what differs is asked of the source, never of a type, and a
keyword that means nothing to a source is refused in one line from the public class."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from loader_helpers import write_fixed
from shardkit import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.source import Feed, Source, Standalone

REPO = Path(__file__).resolve().parents[1]
RAW = dict(tokenizer="byte", seq_len=32, unit_bytes=1024, lanes=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("source")
    built = str(root / "built")
    write_fixed(built, 200, per_shard=50, seq_len=32)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 40 + 5)}) + "\n"
                              for i in range(120)))
    return {"built": built, "raw": str(corpus), "cache": str(root / "cache")}


def datasets(data):
    """One dataset of each source: built, raw text, and raw text mixed with a built stream of byte ids."""
    from shardkit.tools.build import run_build
    from shardkit.tools.config import BuildConfig

    byte_built = str(Path(data["cache"]).parent / "byte_built")
    if not Path(byte_built, "shardkit.json").exists():
        run_build(BuildConfig(inputs=(data["raw"],), output=byte_built, tokenizer="byte", seq_len=32,
                              progress=False, workers=1))
    return {
        "built": StreamingDataset(data["built"], cache_dir=data["cache"], rank=0, world_size=1),
        "raw": StreamingDataset(data["raw"], rank=0, world_size=1, **RAW),
        "mixture": StreamingDataset([Stream(data["raw"], 0.5, raw_text=True), Stream(byte_built, 0.5)],
                                    cache_dir=data["cache"], rank=0, world_size=1, **RAW),
    }


def test_every_source_is_read_by_the_one_dataset_and_loader(data):
    for name, dataset in datasets(data).items():
        assert type(dataset) is StreamingDataset, name  # no other class handed back
        assert isinstance(dataset.source, Source), name
        loader = StreamingDataLoader(dataset, batch_size=4)
        assert type(loader) is StreamingDataLoader and isinstance(loader.feed, Feed), name
        assert isinstance(dataset._standalone, Standalone), name
        batch = next(iter(loader))
        assert batch["tokens"].shape == (4, 33), name
        state = loader.state_dict()
        again = StreamingDataLoader(datasets(data)[name], batch_size=4)
        again.load_state_dict(state)
        assert next(iter(again))["sample_id"].tolist() == next(iter(loader))["sample_id"].tolist(), name


def test_what_differs_is_a_property_of_the_source(data):
    built, raw, mixture = datasets(data).values()
    assert not built.source.endless and raw.source.endless and mixture.source.endless
    assert len(StreamingDataLoader(built, batch_size=4)) == 50
    for dataset in (raw, mixture):
        with pytest.raises(TypeError, match="no length.*--steps"):
            len(StreamingDataLoader(dataset, batch_size=4))
    assert [r["num_samples"] for r in built.source.stream_records()] == [200]
    assert len(mixture.source.stream_records()) == 2
    assert all(shape.seq_len == 32 for source in (built, raw, mixture) for _, shape in source.source.shapes())


def test_an_option_without_meaning_for_raw_text_is_refused_in_one_line(data):
    for option, value, says in (("cache_limit", "1GB", "node cache"), ("partial_batches", "pad", "lanes="),
                                ("max_tokens", 4096, "token-budget"), ("block_size", 8, "lanes=")):
        with pytest.raises(ValueError, match=f"^{option}=.* has no meaning for raw text: .*{says}") as err:
            StreamingDataset(data["raw"], **{option: value}, **RAW)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^cache_dir: raw text is read from its inputs"):
        StreamingDataset(data["raw"], cache_dir=data["cache"], **RAW)
    with pytest.raises(TypeError, match="needs seq_len="):
        StreamingDataset(data["raw"], tokenizer="byte")
    with pytest.raises(ValueError, match="lanes, seq_len: how raw text becomes samples, which needs tokenizer="):
        StreamingDataset(data["built"], cache_dir=data["cache"], seq_len=32, lanes=3)


def test_a_built_dataset_given_as_raw_text_is_named_as_built(data):
    with pytest.raises(ValueError, match=r"^.*built is a built dataset \(it holds shardkit.json\), and tokenizer= is "
                                         r"for raw text: drop tokenizer= and seq_len="):
        StreamingDataset(data["built"], **RAW)


def test_raw_text_refuses_standalone_epochs_before_the_first_batch(data):
    raw = datasets(data)["raw"]
    with pytest.raises(ValueError, match="StreamingDataLoader"):
        raw.set_epoch(0)
    with pytest.raises(ValueError, match="StreamingDataLoader"):
        raw.state_dict()


def _functions_named(tree: ast.AST, *names: str) -> list[str]:
    return [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in names]


def test_nothing_asks_which_kind_a_dataset_or_loader_is():
    """No `__new__` handing back another class, no `__subclasshook__`, and no `raw_text` attribute asked of a
    dataset or a loader (a `Stream`'s own `raw_text` flag says what its URL holds, and stays)."""
    problems = []
    for path in [*REPO.joinpath("loaders").rglob("*.py"), *REPO.joinpath("shardkit").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        problems += [f"{path.relative_to(REPO)}: {name}" for name in _functions_named(tree, "__new__", "__subclasshook__")]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == "raw_text"):
                problems.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.func.id}(..., 'raw_text')")
    assert not problems, problems
