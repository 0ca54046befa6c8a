"""`--executor ray` on a local Ray instance writes exactly what the local executor writes."""

from __future__ import annotations

import pytest

from conftest import in_fresh_process
from shardkit.manifest import MANIFEST_NAME
from shardkit.tools.build import run_build
from test_build import config, write_corpus


def _executor_of_build(build_config) -> str:
    return run_build(build_config).report["timing"]["executor"]


@pytest.mark.slow
def test_ray_matches_local(tmp_path):
    pytest.importorskip("ray", reason="the ray executor needs ray (pip install 'shardkit[ray]')")
    corpus = write_corpus(tmp_path / "in", docs=200)
    local = run_build(config([corpus], tmp_path / "local", workers=2, packing="bestfit"))
    # Ray in a process of its own: it leaves threads behind that later tests' forks would inherit.
    assert in_fresh_process(_executor_of_build, config([corpus], tmp_path / "ray", workers=2, packing="bestfit",
                                                       executor="ray")) == "ray"
    assert (tmp_path / "ray" / MANIFEST_NAME).read_bytes() == (tmp_path / "local" / MANIFEST_NAME).read_bytes()
    assert len(local.manifest.shards) > 1
