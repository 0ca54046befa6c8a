"""The core under an unreliable object store: storage, write_dataset and verified shard reads through
the fault-injecting proxy give exactly the bytes of a fault-free run, never silently wrong bytes,
and a clear error naming the object once the retry budget is spent."""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
from urllib.parse import urlsplit

import numpy as np
import pytest

from fault_proxy import FAULT_KINDS, through_proxy
from shardkit.errors import CorruptShardError
from shardkit.formats import SHARD_READS, Sample, ShardReader, read_shard, write_dataset
from shardkit.loaders.cache.shard_cache import ShardCache
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import RetryPolicy, Storage


pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("storage_client")]

# shardkit's own retry layer does the work here: botocore does not retry (total_max_attempts=1), so the
# faults reach shardkit instead of being hidden (and slowed) by botocore's back-off; s3fs still retries
# payload errors. A read is two requests (HEAD, GET): at 30% faults one try fails half the time, so the
# tests give shardkit 12 tries (0.51**12 = 3e-4 per read) with millisecond waits.
FAST_RETRY = RetryPolicy(attempts=12, initial_delay=0.005, max_delay=0.05)
TOKENIZER = TokenizerInfo(kind="byte", name="byte", vocab_size=259, eos_id=258)


def make_samples(seed: int, count: int = 120, length: int = 65) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        tokens = rng.integers(0, 259, length)
        cut = int(rng.integers(1, length))
        out.append(Sample(tokens, np.array([0, cut]), np.array([0, 0]), np.array([2 * i, 2 * i + 1])))
    return out


class RetryLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(record.getMessage())


@pytest.fixture
def retry_log():
    handler = RetryLog()
    logger = logging.getLogger("shardkit")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_proxy_injects_every_kind(s3_endpoint, faulty_bucket):
    """The harness itself: each fault kind does what it says at the HTTP level."""
    url, options, proxy = faulty_bucket
    payload = os.urandom(4096)
    Storage(url, {**options, "endpoint_url": s3_endpoint}).write_bytes("obj.bin", payload)
    # A presigned URL, so that a bare HTTP client is allowed to GET the object through the proxy.
    direct = Storage(url, options)
    signed = direct.fs.url(f"{url.removeprefix('s3://')}/obj.bin", expires=600)  # an fsspec path, on either client
    path = urlsplit(signed).path + "?" + urlsplit(signed).query
    host = urlsplit(proxy.url)

    def get():
        conn = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    for kind in FAULT_KINDS:
        proxy.configure(rate=1.0, seed=1, kinds=(kind,))
        start = time.monotonic()
        try:
            status, body = get()
        except (ConnectionError, http.client.HTTPException) as err:
            status, body = type(err).__name__, b""
        elapsed = time.monotonic() - start
        assert proxy.snapshot().get(kind) == 1, (kind, proxy.snapshot())
        if kind == "error500":
            assert status == 500 and b"InternalError" in body
        elif kind in ("error503", "slowdown"):
            assert status == 503 and (b"SlowDown" in body) == (kind == "slowdown")
        elif kind == "reset":
            assert status in ("ConnectionResetError", "RemoteDisconnected"), status
        elif kind == "truncate":
            assert status == "IncompleteRead", status
        elif kind == "slow":
            assert status == 200 and body == payload and elapsed >= proxy.slow_seconds
        elif kind == "flip":
            diff = np.unpackbits(np.frombuffer(body, np.uint8) ^ np.frombuffer(payload, np.uint8))
            assert status == 200 and len(body) == len(payload) and int(diff.sum()) == 1
    # Seeded per request: the same plan gives the same decisions.
    plans = []
    for _ in range(2):
        proxy.configure(rate=0.5, seed=7, kinds=("error500",))
        plans.append([get()[0] for _ in range(20)])
    assert plans[0] == plans[1] and 500 in plans[0] and 200 in plans[0]


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_storage_round_trip_under_faults(faulty_bucket, rate, retry_log, figures, storage_client):
    url, options, proxy = faulty_bucket
    storage = Storage(url, through_proxy(options), retry=FAST_RETRY)
    assert storage.client == storage_client  # the proxy's options mean the same on both paths
    rng = np.random.default_rng(int(rate * 100))
    objects = {f"part/obj-{i:03d}.bin": rng.bytes(int(rng.integers(1, 100_000))) for i in range(16)}
    proxy.configure(rate=rate, seed=11)
    for name, data in objects.items():
        storage.write_bytes(name, data)
    for name, data in objects.items():
        assert storage.exists(name) and storage.size(name) == len(data)
        assert storage.read_bytes(name) == data, f"{name}: wrong bytes from read_bytes"
    assert storage.list_names() == sorted(objects)
    injected = proxy.injected
    assert injected > 0 and retry_log.records, "the proxy injected nothing: the test proves nothing"
    # Ranged reads carry no end-to-end checksum, so a flipped bit would pass them: flips are left out
    # here (read_shard, which checks the manifest's SHA-256, is the guard against flips).
    proxy.configure(rate=rate, seed=12, kinds=tuple(k for k in FAULT_KINDS if k != "flip"))
    for name, data in objects.items():
        lo = len(data) // 3
        assert storage.read_range(name, lo, lo + 1000) == data[lo:lo + 1000]
    injected += proxy.injected
    figures.add(f"storage_round_trip_{int(rate * 100)}pct", runs=1, faults=injected, objects_checked=2 * len(objects),
                corrupt=0, lost=0, duplicated=0)


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_write_dataset_under_faults_matches_fault_free(faulty_bucket, shard_format, rate, figures, storage_client):
    url, options, proxy = faulty_bucket
    samples = make_samples(seed=3)

    def build(prefix: str):
        storage = Storage(f"{url}/{prefix}", through_proxy(options), retry=FAST_RETRY)
        return storage, write_dataset(storage, samples, tokenizer=TOKENIZER, seq_len=64, packing="concat",
                                      shard_format=shard_format, max_samples=6)

    _, clean = build("clean")
    proxy.configure(rate=rate, seed=23)
    storage, faulty = build("faulty")
    write_faults = proxy.injected
    assert write_faults > 0, "no fault hit the upload path: the test would prove nothing"
    assert faulty.to_json() == clean.to_json()
    # Read everything back through the faults, flips included (read_shard re-reads on a bad hash).
    # Seeded per request: obstore's reads (no HEAD before a GET) need another seed for faults to hit them.
    proxy.configure(rate=rate, seed=22 if storage_client == "fsspec" else 24)
    manifest = load_manifest(storage)
    assert manifest == clean
    got = []
    for shard in manifest.shards:
        data = read_shard(storage, shard)
        reader = ShardReader.from_bytes(data, shard=shard, manifest=manifest)
        got.extend(reader.sample(i) for i in range(len(reader)))
    read_faults = proxy.injected
    assert read_faults > 0, "no fault hit the download path: the test would prove nothing"
    assert len(got) == len(samples)
    corrupt = sum(not np.array_equal(g.tokens, s.tokens) or not np.array_equal(g.doc_index, s.doc_index)
                  for g, s in zip(got, samples))
    assert corrupt == 0
    figures.add(f"write_dataset_{int(rate * 100)}pct", runs=1, faults=write_faults + read_faults,
                samples_checked=len(got), lost=len(samples) - len(got), duplicated=0, corrupt=corrupt)


