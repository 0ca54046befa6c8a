"""`shardkit convert` / `export` with S3 on both sides, and with `--executor ray`: the same output as locally."""

from __future__ import annotations

import fsspec
import pytest

from conftest import in_fresh_process
from convert_sources import random_documents, write_hf, write_megatron
from shardkit.manifest import MANIFEST_NAME, load_manifest
from shardkit.tools.convert import ConvertConfig, run_convert
from shardkit.tools.convert.config import ExportConfig
from shardkit.tools.convert.export import run_export


def config(sources, output, source_format="megatron", **overrides):
    base = dict(inputs=tuple(map(str, sources)), source_format=source_format, output=str(output), tokenizer="byte",
                seq_len=63, shard_size=20_000, unit_bytes=2048, progress=False, workers=2)
    base.update(overrides)
    return ConvertConfig(**base)


@pytest.mark.s3
def test_s3_on_both_sides_gives_the_local_output(tmp_path, s3_bucket):
    url, options = s3_bucket
    write_megatron(tmp_path / "corpus", random_documents(120, seed=7))
    write_hf(tmp_path / "hf", random_documents(90, seed=8))
    remote = fsspec.filesystem("s3", **options)
    remote.put(str(tmp_path / "corpus.bin"), f"{url}/src/corpus.bin")
    remote.put(str(tmp_path / "corpus.idx"), f"{url}/src/corpus.idx")
    remote.put(str(tmp_path / "hf"), f"{url}/src/hf", recursive=True)
    for name, local, kind in (("corpus", tmp_path / "corpus", "megatron"), ("hf", tmp_path / "hf", "hf")):
        here = run_convert(config([local], tmp_path / f"{name}-local", kind))
        there = run_convert(config([f"{url}/src/{name}"], f"{url}/out/{name}", kind, storage_options=options))
        assert [s.sha256 for s in there.manifest.shards] == [s.sha256 for s in here.manifest.shards]
        assert there.report["documents"]["in"] == here.report["documents"]["in"] > 0
        assert there.manifest.sources[0].startswith(url)
    run_export(ExportConfig(dataset=f"{url}/out/corpus", target_format="megatron", output=f"{url}/back/corpus",
                            progress=False, storage_options=options))
    assert remote.cat_file(f"{url}/back/corpus.bin") == (tmp_path / "corpus.bin").read_bytes()


def _executor_of_convert(convert_config) -> str:
    return run_convert(convert_config).report["timing"]["executor"]


@pytest.mark.slow
def test_ray_matches_local(tmp_path):
    pytest.importorskip("ray", reason="the ray executor needs ray (pip install 'shardkit[ray]')")
    write_megatron(tmp_path / "corpus", random_documents(400, seed=9))
    run_convert(config([tmp_path / "corpus"], tmp_path / "local", packing="bestfit"))
    # Ray in a process of its own: it leaves threads behind that later tests' forks would inherit.
    assert in_fresh_process(_executor_of_convert, config([tmp_path / "corpus"], tmp_path / "ray", packing="bestfit",
                                                         executor="ray")) == "ray"
    assert (tmp_path / "ray" / MANIFEST_NAME).read_bytes() == (tmp_path / "local" / MANIFEST_NAME).read_bytes()
    assert len(load_manifest(str(tmp_path / "local")).shards) > 1
