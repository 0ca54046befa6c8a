"""Ranks that see different corpora refuse to run (issue 45, item 9): each rank lists the inputs itself, so a file
half copied on one node would cut other units there and train rows outside the global order. The ranks agree on
the listing (relative names and sizes) when the loader starts, with one small collective."""

from __future__ import annotations

import pytest

from shardkit.loaders.sources.raw.agreement import first_difference

SETTINGS = dict(tokenizer="byte", seq_len=64, unit_bytes=1024, lanes=4)
A = "".join(f'{{"text": "a {i} {"x" * (40 + i % 50)}"}}\n' for i in range(80))
B = "".join(f'{{"text": "b {i} {"y" * (40 + i % 50)}"}}\n' for i in range(80))


def runs(process_pool, copies, workers=0):
    from conftest import free_port
    from raw_procs import raw_node_copy_run

    port = free_port()
    return process_pool.run(raw_node_copy_run, [
        dict(root=f"memory://node{rank}/corpus", files=files, settings=SETTINGS, rank=rank, world_size=len(copies),
             port=port, steps=5, workers=workers) for rank, files in enumerate(copies)])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_whose_copies_differ_refuse_to_run_naming_the_rank_and_the_file(process_pool, workers):
    whole = {"part/a.jsonl": A, "b.jsonl": B}
    half = {"part/a.jsonl": A[:len(A) // 2], "b.jsonl": B}  # rank 1's copy of a.jsonl stopped half way
    refused = runs(process_pool, [whole, half], workers)
    for run in refused:
        assert run["rows"] == [] and run["error"] == (
            f"raw text: rank 1 does not see the corpus rank 0 sees: part/a.jsonl is {len(A) // 2:,} bytes there, "
            f"{len(A):,} bytes on rank 0 (a copy not finished on one node?); every rank must read the same files: "
            "make the copies equal and start again")
    # Equal copies under other roots on each node agree (relative names), and read.
    agreed = runs(process_pool, [whole, dict(whole)], workers)
    assert [run["error"] for run in agreed] == [None, None]
    assert sorted(agreed[0]["rows"] + agreed[1]["rows"]) == list(range(20))


def test_the_difference_names_a_missing_file_and_a_raw_stream():
    same = [[("a.jsonl", 10), ("b.jsonl", 20)]]
    missing = [[("a.jsonl", 10)]]
    assert first_difference([same, same, missing], [0, 1, 2]).startswith(
        "raw text: rank 2 does not see the corpus rank 0 sees: b.jsonl is missing there, 20 bytes on rank 0")
    two = [[("a.jsonl", 10)], [("c.jsonl", 5)]]
    other = [[("a.jsonl", 10)], [("c.jsonl", 6)]]
    assert "c.jsonl (raw stream 1) is 6 bytes there, 5 bytes on rank 0" in first_difference([two, other], [0, 1])
