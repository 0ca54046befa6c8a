"""Long-lived harness for the SIGKILL matrices: one process per scenario imports everything once, then
forks a child per run and SIGKILLs it at seeded random moments (forking costs milliseconds where a
fresh interpreter costs seconds on this machine). The harness holds no threads when it forks.

    python tests/kill_harness.py build CORPUS WORKDIR POINTS SEED   -> JSON figures on stdout
    python tests/kill_harness.py convert PREFIX WORKDIR POINTS SEED -> the same for `shardkit convert --from megatron`
    python tests/kill_harness.py cache DATASET WORKDIR POINTS SEED  -> JSON figures on stdout

build: each point SIGKILLs a real build (its process group: the parent and its pool of tokenizer worker
processes) once its output holds a seeded random number of shards, plus a random part of one shard's
time; runs on the same output are chained (kill, resume, kill again, ...) and every output is finally
completed; its manifest must equal an uninterrupted build's, its report must say it reused the shards
the checkpoint held (which must not have been rewritten), and no temporary, state file or worker may remain.
cache: each point starts 3 readers sharing one cache directory, SIGKILLs one at a random moment and
requires the other two to finish (no deadlock) with every sample they read intact; a fresh reader then
reads the whole dataset from that cache (nothing poisoned) and no temporary file remains.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

KILLS_PER_OUTPUT = 4
DEADLINE = 60.0


def _fork(target, *args, group: bool = False) -> int:
    """Run `target(*args)` in a forked child; with `group`, the child leads its own process group (so
    its worker processes can be killed with it, as a terminal or a batch system does)."""
    pid = os.fork()
    if pid == 0:
        if group:
            os.setpgid(0, 0)
        code = 1
        try:
            target(*args)
            code = 0
        except BaseException as err:  # noqa: BLE001 - reported through the exit status and stderr
            print(f"child {os.getpid()} failed: {type(err).__name__}: {err}", file=sys.stderr)
        finally:
            os._exit(code)
    if group:
        try:
            os.setpgid(pid, pid)  # also here: the parent may signal the group before the child runs
        except (PermissionError, ProcessLookupError):
            pass  # the child already did it (and may have exec'd or exited)
    return pid


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of group `pgid` has exited within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


def _wait(pid: int, timeout: float) -> int | None:
    """Exit status of `pid` (negative signal number when killed), None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.002)
    return None


# -- build ------------------------------------------------------------------------------------------
def _shard_count(output: str) -> int:
    try:
        return sum(name.startswith("shard-") and ".tmp-" not in name for name in os.listdir(output))
    except FileNotFoundError:
        return 0


def _finished_shards(output: str) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of each shard the output's checkpoint names as finished."""
    from shardkit.storage import Storage
    from shardkit.tools.state import load_checkpoint

    checkpoint = load_checkpoint(Storage(output)) if os.path.isdir(output) else None
    if checkpoint is None:
        return {}
    stats = {}
    for shard in checkpoint[0]["shards"]:
        info = os.stat(os.path.join(output, shard["name"]))
        stats[shard["name"]] = (info.st_ino, info.st_mtime_ns)
    return stats


def build_matrix(corpus: str, workdir: str, points: int, seed: int) -> dict:
    """Kill real builds (the parent and its pool of worker processes, as one process group) at seeded
    moments, rerun each output to the end, and check the result is the uninterrupted build's, the shards
    finished before a kill were reused (not rewritten), and nothing temporary or orphaned is left."""
    from shardkit.tools.build import BuildConfig, run_build

    def build(output: str) -> None:
        run_build(BuildConfig(inputs=(corpus,), output=output, tokenizer="byte", seq_len=63, shard_size=6_000,
                              unit_bytes=8 * 1024, workers=2, progress=False))

    return kill_matrix(build, workdir, points, seed)


def convert_matrix(source: str, workdir: str, points: int, seed: int) -> dict:
    """`build_matrix` for `shardkit convert --from megatron` (SOURCE is the .bin/.idx prefix)."""
    from shardkit.tools.convert import ConvertConfig, run_convert

    def convert(output: str) -> None:
        run_convert(ConvertConfig(inputs=(source,), source_format="megatron", output=output, tokenizer="byte",
                                  seq_len=63, shard_size=6_000, unit_bytes=8 * 1024, workers=2, progress=False))

    return kill_matrix(convert, workdir, points, seed)


