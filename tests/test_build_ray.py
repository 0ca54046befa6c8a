"""`--executor ray` on a local Ray instance writes exactly what the local executor writes."""

from __future__ import annotations

import pytest

from shardkit.manifest import MANIFEST_NAME
from shardkit.tools.build import run_build
from test_build import config, write_corpus


@pytest.mark.slow
def test_ray_matches_local(tmp_path):
    pytest.importorskip("ray", reason="the ray executor needs ray (pip install 'shardkit[ray]')")
    corpus = write_corpus(tmp_path / "in", docs=200)
    local = run_build(config([corpus], tmp_path / "local", workers=2, packing="bestfit"))
    ray = run_build(config([corpus], tmp_path / "ray", workers=2, packing="bestfit", executor="ray"))
    assert ray.report["timing"]["executor"] == "ray"
    assert (tmp_path / "ray" / MANIFEST_NAME).read_bytes() == (tmp_path / "local" / MANIFEST_NAME).read_bytes()
    assert len(local.manifest.shards) > 1