@pytest.mark.parametrize("checksums", [True, False], ids=["botocore-checksums", "no-transport-checksums"])
def test_flipped_bytes_are_never_returned(faulty_bucket, checksums, figures, storage_client):
    """Half of all GET bodies get a flipped bit. With botocore's response checksums the flip raises
    FlexibleChecksumError, which shardkit retries; without them (stores that send none, ranged reads)
    the bytes reach shardkit, and read_shard's SHA-256 check re-reads them. Never wrong bytes."""
    url, options, proxy = faulty_bucket
    storage = Storage(url, through_proxy(options, checksums=checksums), retry=FAST_RETRY)
    manifest = write_dataset(storage, make_samples(seed=5, count=48), tokenizer=TOKENIZER, seq_len=64,
                             packing="concat", shard_format="tar", max_samples=4)
    direct = Storage(url, options)
    originals = {s.name: direct.read_bytes(s.name) for s in manifest.shards}
    proxy.configure(rate=0.5, seed=31, kinds=("flip",))
    raw_wrong = sum(storage.read_bytes(s.name) != originals[s.name] for s in manifest.shards)
    if checksums:
        assert raw_wrong == 0  # caught in transit (botocore's checksum, obstore's ETag check), retried by Storage
    else:  # response_checksum_validation="when_required": no transport check on either client
        assert raw_wrong > 0  # the flips really reach shardkit's own check below
    proxy.configure(rate=0.5, seed=32, kinds=("flip",))
    checked = 0
    for shard in manifest.shards:
        try:
            data = read_shard(storage, shard, reads=8)
        except CorruptShardError as err:  # allowed: a clear refusal, never wrong bytes
            assert storage.url_of(shard.name) in str(err)
            continue
        assert data == originals[shard.name]
        checked += 1
    assert checked >= len(manifest.shards) - 1
    figures.add("flipped_bytes", runs=1, faults=proxy.injected, shards_checked=checked, corrupt=0,
                raw_reads_wrong_before_check=raw_wrong)