def kill_matrix(build, workdir: str, points: int, seed: int) -> dict:
    """Kill `build(output)` runs (forked, with their worker processes) at seeded moments and check each
    output's final rerun against an uninterrupted run (see `build_matrix`)."""
    from shardkit.manifest import load_manifest

    began = time.monotonic()
    reference_dir = os.path.join(workdir, "reference")
    if _wait(_fork(build, reference_dir, group=True), DEADLINE) != 0:
        raise RuntimeError("the reference build failed")
    duration = time.monotonic() - began
    reference = load_manifest(reference_dir)
    total_shards = len(reference.shards)
    shard_seconds = duration / total_shards
    rng = random.Random(seed)
    figures = {"runs": 0, "killed_mid_build": 0, "finished_before_kill": 0, "outputs": 0, "mismatches": 0,
               "samples_checked": 0, "byte_mismatches": 0, "leftovers": 0, "orphaned_workers": 0, "resumed_outputs": 0,
               "late_kill_outputs": 0, "reused_shards": 0, "reuse_mismatches": 0, "rewritten_shards": 0,
               "shards": total_shards, "build_seconds": round(duration, 3)}
    output_index = 0
    while figures["runs"] < points:
        output = os.path.join(workdir, f"out-{output_index}")
        output_index += 1
        finished: dict[str, tuple[int, int]] = {}
        for _ in range(min(KILLS_PER_OUTPUT, points - figures["runs"])):
            # The kill point: once the output holds a random number of shards (at least one more
            # than now), plus a random fraction of one shard's time, so it lands anywhere in a write.
            target = rng.randint(min(_shard_count(output) + 1, total_shards), total_shards)
            extra = rng.uniform(0.0, shard_seconds)
            pid = _fork(build, output, group=True)
            deadline = time.monotonic() + DEADLINE
            while _shard_count(output) < target and time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.001)
            time.sleep(extra)
            try:
                os.killpg(pid, signal.SIGKILL)  # the build and its worker processes at once
            except ProcessLookupError:
                pass
            status = _wait(pid, DEADLINE)
            figures["orphaned_workers"] += not _group_gone(pid, 10.0)
            figures["runs"] += 1
            figures["killed_mid_build" if status == -signal.SIGKILL else "finished_before_kill"] += 1
            if status not in (0, -signal.SIGKILL):
                raise RuntimeError(f"a killed build's run ended with status {status}")
            finished.update(_finished_shards(output))
        before = _finished_shards(output)  # what the final run should take up and never rewrite
        figures["late_kill_outputs"] += bool(before)
        if _wait(_fork(build, output, group=True), DEADLINE) != 0:  # resume (or "done") to the end
            raise RuntimeError(f"the final run on {output} failed")
        figures["outputs"] += 1
        final = load_manifest(output)
        if final.to_json() != reference.to_json():
            figures["mismatches"] += 1
        for shard in final.shards:  # byte-identical shards, not only a manifest that says so
            with open(os.path.join(output, shard.name), "rb") as a, open(os.path.join(reference_dir, shard.name), "rb") as b:
                figures["byte_mismatches"] += a.read() != b.read()
        figures["samples_checked"] += final.num_samples
        report_path = os.path.join(output, "build_report.json")
        if before:  # a resume: its report must say it reused exactly the shards the checkpoint held
            with open(report_path) as fh:
                report = json.load(fh)
            figures["resumed_outputs"] += report["resumed"]
            figures["reused_shards"] += report["shards_from_before_resume"]
            figures["reuse_mismatches"] += report["shards_from_before_resume"] != len(before)
        for name, stat in finished.items():
            info = os.stat(os.path.join(output, name))
            figures["rewritten_shards"] += (info.st_ino, info.st_mtime_ns) != stat
        names = [os.path.relpath(os.path.join(d, f), output) for d, _, fs in os.walk(output) for f in fs]
        figures["leftovers"] += sum(".tmp-" in n or n.startswith("_build") for n in names)
    return figures


