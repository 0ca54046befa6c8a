"""The node cache's manifest in one request (issue 47, item 3): the node's first process GETs the JSON (and the
binary index beside it) with no HEAD first, its identity taken from the GET's own answer; later processes ask
one HEAD; a manifest changed in the store is still detected and fetched again; a missing one is a ManifestError.
S3 through moto on loopback behind the counting proxy, on obstore (the default) and on fsspec (the opt-out)."""

from __future__ import annotations

import json
import os

import pytest

from loader_helpers import write_fixed
from s3_proxy import CountingProxy

from shardkit.errors import ManifestError
from shardkit.manifest import INDEX_NAME, MANIFEST_NAME
from shardkit.node_cache import dataset_cache_key, fetch_manifest
from shardkit.storage import Storage


@pytest.fixture(params=["obstore", "fsspec"])
def proxied(request, s3_bucket, s3_endpoint, monkeypatch):
    """(url, storage_options through a request-counting proxy, the proxy, the client asked for)."""
    if request.param == "obstore":
        pytest.importorskip("obstore")
        monkeypatch.delenv("SHARDKIT_STORAGE_CLIENT", raising=False)
    else:
        monkeypatch.setenv("SHARDKIT_STORAGE_CLIENT", "fsspec")
    url, options = s3_bucket
    proxy = CountingProxy(s3_endpoint)
    try:
        yield url, {**options, "endpoint_url": proxy.url}, proxy, request.param
    finally:
        proxy.close()


def _requests(proxy: CountingProxy, name: str) -> dict[str, int]:
    return {method: n for (method, path), n in proxy.counts.items() if path.endswith(f"/{name}")}


def _record(node: str, url: str) -> list:
    with open(os.path.join(node, dataset_cache_key(url), MANIFEST_NAME + ".record")) as fh:
        return json.load(fh)


def test_the_first_process_of_a_node_gets_the_manifest_in_one_request(proxied, tmp_path):
    url, options, proxy, client = proxied
    written = write_fixed(url, 40, per_shard=16, storage_options=options)
    node = str(tmp_path / "node")
    proxy.counts.clear()
    storage = Storage(url, options)
    assert storage.client == client
    assert fetch_manifest(storage, node) == written
    # obstore: the GET answers the identity, no HEAD; fsspec's copy answers none, so it asks first (as before).
    assert _requests(proxy, MANIFEST_NAME) == ({"GET": 1} if client == "obstore" else {"HEAD": 1, "GET": 1})
    assert _requests(proxy, INDEX_NAME).get("GET", 0) <= 1
    identity = storage.identity(MANIFEST_NAME)
    assert _record(node, url)[0] == identity  # recorded under the identity of the bytes it holds
    proxy.counts.clear()
    assert fetch_manifest(Storage(url, options), node) == written  # a later process: one HEAD, its copy read
    assert _requests(proxy, MANIFEST_NAME) == {"HEAD": 1}


def test_a_manifest_changed_in_the_store_is_fetched_again(proxied, tmp_path):
    url, options, proxy, _ = proxied
    write_fixed(url, 40, per_shard=16, storage_options=options)
    node = str(tmp_path / "node")
    fetch_manifest(Storage(url, options), node)
    rebuilt = write_fixed(url, 24, per_shard=8, storage_options=options, offset=100)  # another dataset, same URL
    storage = Storage(url, options)
    proxy.counts.clear()
    assert fetch_manifest(storage, node) == rebuilt
    assert _requests(proxy, MANIFEST_NAME) == {"HEAD": 1, "GET": 1}  # the HEAD saw the change
    assert _record(node, url)[0] == storage.identity(MANIFEST_NAME)
    assert fetch_manifest(Storage(url, options), node) == rebuilt


def test_a_fresh_node_without_a_manifest_names_the_dataset(proxied, tmp_path):
    url, options, _, _ = proxied
    with pytest.raises(ManifestError, match=r"no dataset at s3://.*shardkit\.json not found"):
        fetch_manifest(Storage(url, options), str(tmp_path / "node"))
