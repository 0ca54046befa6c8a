"""The real `shardkit` CLI: inspect, verify and cat on real datasets, good and damaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardkit.cli import main
from shardkit.options import parse_storage_options
from conftest import shared_path
from shardkit.errors import CorruptShardError
from shardkit.formats.fetch import SHARD_READS
from shardkit.formats import Sample, ShardReader, write_dataset
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import Storage

SOURCES = ("web.jsonl", "books.jsonl")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed entry point, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def make_dataset(url: str, shard_format: str = "tar", storage_options=None, count: int = 50):
    """`count` packed samples of 65 tokens, 20 per shard; sample i's tokens are i*7 + arange(65)."""
    samples = [Sample(np.arange(65) + 7 * i, np.array([0, 40]), np.array([i % 2, -1]), np.array([i, 0]))
               for i in range(count)]
    return write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=1024, eos_id=3),
                         seq_len=64, packing="concat", shard_format=shard_format, sources=SOURCES, max_samples=20,
                         storage_options=storage_options)


@pytest.fixture(params=["tar", "arrow"])
def dataset(request, tmp_path):
    url = str(tmp_path / "ds")
    return url, make_dataset(url, request.param)


def test_help_lists_the_dataset_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("inspect", "verify", "cat"):
        assert command in result.stdout
    result = run_cli("verify", "--help")
    assert result.returncode == 0 and "--jobs" in result.stdout and "every shard" in result.stdout


def test_inspect_table(dataset, capsys):
    url, manifest = dataset
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    totals = manifest.totals()
    assert f"shards          {totals['shards']}" in out
    assert "samples         50" in out and "tokens          3,250" in out
    assert f"{totals['compressed_bytes']:,} B" in out and f"{totals['raw_bytes']:,} B" in out
    assert f"{totals['raw_bytes'] / totals['compressed_bytes']:.2f}x" in out
    assert "64 (samples of 65 tokens)" in out and "concat" in out and "uint16" in out
    assert "byte 'byte', vocab 1,024" in out and "eos_id=3" in out
    assert "web.jsonl, books.jsonl" in out