# -- cache ------------------------------------------------------------------------------------------
def _read_all(dataset: str, cache_dir: str, order: list[int], result_path: str) -> None:
    import numpy as np

    from shardkit.loaders.cache.shard_cache import ShardCache
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage

    storage = Storage(dataset)
    manifest = load_manifest(storage)
    cache = ShardCache(storage, manifest, cache_dir)
    starts = np.cumsum([0] + [s.samples for s in manifest.shards])
    bad = checked = 0
    for index in order:
        handle = cache.open(index)
        try:
            tokens = handle.reader.gather(np.arange(len(handle.reader))).astype(np.int64)
            ids = starts[index] + np.arange(len(handle.reader))
            bad += int(((tokens[:, 0] != ids % 60000) | (tokens[:, 1] != ids // 60000)).sum())
            checked += len(ids)
        finally:
            handle.close()
    with open(result_path, "w") as fh:
        json.dump({"bad": bad, "checked": checked, "downloads": cache.stats.downloads}, fh)


def cache_matrix(dataset: str, workdir: str, points: int, seed: int) -> dict:
    import numpy  # noqa: F401 - imported once here, before the forks
    import shardkit.loaders.cache.shard_cache  # noqa: F401
    from loader_helpers import lock_is_held
    from shardkit.manifest import load_manifest

    num_shards = len(load_manifest(dataset).shards)
    # Calibrate: how long 3 readers take to fill an empty cache.
    began = time.monotonic()
    calibration = os.path.join(workdir, "calibration")
    pids = [_fork(_read_all, dataset, calibration, list(range(num_shards)), os.path.join(workdir, f"cal{i}.json"))
            for i in range(3)]
    if any(_wait(pid, DEADLINE) != 0 for pid in pids):
        raise RuntimeError("calibration readers failed")
    duration = time.monotonic() - began
    rng = random.Random(seed)
    figures = {"runs": 0, "killed_mid_run": 0, "kills_during_download": 0, "survivor_reads": 0, "samples_checked": 0,
               "corrupt": 0, "deadlocks": 0, "leftovers": 0, "fill_seconds": round(duration, 3)}
    # A kill drawn late in [0, duration] can find the victim already done (the calibration's readers fill
    # an empty cache; a run's readers can be quicker): runs go on until `points` kills landed mid-run, so
    # the count of real kills does not depend on how busy the machine is.
    point = -1
    while figures["killed_mid_run"] < points and figures["runs"] < 4 * points:
        point += 1
        cache_dir = os.path.join(workdir, f"cache-{point}")
        orders = [rng.sample(range(num_shards), num_shards) for _ in range(3)]
        results = [os.path.join(workdir, f"r{point}-{i}.json") for i in range(3)]
        pids = [_fork(_read_all, dataset, cache_dir, order, path) for order, path in zip(orders, results)]
        victim = rng.randrange(3)
        time.sleep(rng.uniform(0.0, duration))
        locks = [os.path.join(d, f) for d, _, fs in os.walk(cache_dir) for f in fs if f.endswith(".dl")]
        downloading = any(lock_is_held(p) for p in locks)
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            pass
        statuses = [_wait(pid, DEADLINE) for pid in pids]
        figures["runs"] += 1
        if statuses[victim] == -signal.SIGKILL:
            figures["killed_mid_run"] += 1
            figures["kills_during_download"] += downloading
        for i, status in enumerate(statuses):
            if status is None:
                figures["deadlocks"] += 1
                os.kill(pids[i], signal.SIGKILL)
                _wait(pids[i], DEADLINE)
            elif i != victim or status == 0:
                if status != 0:
                    raise RuntimeError(f"reader {i} of point {point} failed with status {status}")
                with open(results[i]) as fh:
                    result = json.load(fh)
                figures["survivor_reads"] += 1
                figures["samples_checked"] += result["checked"]
                figures["corrupt"] += result["bad"]
        # A fresh reader afterwards: nothing the dead one left may block or poison it.
        after = os.path.join(workdir, f"after-{point}.json")
        if _wait(_fork(_read_all, dataset, cache_dir, list(range(num_shards)), after), DEADLINE) != 0:
            raise RuntimeError(f"a fresh reader failed after point {point}")
        with open(after) as fh:
            result = json.load(fh)
        figures["samples_checked"] += result["checked"]
        figures["corrupt"] += result["bad"]
        figures["leftovers"] += sum(".tmp-" in f for _, _, fs in os.walk(cache_dir) for f in fs)
    return figures


# -- 16 processes sharing one cache under a limit ----------------------------------------------------
RANKS, WORKERS, EPOCHS, BATCH = 4, 3, 2, 4


def _rank(dataset: str, cache_dir: str, cache_limit: int, rank: int, result_path: str) -> None:
    import numpy as np

    from shardkit import StreamingDataLoader, StreamingDataset

    data = StreamingDataset(dataset, cache_dir=cache_dir, cache_limit=cache_limit, cache_wait=10.0, shuffle=True,
                            seed=11, rank=rank, world_size=RANKS, local_rank=rank, local_world_size=RANKS,
                            shuffle_window=64, chunk_samples=32)
    loader = StreamingDataLoader(data, batch_size=BATCH, num_workers=WORKERS, multiprocessing_context="fork",
                                 persistent_workers=True)
    epochs, bad = [], 0
    for _ in range(EPOCHS):
        ids = []
        for batch in loader:
            got = batch["sample_id"].numpy()
            tokens = batch["tokens"].numpy().astype(np.int64)
            bad += int(((tokens[:, 0] != got % 60000) | (tokens[:, 1] != got // 60000)).sum())
            ids.extend(int(i) for i in got)
        epochs.append(ids)
    with open(result_path, "w") as fh:
        json.dump({"epochs": epochs, "bad": bad}, fh)


def concurrency(dataset: str, workdir: str, limit_fraction: float, seed: int) -> dict:
    import torch  # noqa: F401 - imported once here, before the forks

    import shardkit.loaders.dataset  # noqa: F401
    from shardkit.formats import open_decoded
    from shardkit.manifest import load_manifest

    manifest = load_manifest(dataset)
    cache_dir = os.path.join(workdir, "cache")
    # Decoded size of the whole dataset, measured by decoding it once into a scratch directory.
    from shardkit.loaders.cache.shard_cache import ShardCache
    from shardkit.storage import Storage

    probe = ShardCache(Storage(dataset), manifest, os.path.join(workdir, "probe"))
    for i in range(len(manifest.shards)):
        probe.open(i).close()
    dataset_bytes = sum(os.path.getsize(probe.path(i)) for i in range(len(manifest.shards)))
    open_decoded(probe.path(0))  # the probe files are valid
    limit = int(dataset_bytes * limit_fraction)
    began = time.monotonic()
    results = [os.path.join(workdir, f"rank{r}.json") for r in range(RANKS)]
    pids = [_fork(_rank, dataset, cache_dir, limit, r, results[r]) for r in range(RANKS)]
    statuses = [_wait(pid, 120.0) for pid in pids]
    for pid, status in zip(pids, statuses):
        if status is None:
            os.kill(pid, signal.SIGKILL)
    figures = {"processes": RANKS * (1 + WORKERS), "epochs": EPOCHS, "cache_limit": limit, "dataset_decoded_bytes":
               dataset_bytes, "deadlocks": sum(s is None for s in statuses), "failed": sum(s not in (0, None) for s in statuses),
               "seconds": round(time.monotonic() - began, 2)}
    if figures["deadlocks"] or figures["failed"]:
        return figures
    per_epoch = [[] for _ in range(EPOCHS)]
    bad = 0
    for path in results:
        with open(path) as fh:
            result = json.load(fh)
        bad += result["bad"]
        for e, ids in enumerate(result["epochs"]):
            per_epoch[e].extend(ids)
    expected = manifest.num_samples - manifest.num_samples % (RANKS * BATCH)
    figures.update(corrupt=bad, samples_checked=sum(len(ids) for ids in per_epoch),
                   lost=sum(expected - len(set(ids)) for ids in per_epoch),
                   duplicated=sum(len(ids) - len(set(ids)) for ids in per_epoch),
                   epochs_differ=int(per_epoch[0] != per_epoch[1]),
                   peak_cache_bytes_ok=int(_cache_bytes(cache_dir) <= limit))
    return figures


def _cache_bytes(cache_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs if f.endswith(".skd"))


if __name__ == "__main__":
    mode, source, workdir, amount, seed = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
    if mode == "concurrency":
        print(json.dumps(concurrency(source, workdir, amount, seed)))
    else:
        matrix = {"build": build_matrix, "convert": convert_matrix, "cache": cache_matrix}[mode]
        print(json.dumps(matrix(source, workdir, int(amount), seed)))