def test_cache_fetch_under_faults(faulty_bucket, tmp_path, retry_log, figures):
    """The loader's cache fetches through the faults with no transport checksums, flips included: a
    flipped body reaches `read_shard` (the cache's fetch) and is read again; the decoded shards equal
    the written samples and no temporary is left behind."""
    url, options, proxy = faulty_bucket
    storage = Storage(url, through_proxy(options, checksums=False), retry=FAST_RETRY)
    samples = make_samples(seed=8)
    manifest = write_dataset(storage, samples, tokenizer=TOKENIZER, seq_len=64, packing="concat",
                             shard_format="arrow", max_samples=12)
    proxy.configure(rate=0.3, seed=41)
    cache = ShardCache(storage, manifest, str(tmp_path / "cache"))
    got, refused = {}, []
    for index, shard in enumerate(manifest.shards):
        try:
            held = cache.open(index)
        except CorruptShardError as err:  # allowed: both reads flipped, a clear refusal naming the URL
            assert storage.url_of(shard.name) in str(err)
            refused.append(index)
            continue
        got[index] = [held.reader.sample(i) for i in range(len(held.reader))]
        held.close()
    flips = proxy.snapshot().get("flip", 0)
    rereads = sum("failed its check" in r for r in retry_log.records)
    # obstore's path checks a whole-object read against its ETag and Storage reads it again, before read_shard.
    caught_in_transit = sum("do not match the object's ETag" in r for r in retry_log.records)
    # The only GETs here are shard reads: every flipped body fails exactly one check, and nothing else does.
    assert rereads + caught_in_transit == flips
    starts = np.cumsum([0] + [s.samples for s in manifest.shards])
    corrupt = sum(not np.array_equal(g.tokens, samples[starts[index] + i].tokens)
                  for index, shard_samples in got.items() for i, g in enumerate(shard_samples))
    assert corrupt == 0 and len(refused) <= 1
    # Every read is counted: one good read per served shard plus each read that failed its check.
    assert cache.stats.downloads == len(manifest.shards) - len(refused) + rereads
    leftovers = [n for _, _, names in os.walk(tmp_path / "cache") for n in names if ".tmp-" in n]
    assert leftovers == []
    served = sum(len(v) for v in got.values())
    figures.add("cache_fetch_30pct", runs=1, faults=proxy.injected, samples_checked=served, lost=0, duplicated=0,
                corrupt=corrupt, flips=flips, rereads=rereads,
                refused_shards=len(refused))


def test_one_bad_read_is_read_again_by_every_reader(faulty_bucket, tmp_path, capsys, storage_client):
    """verify, cat and the cache share `read_shard`: a shard whose first GET body is flipped is read
    again and reported good, not corrupt."""
    from shardkit.cli.main import main
    from shardkit.verify import verify_dataset

    url, options, proxy = faulty_bucket
    opts = through_proxy(options, checksums=False)
    storage = Storage(url, opts, retry=FAST_RETRY)
    manifest = write_dataset(storage, make_samples(seed=10, count=24), tokenizer=TOKENIZER, seq_len=64,
                             packing="concat", shard_format="tar", max_samples=12)
    # Every first GET of an object is flipped, and no later one: each reader sees exactly one bad read.
    flip_first_get(proxy)
    assert verify_dataset(storage, manifest) == []
    assert proxy.snapshot().get("flip", 0) == len(manifest.shards)
    flip_first_get(proxy)
    storage.read_bytes("shardkit.json")  # the manifest's one flipped GET is spent here, not in cat
    cli_options = [f"{key}={json.dumps(value)}" for key, value in opts.items()]
    assert main(["cat", url, "--index", "0", *(f"-o{o}" for o in cli_options)]) == 0, capsys.readouterr().err
    # The manifest's and the shard's first GET, and on s3fs the bucket listing by which it finds that the
    # dataset has no binary index (a flipped listing is retried like any transient answer).
    assert proxy.snapshot().get("flip", 0) == (3 if storage_client == "fsspec" else 2)
    flip_first_get(proxy)
    cache = ShardCache(storage, manifest, str(tmp_path / "cache"))
    cache.open(1).close()
    # No transport check on either client (checksums=False): the flipped body reaches the cache's check and is
    # read again.
    assert (proxy.snapshot().get("flip", 0), cache.stats.downloads) == (1, SHARD_READS)


def flip_first_get(proxy) -> None:
    """Flip the body of the first GET of every object, and of no later GET of it."""
    proxy.configure(rate=1.0, seed=0, kinds=("flip",), first_only=True)
