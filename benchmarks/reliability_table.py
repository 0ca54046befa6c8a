"""Print the docs/RELIABILITY.md table from the figures the reliability tests wrote.

    python -m pytest -q tests/test_faults.py tests/test_adversarial.py tests/test_pipeline_faults.py \
        tests/test_kill_matrix.py tests/test_secrets.py tests/test_fuzz.py tests/test_checkpoint.py \
        tests/test_storage.py tests/test_cache_security.py tests/test_quarantine.py \
        tests/test_loop.py::test_sigkill_at_random_moments_from_outside_then_exact_resume
    python benchmarks/reliability_table.py [bench_out/reliability.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# scenario key prefix -> (promise, test that proves it)
SCENARIOS = [
    ("storage_round_trip_10pct", "Storage read/write/range/list at 10% faults return the written bytes",
     "tests/test_faults.py::test_storage_round_trip_under_faults[0.1]"),
    ("storage_round_trip_30pct", "... at 30% faults", "tests/test_faults.py::test_storage_round_trip_under_faults[0.3]"),
    ("write_dataset_10pct", "write_dataset + verified reads at 10% faults: fault-free manifest, same samples",
     "tests/test_faults.py::test_write_dataset_under_faults_matches_fault_free[0.1-*]"),
    ("write_dataset_30pct", "... at 30% faults", "tests/test_faults.py::test_write_dataset_under_faults_matches_fault_free[0.3-*]"),
    ("flipped_bytes", "A flipped bit in a GET body is never returned (botocore checksum or manifest SHA-256, re-read)",
     "tests/test_faults.py::test_flipped_bytes_are_never_returned"),
    ("cache_fetch_30pct", "The loader's cache fetch (read_shard) at 30% faults, flips reaching it: re-read, same samples, no temporaries",
     "tests/test_faults.py::test_cache_fetch_under_faults"),
    ("retry_budget_exhausted", "Past the retry budget: bounded requests and time, error names the object URL",
     "tests/test_faults.py::test_retry_budget_exhausted_names_the_object"),
    ("build_upload_10pct", "`shardkit build` to S3 at 10% faults: same manifest and shard hashes as fault-free",
     "tests/test_pipeline_faults.py::test_build_under_faults_matches_fault_free[tar-0.1]"),
    ("build_upload_30pct", "... at 30% faults (arrow)", "tests/test_pipeline_faults.py::test_build_under_faults_matches_fault_free[arrow-0.3]"),
    ("loader_download_10pct", "Loader from S3 at 10% faults yields exactly the fault-free sample stream",
     "tests/test_pipeline_faults.py::test_loader_under_faults_yields_the_fault_free_stream[obstore-0.1]"),
    ("loader_download_30pct", "... at 30% faults", "tests/test_pipeline_faults.py::test_loader_under_faults_yields_the_fault_free_stream[obstore-0.3]"),
    ("loader_download_30pct_fsspec", "... at 30% faults, through fsspec (the opt-out)",
     "tests/test_pipeline_faults.py::test_loader_under_faults_yields_the_fault_free_stream[fsspec-0.3]"),
    ("sigkill_build", "Build SIGKILLed at 20 seeded points, rerun: manifest equals the uninterrupted build's",
     "tests/test_kill_matrix.py::test_build_sigkill_matrix"),
    ("sigkill_cache_download", "Cache: 3 readers, one SIGKILLed at 20 seeded points: others finish, no partial file read",
     "tests/test_kill_matrix.py::test_cache_download_sigkill_matrix"),
    ("sigkill_training", "Training SIGKILLed at 20 seeded points (start-up, steps, checkpoint saves), resumed: reports the newest checkpoint it resumed from, bitwise-equal losses, every sample id once",
     "tests/test_kill_matrix.py::test_training_sigkill_matrix"),
    ("sigkill_training_weight_schedule", "Training on a two-stream mixture whose weights switch at step 4, SIGKILLed at 6 seeded points, resumed: bitwise-equal losses and the same sample ids per step on both sides of the switch",
     "tests/test_kill_matrix.py::test_training_sigkill_with_a_weight_schedule"),
    ("sigkill_training_ddp_outside", "DDP run (2 ranks) SIGKILLed with its launcher at seeded random moments by a watcher outside its process tree: resumes from the newest checkpoint, bitwise-equal losses and sample ids",
     "tests/test_loop.py::test_sigkill_at_random_moments_from_outside_then_exact_resume[ddp-1]"),
    ("sigkill_training_fsdp_outside", "... FSDP", "tests/test_loop.py::test_sigkill_at_random_moments_from_outside_then_exact_resume[fsdp-2]"),
    ("damaged_checkpoint", "Newest checkpoint truncated / a file deleted / marker cut: --resume auto skips it naming it, resumes the previous one exactly; none valid: one-line error",
     "tests/test_checkpoint.py::test_resume_auto_falls_back_past_a_damaged_newest_checkpoint"),
    ("storage_single_retry_layer", "S3 requests that always fail: the store sees exactly shardkit's tries (botocore's and s3fs's retries off by default)",
     "tests/test_storage.py::test_shardkit_is_the_only_retry_layer_by_default"),
    ("storage_refused_connection", "S3 endpoint refusing connections: StorageError naming URL and cause after shardkit's 6 tries",
     "tests/test_storage.py::test_a_refused_connection_fails_in_seconds_naming_url_and_cause"),
    ("storage_throttled_40pct", "40% of requests answered 503 SlowDown: every read still returns the written bytes",
     "tests/test_storage.py::test_a_throttling_store_is_still_waited_for"),
    ("storage_non_s3_endpoint", "A non-S3 endpoint answering 404: errors name the object URL, the HTTP status and the likely cause",
     "tests/test_storage.py::test_a_non_s3_endpoint_answering_404_is_named_with_the_url_and_the_cause"),
    ("quarantine_one_node", "Shard corrupt only as one node sees the store (the proxy flips it for rank 1 only), `on_corrupt=\"skip\"`, 2 gloo ranks on 2 cache dirs: both ranks skip it (agreed), equal batch counts, every other sample once, exact resume",
     "tests/test_quarantine.py::test_shard_corrupt_on_one_node_is_skipped_on_every_rank"),
    ("quarantine_raise", "Same corruption, `on_corrupt=\"raise\"` (default): `CorruptShardError` naming the shard",
     "tests/test_quarantine.py::test_on_corrupt_raise_names_the_shard"),
    ("quarantine_list", "`shardkit verify --quarantine-list` on 2 corrupted shards, then a run with `quarantine_list=`: left out from the start, 2 ranks balanced, every other sample once",
     "tests/test_quarantine.py::test_quarantine_list_round_trip"),
    ("storm_8x4", "Start-up storm, 8 nodes x 4 ranks against the proxy with 10% SlowDown answers: per node one manifest GET, one index GET, each needed shard once, no other; every sample once",
     "tests/test_manifest_storm.py::test_storm_one_manifest_get_per_node_and_each_shard_once"),
    ("storm_64x8", "... the issue's 64 nodes x 8 ranks (`SHARDKIT_STORM=64x8`, not in CI: minutes)",
     "tests/test_manifest_storm.py::test_storm_one_manifest_get_per_node_and_each_shard_once"),
    ("cache_16_processes", "16 processes (4 ranks x 3 workers), cache limit 75% of the dataset, 2 epochs: each sample once per epoch",
     "tests/test_kill_matrix.py::test_sixteen_processes_share_a_cache_smaller_than_the_dataset"),
    ("adversarial_manifests", "Manifest naming `../`, absolute, URL, drive, backslash, NUL shards: ManifestError",
     "tests/test_adversarial.py::test_manifest_with_unsafe_shard_name_is_refused"),
    ("adversarial_tar", "Tar traversal/absolute/nested names, sym/hard links, dirs, FIFOs, GNU long names, absurd sizes, pickles: CorruptShardError, nothing extracted",
     "tests/test_adversarial.py::test_hostile_tar_member_is_refused"),
    ("adversarial_arrow", "Arrow wrong schema (dtype, extra/missing column, flat, strings), nulls, misaligned docs: CorruptShardError",
     "tests/test_adversarial.py::test_hostile_arrow_shard_is_refused"),
    ("zstd_bomb_tar-declared", "1 GiB zstd bomb in a tar member, size declared: refused, RSS bounded",
     "tests/test_adversarial.py::test_zstd_bomb_is_refused_in_bounded_memory[tar-declared]"),
    ("zstd_bomb_tar-undeclared", "... size not declared", "tests/test_adversarial.py::test_zstd_bomb_is_refused_in_bounded_memory[tar-undeclared]"),
    ("zstd_bomb_arrow-declared", "1 GiB zstd bomb as an Arrow IPC buffer, frame size declared: refused before pyarrow allocates",
     "tests/test_adversarial.py::test_zstd_bomb_is_refused_in_bounded_memory[arrow-declared]"),
    ("zstd_bomb_arrow-undeclared", "... frame size not declared", "tests/test_adversarial.py::test_zstd_bomb_is_refused_in_bounded_memory[arrow-undeclared]"),
    ("fuzz", "Fuzzed shards raise only CorruptShardError; fuzzed JSONL/Parquet ingest accounts for every record",
     "tests/test_fuzz.py"),
    ("cache_dir_writable", "Cache root (explicit or default) or dataset directory writable by others (0777, 1777, 0770, 0722): UnsafeCacheDirError naming it and cache_dir=/--cache-dir",
     "tests/test_cache_security.py::test_a_cache_dir_others_can_write_is_refused"),
    ("cache_dir_other_owner", "Cache directory owned by another user, a link to one, or a link another user planted: refused the same way",
     "tests/test_cache_security.py::test_a_cache_dir_owned_by_another_user_is_refused"),
    ("cache_poisoned_decoded_file", "A forged, stale (another shard's), damaged or truncated .skd where the loader looks: warned, decoded again from the verified shard, never served",
     "tests/test_cache_security.py::test_a_decoded_file_not_bound_to_its_shard_is_decoded_again"),
    ("secrets", "Sentinel secrets (env, storage_options) absent from DEBUG logs, errors, reprs, report, manifests, loader state",
     "tests/test_secrets.py::test_secrets_never_leak[obstore]"),
    ("secrets_fsspec", "... through fsspec (the opt-out), botocore's and s3fs's DEBUG logs among them",
     "tests/test_secrets.py::test_secrets_never_leak[fsspec]"),
]
COLUMNS = ("runs", "faults", "samples_checked", "lost", "duplicated", "corrupt")


def cell(entry: dict, key: str) -> str:
    return str(entry[key]) if key in entry else "-"


def main(path: str) -> None:
    figures = json.loads(Path(path).read_text())
    print("| Scenario | Promise | Test | " + " | ".join(COLUMNS) + " | Other figures |")
    print("|---|---|---|" + "---|" * (len(COLUMNS) + 1))
    for key, promise, test in SCENARIOS:
        entry = figures.get(key)
        if entry is None:
            print(f"| {key} | {promise} | `{test}` | " + " | ".join("not run" for _ in COLUMNS) + " | |")
            continue
        other = ", ".join(f"{k}={v}" for k, v in sorted(entry.items()) if k not in COLUMNS)
        print(f"| {key} | {promise} | `{test}` | " + " | ".join(cell(entry, c) for c in COLUMNS) + f" | {other} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench_out/reliability.json")
