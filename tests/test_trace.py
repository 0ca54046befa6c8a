"""`shardkit trace`: a real corpus built with a real tokenizer, a real (tiny) training run with sample-id logs,
and every answer checked against the shards decoded here and the corpus lines themselves."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import zstandard

from conftest import shared_path
from shardkit.cli import main
from shardkit.text.tokenizers import load_tokenizer
from shardkit.tools.build import run_build
from test_build import config, read_samples
from test_train_inprocess import run_training
from train_runs import sample_ids

pytestmark = pytest.mark.shared


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """(dataset dir, run dir, corpus texts, tokenizer): 24 prose documents, r50k, 2 steps of 3 samples."""
    root = tmp_path_factory.mktemp("trace")
    with open(shared_path("corpora/prose.jsonl.zst"), "rb") as handle:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(handle), encoding="utf-8")
        texts = [json.loads(reader.readline())["text"][:1200] for _ in range(24)]
    (root / "prose.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer_path = str(shared_path("tokenizers/r50k_base.tiktoken"))
    run_build(config([root / "prose.jsonl"], root / "ds", tokenizer=tokenizer_path, seq_len=64, shard_size=8_000))
    run_dir = root / "run" / "run"
    assert run_training(run_dir, str(root / "ds"), steps=2, **{"optimizer.warmup_steps": 1, "data.batch_size": 3, "data.cache_dir": str(root / "c"),
                                                                "logging.log_sample_ids": True}) == 0
    return root / "ds", run_dir, texts, load_tokenizer(tokenizer_path)


def trace(capsys, *argv) -> tuple[int, str, str]:
    code = main(["trace", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_a_step_traced_to_shards_documents_and_corpus_text(traced, capsys):
    dataset, run_dir, texts, tokenizer = traced
    manifest, samples = read_samples(str(dataset))
    shard_of = [shard.name for shard in manifest.shards for _ in range(shard.samples)]
    eos = manifest.tokenizer.eos_id
    code, out, err = trace(capsys, run_dir, "--step", 2, "--text", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert [s["sample_id"] for s in result["samples"]] == sample_ids(run_dir)[2] and len(result["samples"]) == 3
    checked = 0
    for traced_sample in result["samples"]:
        sample = samples[traced_sample["sample_id"]]
        assert traced_sample["shard"] == shard_of[traced_sample["sample_id"]]
        ends = [*sample.doc_starts[1:].tolist(), len(sample.tokens)]
        assert [(s["start"], s["end"], s["source"], s["doc"]) for s in traced_sample["segments"]] == list(
            zip(sample.doc_starts.tolist(), ends, sample.doc_source.tolist(), sample.doc_index.tolist()))
        for segment in traced_sample["segments"]:
            tokens = sample.tokens[segment["start"]:segment["end"]].tolist()
            assert segment["source_name"].endswith("prose.jsonl")
            # The segment is a contiguous piece of that corpus line's tokens (the document plus its EOS) ...
            assert contains(tokenizer.encode(texts[segment["doc"]]).tolist() + [eos], tokens)
            # ... and its text is that piece of the line.
            assert segment["text"] == tokenizer.decode(tokens)
            piece = segment["text"].replace("<|endoftext|>", "")
            if "\ufffd" not in piece:
                assert piece in texts[segment["doc"]]
                checked += 1
    assert checked >= 3
    code, out, _ = trace(capsys, run_dir, "--step", 2, "--rank", 0)
    first = result["samples"][0]
    assert code == 0 and f"sample {first['sample_id']}: shard {first['shard']} #{first['shard_index']}" in out
    assert f"document {first['segments'][0]['doc']}" in out


def test_reverse_trace_finds_exactly_the_samples_holding_a_document(traced, capsys):
    dataset, run_dir, texts, _ = traced
    _, samples = read_samples(str(dataset))
    trained = sample_ids(run_dir)
    # The longest document spans several samples; ask for one that the run trained on.
    doc = max((int(i) for s in (samples[k] for k in trained[1]) for i in s.doc_index), key=lambda d: len(texts[d]))
    holders = [k for k, s in enumerate(samples) if any((int(a), int(b)) == (0, doc)
                                                       for a, b in zip(s.doc_source, s.doc_index))]
    assert len(holders) >= 2
    code, out, err = trace(capsys, dataset, "--source", "prose.jsonl", "--doc", doc, "--run", run_dir, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert [s["sample_id"] for s in result["samples"]] == holders
    for s in result["samples"]:
        segments = [(int(a), b) for a, b, src, d in zip(samples[s["sample_id"]].doc_starts, [
            *samples[s["sample_id"]].doc_starts[1:], len(samples[s["sample_id"]].tokens)],
            samples[s["sample_id"]].doc_source, samples[s["sample_id"]].doc_index) if (src, d) == (0, doc)]
        assert [tuple(t) for t in s["tokens"]] == [(a, int(b)) for a, b in segments]
    want = [(step, sorted(set(ids) & set(holders))) for step, ids in trained.items() if set(ids) & set(holders)]
    assert [(h["step"], h["sample_ids"]) for h in result["steps"]] == want and want
    code, out, _ = trace(capsys, dataset, "--source", str(dataset.parent / "prose.jsonl"), "--doc", doc)
    assert code == 0 and f"is in {len(holders)} samples" in out


@pytest.mark.parametrize("argv, message", [
    (("{run}", "--step", 99), "step 99 is not in the sample-id logs"),
    (("{run}", "--step", 1, "--rank", 5), "step 1 is not in the sample-id logs of rank 5"),
    (("{root}/missing", "--step", 1), "does not exist"),
    (("{root}", "--step", 1), "holds no sample-id logs"),
    (("{ds}", "--source", "other.jsonl", "--doc", 0), "source 'other.jsonl' is not an input of this dataset"),
    (("{ds}", "--source", "prose.jsonl", "--doc", 10_000), None),
    (("{run}",), "give either --step N"),
])
def test_mistakes_are_one_clear_line(traced, capsys, argv, message):
    dataset, run_dir, _, _ = traced
    names = {"run": run_dir, "root": dataset.parent, "ds": dataset}
    code, out, err = trace(capsys, *(a.format(**names) if isinstance(a, str) else a for a in argv))
    if message is None:  # a document no sample holds: an empty answer, not an error
        assert code == 0 and "is in 0 samples" in out
        return
    assert code == 2 and err.startswith("shardkit trace: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_lineage_locates_samples_across_empty_shards():
    from shardkit.lineage import locate_samples
    from shardkit.manifest import Manifest, ShardInfo, TokenizerInfo

    shards = [ShardInfo(name=f"s{i}", samples=n, tokens=n, compressed_bytes=1, raw_bytes=1, sha256="0" * 64,
                        has_doc_boundaries=True) for i, n in enumerate([3, 0, 2, 0, 0, 4])]
    manifest = Manifest(shard_format="tar", token_dtype="uint16", seq_len=4, packing="concat",
                        tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=256), shards=tuple(shards))
    want = [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (5, 0), (5, 1), (5, 2), (5, 3)]
    assert locate_samples(manifest, range(9)) == want
    with pytest.raises(IndexError, match="sample 9 is out of range"):
        locate_samples(manifest, [9])
    assert np.array_equal(np.array([p for p, _ in want]), np.array([0, 0, 0, 2, 2, 5, 5, 5, 5]))


@pytest.fixture(scope="module")
def remixed(tmp_path_factory):
    """A run on the mixture A,B for 2 steps, resumed with --allow-mixture-change on B alone for 2 more."""
    from train_runs import write_byte_dataset

    root = tmp_path_factory.mktemp("remixed")
    for name, count, seed in (("a", 48, 0), ("b", 96, 1), ("c", 48, 2)):
        write_byte_dataset(str(root / name), num_samples=count, seed=seed)
    run_dir = root / "run"
    common = {"optimizer.warmup_steps": 1, "data.batch_size": 12, "logging.log_sample_ids": True}
    assert run_training(run_dir, f"{root / 'a'},{root / 'b'}", steps=2, **common) == 0
    assert run_training(run_dir, str(root / "b"), steps=4, **{**common, "data.allow_mixture_change": True}) == 0
    return root, run_dir


def test_trace_names_each_steps_samples_with_the_mixture_then_in_force(remixed, capsys):
    root, run_dir = remixed
    logged = sample_ids(run_dir)
    for step in (1, 3):
        code, out, err = trace(capsys, run_dir, "--step", step, "--json")
        assert code == 0, err
        result = json.loads(out)
        assert [s["sample_id"] for s in result["samples"]] == logged[step]
        # Step 1 counted ids through A (48 samples) then B; step 3 through B alone.
        offsets = {"a": 0, "b": 48} if step == 1 else {"b": 0}
        for sample in result["samples"]:
            name = "a" if step == 1 and sample["sample_id"] < 48 else "b"
            assert sample["dataset"].rstrip("/").endswith(f"/{name}")
            # write_byte_dataset gives sample k the documents 2k and 2k+1
            assert [s["doc"] for s in sample["segments"]] == [2 * (sample["sample_id"] - offsets[name]),
                                                               2 * (sample["sample_id"] - offsets[name]) + 1]
        if step == 1:
            assert {s["dataset"].rstrip("/")[-1] for s in result["samples"]} == {"a", "b"}


def test_reverse_trace_checks_the_runs_datasets(remixed, capsys):
    root, run_dir = remixed
    logged = sample_ids(run_dir)
    first_a = min(i for i in logged[1] if i < 48)
    code, out, err = trace(capsys, root / "a", "--source", "repository sources", "--doc", 2 * first_a, "--run",
                           run_dir, "--json")
    assert code == 0, err
    assert [(h["step"], h["sample_ids"]) for h in json.loads(out)["steps"]] == [(1, [first_a])]
    first_b = min(i for i in logged[3])
    code, out, err = trace(capsys, root / "b", "--source", "repository sources", "--doc", 2 * first_b, "--run",
                           run_dir, "--json")
    assert code == 0, err
    want = [step for step, ids in logged.items() if (first_b + (48 if step <= 2 else 0)) in ids]
    assert [h["step"] for h in json.loads(out)["steps"]] == want and 3 in want
    code, out, err = trace(capsys, root / "c", "--source", "repository sources", "--doc", 0, "--run", run_dir)
    assert code == 2 and "did not train on" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("lines, message", [
    (['{"step": 1, "rank": 0, "ids": [1.5]}'], "line 1 is not a sample-id record"),
    (['{"step": 1, "rank": 0, "ids": [1]}', '{"step": 2, "ra', '{"step": 3, "rank": 0, "ids": [2]}'],
     "line 2 is damaged"),
    (['{"step": 1, "rank": 0, "ids": "12"}'], "line 1 is not a sample-id record"),
])
def test_a_damaged_sample_log_is_one_clear_error(tmp_path, capsys, lines, message):
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = trace(capsys, tmp_path, "--step", 1)
    assert code == 2 and message in err and "rank-0.jsonl" in err, err
    assert len(err.strip().splitlines()) == 1
