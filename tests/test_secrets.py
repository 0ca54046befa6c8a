"""Credentials never leak: a sentinel secret in the environment and another in storage_options never
appear in any log record (every logger, DEBUG), error message, repr, build report, manifest or loader
state, including the errors raised after the retry budget is exhausted. On both clients: obstore (the default)
and fsspec, whose botocore logs the signing at DEBUG."""

from __future__ import annotations

import json
import logging

import pytest

from shardkit.errors import StorageError
from shardkit.formats import Sample, read_shard, write_dataset
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import RetryPolicy, Storage

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.usefixtures("storage_client")]

ENV_SECRET = "SENTINEL-ENV-SECRET-7f3a9c"
OPTION_SECRET = "SENTINEL-OPTION-SECRET-41d2e8"
SENTINELS = (ENV_SECRET, OPTION_SECRET)


class Everything(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.loggers: set[str] = set()

    def emit(self, record):
        self.loggers.add(record.name.split(".")[0])
        self.lines.append(self.format(record))
        if record.exc_info:
            self.lines.append(logging.Formatter().formatException(record.exc_info))


@pytest.fixture
def all_logs():
    handler = Everything()
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


def assert_clean(text: str, where: str) -> None:
    for sentinel in SENTINELS:
        assert sentinel not in text, f"a secret leaked into {where}"


def test_secrets_never_leak(faulty_bucket, tmp_path, monkeypatch, all_logs, capsys, figures, storage_client):
    url, options, proxy = faulty_bucket
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)  # used where storage_options give no secret
    with_secret = {**options, "key": "testing", "secret": OPTION_SECRET,
                   "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    env_only = {**options, "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
    texts: dict[str, str] = {}
    for label, opts in (("options", with_secret), ("env", env_only)):
        storage = Storage(f"{url}/{label}", opts, retry=RetryPolicy(attempts=3, initial_delay=0.001, max_delay=0.002))
        assert storage.client == storage_client
        texts[f"repr {label}"] = repr(storage) + str(storage)
        manifest = write_dataset(storage, [Sample([1, 2, 3, 4])] * 30, seq_len=3, packing="concat", max_samples=10,
                                 tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=259),
                                 build={"storage": "s3"})
        texts[f"manifest {label}"] = storage.read_bytes("shardkit.json").decode()
        assert load_manifest(storage) == manifest
        # Errors: a missing object, a corrupt object, and the retry budget exhausted under faults.
        for action in (lambda: storage.read_bytes("missing.bin"),
                       lambda: load_manifest(Storage(f"{url}/nothing-here", opts)),
                       lambda: read_shard(storage, manifest.shards[0].__class__(**{
                           **manifest.shards[0].__dict__, "sha256": "0" * 64}))):
            with pytest.raises((OSError, ValueError)) as info:
                action()
            texts[f"error {label} {info.typename}"] = f"{info.value!r} {info.value} {info.value.__cause__!r}"
        proxy.configure(rate=1.0, seed=81, kinds=("error503", "reset", "slowdown"))
        with pytest.raises(StorageError) as info:
            storage.read_bytes(manifest.shards[1].name)
        proxy.configure(rate=0.0)
        texts[f"retry error {label}"] = f"{info.value!r} {info.value} {info.getrepr()}"
    # The build: its report and manifest, and the loader: its repr, state and errors.
    from shardkit.tools.build import BuildConfig, run_build

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(50)))
    config = BuildConfig(inputs=(str(corpus),), output=f"{url}/built", tokenizer="byte", seq_len=63, workers=1,
                         progress=False, storage_options=with_secret)
    texts["build config repr"] = repr(config)
    built = run_build(config)
    built_storage = Storage(f"{url}/built", with_secret)
    texts["build report"] = built_storage.read_bytes("build_report.json").decode() + json.dumps(built.report)
    texts["build manifest"] = built_storage.read_bytes("shardkit.json").decode()
    from shardkit import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(f"{url}/built", storage_options=with_secret, cache_dir=str(tmp_path / "cache"),
                               rank=0, world_size=1, local_rank=0, local_world_size=1)
    loader = StreamingDataLoader(dataset, batch_size=2)
    next(iter(loader))
    texts["loader"] = f"{dataset!r} {loader!r} {json.dumps(loader.state_dict())}"
    with pytest.raises(Exception) as info:
        StreamingDataset(f"{url}/absent", storage_options=with_secret)
    texts["loader error"] = f"{info.value!r} {info.value}"
    captured = capsys.readouterr()
    texts["stdout/stderr"] = captured.out + captured.err
    texts["logs"] = "\n".join(all_logs.lines)
    # Logging really was captured: fsspec's client logs dozens of DEBUG lines; obstore's path logs shardkit's own
    # lines only (each label's two failed checks and two retries at least: 8; 14 to 20+ by the faults drawn).
    assert len(all_logs.lines) > (20 if storage_client == "fsspec" else 7)
    # fsspec's client logs through botocore (the signing, the credentials' source) and s3fs; obstore does not log
    assert {"botocore", "s3fs"} <= all_logs.loggers if storage_client == "fsspec" else "shardkit" in all_logs.loggers
    for where, text in texts.items():
        assert_clean(text, where)
    figures.add("secrets" if storage_client == "obstore" else "secrets_fsspec", runs=1, texts_checked=len(texts), log_records=len(all_logs.lines), leaks=0)
