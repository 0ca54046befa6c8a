"""`Storage.download_with_identity` (the node cache's manifest copy): the identity it returns is that of the bytes
copied or of an older version, never of a newer one, so that the next `identity` sees a replaced object as a
change. Each backend gives it its own way: obstore's GET answers it with the bytes, fsspec asks first. A writer
replaces the object while the copy is under way, against moto's S3 server on loopback."""

from __future__ import annotations

import pytest

from shardkit.object_store import ObjectStoreObjects
from shardkit.storage import FsspecObjects, Storage

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("storage_client")]


def test_the_identity_is_never_newer_than_the_bytes(s3_bucket, tmp_path, monkeypatch, storage_client):
    url, options = s3_bucket
    storage = Storage(url, options)
    assert storage.client == storage_client
    storage.write_bytes("object", b"old bytes")
    old = storage.identity("object")
    # The copy: fsspec's `download`, after its identity was asked; obstore's GET, which answers both.
    backend, copy_name = (FsspecObjects, "download") if storage_client == "fsspec" \
        else (ObjectStoreObjects, "download_with_identity")
    copy = getattr(backend, copy_name)

    def replaced_first(self, *args):  # another writer replaces the object just before the copy
        Storage(url, options).write_bytes("object", b"new bytes, longer")
        return copy(self, *args)

    monkeypatch.setattr(backend, copy_name, replaced_first)
    local = str(tmp_path / "copy")
    identity = storage.download_with_identity("object", local)
    with open(local, "rb") as fh:
        assert fh.read() == b"new bytes, longer"
    new = storage.identity("object")
    assert new != old
    # fsspec asked before the copy: the older identity, which the next `identity` sees as a change. obstore's GET
    # answered the identity of exactly the bytes it brought.
    assert identity == (old if storage_client == "fsspec" else new)
    assert storage.download_with_identity("object", local, asked=old) == (old if storage_client == "fsspec" else new)