def test_inspect_json_matches_the_manifest(dataset, capsys):
    url, manifest = dataset
    assert main(["inspect", url, "--json", "--shards"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["totals"] == manifest.totals()
    assert info["compression_ratio"] == pytest.approx(manifest.totals()["raw_bytes"] / manifest.totals()["compressed_bytes"], rel=1e-3)
    assert (info["seq_len"], info["sample_length"], info["packing"], info["token_dtype"]) == (64, 65, "concat", "uint16")
    assert info["tokenizer"]["vocab_size"] == 1024 and info["tokenizer"]["eos_id"] == 3
    assert [s["name"] for s in info["shards"]] == [s.name for s in manifest.shards]
    assert info["shard_format"] == manifest.shard_format and info["sources"] == list(SOURCES)


def test_inspect_is_fast_and_never_imports_torch(tmp_path):
    url = str(tmp_path / "ds")
    make_dataset(url)
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "shardkit", "inspect", url, "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert not {"torch", "pyarrow", "tokenizers", "tiktoken", "sentencepiece"} & imported and "shardkit" in imported
    assert json.loads(result.stdout)["totals"]["samples"] == 50


def _commands_of(parser) -> set[str]:
    return {name for action in parser._actions if hasattr(action, "choices") and isinstance(action.choices, dict)
            for name in action.choices}


def test_a_command_line_registers_only_the_provider_of_its_command():
    from shardkit.cli.main import COMMAND_PROVIDERS, build_parser

    every = _commands_of(build_parser())
    assert every == {command for commands in COMMAND_PROVIDERS.values() for command in commands}
    for commands in COMMAND_PROVIDERS.values():
        for command in commands:
            assert _commands_of(build_parser(["--no-such-flag", command, "--help"])) == set(commands), command
    assert _commands_of(build_parser(["--version"])) == _commands_of(build_parser(["no-such-command"])) == every


def test_the_build_side_commands_start_without_the_trainer_or_the_tuner():
    """Parsing `shardkit convert` (and `build`) imports neither the trainer's nor the tuner's configuration, nor
    torch: a fresh interpreter, as the command starts."""
    code = ("import sys; from shardkit.cli.main import build_parser; "
            "build_parser(sys.argv[1:]).parse_args(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.startswith(('shardkit.train', 'shardkit.tune', 'torch'))))")
    for argv in (["convert", "src", "--from", "megatron", "--output", "out", "--seq-len", "8"],
                 ["build", "in.jsonl", "--output", "out", "--tokenizer", "byte", "--seq-len", "8"]):
        result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]", (argv, result.stdout)


def test_inspect_missing_dataset_is_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "shardkit inspect: error: no dataset at" in err and "shardkit.json not found" in err


def test_verify_good_dataset_through_the_real_cli(dataset):
    url, manifest = dataset
    result = run_cli("verify", url, "--jobs", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK: 3 shards, 50 samples, 3,250 tokens match the manifest of {url}" in result.stdout
    assert "verify: 100%" in result.stderr and "3/3" in result.stderr  # the progress bar, on stderr


def flip_one_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_flipped_byte_fails_verify_and_the_reader_naming_the_shard(dataset, tmp_path, capsys):
    url, manifest = dataset
    bad = manifest.shards[1]
    path = tmp_path / "ds" / bad.name
    flip_one_byte(path, bad.compressed_bytes // 2)
    assert main(["verify", url, "--no-progress"]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [f"BAD {bad.name}: sha256 is {__import__('hashlib').sha256(path.read_bytes()).hexdigest()}, "
                                    f"the manifest says {bad.sha256} on each of {SHARD_READS} reads: the stored "
                                    "object is corrupt or was replaced; rebuild the dataset or restore the shard"]
    assert f"FAILED: 1 of 3 shards of {url} are bad" in out.err
    with pytest.raises(CorruptShardError, match=f"corrupt shard {bad.name}: sha256") as info:
        ShardReader.from_bytes(path.read_bytes(), shard=bad, manifest=manifest)
    assert info.value.shard == bad.name


def test_flipped_byte_inside_a_tar_member_is_caught_even_without_the_hash(tmp_path):
    url = str(tmp_path / "ds")
    manifest = make_dataset(url, "tar")
    shard = manifest.shards[0]
    path = tmp_path / "ds" / shard.name
    flip_one_byte(path, 512 + 60)  # inside the first member's zstd frame (the header is 512 bytes)
    with pytest.raises(CorruptShardError, match=f"corrupt shard {shard.name}: member 000000000.sample_offsets.npy.zst: "
                                                "zstd decompression failed"):
        ShardReader.from_bytes(path.read_bytes(), shard=shard, manifest=manifest, verify=False)
    flip_one_byte(path, 512 + 60)
    flip_one_byte(path, 130)  # inside the first tar header
    with pytest.raises(CorruptShardError, match="bad checksum"):
        ShardReader.from_bytes(path.read_bytes(), shard=shard, manifest=manifest, verify=False)


def test_truncated_shard_fails_verify_and_the_reader(dataset, tmp_path, capsys):
    url, manifest = dataset
    bad = manifest.shards[0]
    path = tmp_path / "ds" / bad.name
    path.write_bytes(path.read_bytes()[: bad.compressed_bytes // 3])
    assert main(["verify", url, "--no-progress"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"BAD {bad.name}: size is {bad.compressed_bytes // 3} bytes, the manifest says {bad.compressed_bytes} (truncated or "
        f"replaced) on each of {SHARD_READS} reads: the stored object is corrupt or was replaced; rebuild the dataset or "
        "restore the shard"]
    with pytest.raises(CorruptShardError, match=f"corrupt shard {bad.name}: size is"):
        ShardReader.from_bytes(path.read_bytes(), shard=bad, manifest=manifest)
    with pytest.raises(CorruptShardError, match=f"corrupt shard {bad.name}: .*(truncated|not a readable Arrow)"):
        ShardReader.from_bytes(path.read_bytes(), shard=bad, manifest=manifest, verify=False)


def test_verify_lists_every_bad_shard(tmp_path):
    url = str(tmp_path / "ds")
    manifest = make_dataset(url, "arrow", count=100)  # 5 shards
    names = [s.name for s in manifest.shards]
    flip_one_byte(tmp_path / "ds" / names[0], 10)
    (tmp_path / "ds" / names[2]).write_bytes(b"")
    (tmp_path / "ds" / names[4]).unlink()
    result = run_cli("verify", url, "-j", "3")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"BAD {names[0]}", f"BAD {names[2]}", f"BAD {names[4]}"]
    assert "sha256 is" in lines[0] and "size is 0 bytes" in lines[1] and "missing:" in lines[2]
    assert "FAILED: 3 of 5 shards" in result.stderr


def test_cat_prints_the_right_ids_across_shards(dataset, capsys):
    url, _ = dataset
    for index, shard, local in ((0, "shard-000000", 0), (21, "shard-000001", 1), (49, "shard-000002", 9),
                                (-1, "shard-000002", 9)):
        assert main(["cat", url, "--index", str(index)]) == 0
        lines = capsys.readouterr().out.splitlines()
        n = index % 50
        assert lines[0].startswith(f"# sample {n}: shard {shard}.") and f"sample {local} of" in lines[0]
        assert lines[1] == f"# segment 0: tokens [0, 40) from {SOURCES[n % 2]}, document {n}"
        assert lines[2] == "# segment 1: tokens [40, 65) from padding, document 0"
        assert [int(t) for t in lines[3].split()] == list(range(7 * n, 7 * n + 65))


def test_cat_json(dataset, capsys):
    url, _ = dataset
    assert main(["cat", url, "-i", "33", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == list(range(231, 296)) and out["shard"].startswith("shard-000001")
    assert out["segments"] == [{"start": 0, "end": 40, "source": 1, "source_name": "books.jsonl", "document": 33},
                               {"start": 40, "end": 65, "source": -1, "source_name": None, "document": 0}]


def test_cat_out_of_range(dataset, capsys):
    url, _ = dataset
    assert main(["cat", url, "--index", "50"]) == 2
    assert "sample 50 is out of range: the dataset holds 50 samples" in capsys.readouterr().err


def test_cat_refuses_a_corrupt_shard(dataset, tmp_path, capsys):
    url, manifest = dataset
    flip_one_byte(tmp_path / "ds" / manifest.shards[0].name, 700)
    assert main(["cat", url, "--index", "3"]) == 1
    assert f"corrupt shard {url}/{manifest.shards[0].name}: sha256" in capsys.readouterr().err


def test_cat_decode(tmp_path, capsys):
    try:
        from shardkit.text.tokenizers import load_tokenizer
    except ImportError:
        url = str(tmp_path / "ds")
        make_dataset(url)
        assert main(["cat", url, "--index", "0", "--decode"]) == 2
        err = capsys.readouterr().err
        assert "--decode needs shardkit's tokenizer module (shardkit.text.tokenizers)" in err
        assert "pip install 'shardkit[tokenizers]'" in err
        return
    tokenizer = load_tokenizer("byte")
    ids = np.asarray(tokenizer.encode("hello, shards"))
    url = str(tmp_path / "ds2")
    write_dataset(url, [Sample(ids)], tokenizer=tokenizer.info, seq_len=None, packing="none")
    assert main(["cat", url, "--index", "0", "--decode"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "hello, shards"


def test_parse_storage_options_never_echoes_values():
    options = parse_storage_options(["endpoint_url=http://127.0.0.1:9", 'client_kwargs={"region_name": "eu"}',
                                     "anon=false", "retries=3", "secret=abc=def"])
    assert options == {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "eu"},
                       "anon": False, "retries": 3, "secret": "abc=def"}
    with pytest.raises(ValueError) as info:
        parse_storage_options(["ok=1", "TOPSECRETVALUE"])
    assert "number 2" in str(info.value) and "TOPSECRETVALUE" not in str(info.value)


@pytest.mark.s3
def test_inspect_verify_cat_on_s3_with_storage_options(s3_bucket):
    url, options = s3_bucket
    make_dataset(url, "tar", storage_options=options)
    flags = ["-o", f"endpoint_url={options['endpoint_url']}", "-o", 'client_kwargs={"region_name": "us-east-1"}',
             "-o", "skip_instance_cache=true", "-o", "key=testing", "-o", "secret=SECRET-SHOULD-NOT-APPEAR"]
    for args, want in ((["inspect", url, "--json"], '"samples": 50'), (["verify", url], "OK: 3 shards"),
                       (["cat", url, "--index", "45"], " ".join(map(str, range(315, 380))))):
        result = run_cli(*args, *flags)
        assert result.returncode == 0, result.stderr
        assert want in result.stdout
        assert "SECRET-SHOULD-NOT-APPEAR" not in result.stdout + result.stderr
    # A failing run must not leak them either.
    Storage(url, options).delete(load_manifest(url, options).shards[1].name)
    result = run_cli("verify", url, *flags)
    assert result.returncode == 1 and "missing:" in result.stdout
    assert "SECRET-SHOULD-NOT-APPEAR" not in result.stdout + result.stderr


def test_cat_decode_refuses_another_tokenizer_unless_forced(tmp_path, capsys):
    pytest.importorskip("shardkit.text.tokenizers")
    from shardkit.text.tokenizers import load_tokenizer

    gpt2 = str(shared_path("tokenizers/gpt2_hf_tokenizer.json"))
    tokenizer = load_tokenizer(gpt2)
    url = str(tmp_path / "ds")
    write_dataset(url, [Sample(np.asarray(tokenizer.encode("hello, shards")))], tokenizer=tokenizer.info,
                  seq_len=None, packing="none")
    assert main(["cat", url, "--index", "0", "--decode", "--tokenizer", gpt2]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "hello, shards"
    # Another size, and the same size (50257) with another vocabulary: both refused, naming what differs.
    r50k = str(shared_path("tokenizers/r50k_base.tiktoken"))
    for other, differs in (("byte", "vocab_size: tokenizer 258, dataset 50257"), (r50k, "vocab_sha256: tokenizer")):
        assert main(["cat", url, "--index", "0", "--decode", "--tokenizer", other]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and f"is not the one the dataset was built with ({differs}" in captured.err
        assert "--force" in captured.err
    assert main(["cat", url, "--index", "0", "--decode", "--tokenizer", "byte", "--force"]) == 0
    captured = capsys.readouterr()
    assert "warning: decoding with a different tokenizer" in captured.err and captured.out


@pytest.mark.parametrize("args", [
    ("inspect", "s3://AKIDKEY:SENTINEL-SECRET-9e1@bucket/pbt"),  # botocore: Invalid bucket name "KEY:SECRET@bucket"
    ("verify", "s3://AKIDKEY:SENTINEL-SECRET-9e1@bucket/pbt", "--jobs", "1"),
    ("inspect", "s3://AKIDKEY:SENTINEL-SECRET-9e1@bucket/a", "s3://AKIDKEY:SENTINEL-SECRET-9e1@bucket/b"),  # argparse
], ids=["inspect", "verify", "argparse"])
def test_credentials_in_a_url_are_masked_in_every_message_whoever_formats_it(args):
    """Through the real CLI: botocore quotes the bucket with its user-info and no `://`, argparse quotes an extra
    argument whole; neither reaches the terminal unmasked (the port is closed: nothing leaves the machine)."""
    result = run_cli(*args, "-o", "endpoint_url=http://127.0.0.1:9",
                     env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "***@bucket" in output, output
    assert "SENTINEL-SECRET" not in output and "AKIDKEY" not in output, output
