"""The CPU a test costs, its child processes included: set SHARDKIT_TEST_CPU=FILE and each test process appends
one JSON line a test to FILE: {"test", "self", "children", "wall", "slow", "worker", "began"} (CPU-seconds: this
process's during the test, and those of the processes it started and waited for during the test, with their own
waited-for children, such as torchrun's ranks; the xdist worker that ran it and the time it began, to see the
schedule). The suite is CPU-bound on 2 cores (issue 46): compare CPU-seconds, which other work on the machine
changes little, rather than wall times. Processes left running in the background (Ray's raylets, a server a
fixture keeps) are not counted, nor the trainers forked from the suite's warm-start server (tests/conftest_warm.py;
SHARDKIT_TEST_CPU with SHARDKIT_TEST_COLD=1 counts them); a module fixture's runs count to the test that made them.

    SHARDKIT_TEST_CPU=/tmp/cpu.jsonl python3 -m pytest -m slow
    python3 tests/conftest_cpu.py /tmp/cpu.jsonl      # the 40 costliest tests and the total
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import pytest


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    report = os.environ.get("SHARDKIT_TEST_CPU")
    if not report:
        yield
        return
    (own, children), began, started = _cpu_seconds(), time.monotonic(), time.time()
    yield
    own_after, children_after = _cpu_seconds()
    record = {"test": _without_group(item.nodeid), "self": round(own_after - own, 2), "children": round(children_after - children, 2),
              "wall": round(time.monotonic() - began, 2), "slow": item.get_closest_marker("slow") is not None,
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "began": round(started, 1)}
    with open(report, "a", encoding="utf-8") as file:  # one short append a test: xdist workers share the file
        file.write(json.dumps(record) + "\n")


def _without_group(nodeid: str) -> str:
    """The test's id without the `@group` that xdist's loadgroup adds to a grouped test's (comparable run to run)."""
    return nodeid[:nodeid.rfind("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def main(path: str, most: int = 40) -> None:
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    total = sum(r["self"] + r["children"] for r in records)
    for r in sorted(records, key=lambda r: -(r["self"] + r["children"]))[:most]:
        print(f"{r['self'] + r['children']:8.1f} {r['wall']:7.1f}  {r['test']}")
    slow = sum(r["self"] + r["children"] for r in records if r["slow"])
    print(f"{len(records)} tests: {total:.0f} CPU-s ({slow:.0f} in slow ones); on 2 cores about "
          f"{total / 1.9 / 60:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
