"""The dispatcher at a scale one machine cannot hold as real workers (issue 43, item 7): `bench_service.py --dispatch`.

The real `Dispatcher` runs in the measuring process and nothing else does there; its clients are simulated in two
child processes on loopback: W workers that register and send heartbeats every half second as `run_heartbeats`
does (their locations are never dialled), and C consumers, each a thread asking for its streams' workers (a route
of up to 8 workers, as a consumer reading its steps in parts asks) in a loop. Per (C, W): the dispatcher's CPU per
second for the heartbeats alone, then with the consumers routing as fast as they can: routes per second, the
dispatcher's CPU per route (the heartbeats' share taken out) and the route latency the consumers see.

A consumer asks the dispatcher only when it starts its streams (an iteration, a resume, a reassignment after a
broken stream), never per batch: its cost per batch is the cost of a route divided by the batches of a stream.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import threading
import time

import pyarrow.flight as flight

DESCRIPTION = {"identity": "simulated", "describe": "simulated data"}


def _action(client: flight.FlightClient, name: str, body: dict) -> dict:
    results = list(client.do_action(flight.Action(name, json.dumps(body).encode())))
    return json.loads(results[0].body.to_pybytes())


def fake_workers(url: str, count: int, seconds: float, ready: multiprocessing.Event, out: multiprocessing.Queue) -> None:
    """`count` workers' membership for `seconds`: register, then a heartbeat each every 0.5 s."""
    client = flight.FlightClient(url)
    ids = [_action(client, "register", {"location": f"grpc://127.0.0.1:{10000 + i}", "description": DESCRIPTION,
                                        "pid": 0})["id"] for i in range(count)]
    ready.set()
    sent, rows, end = 0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        rows += 64
        for worker_id in ids:
            _action(client, "heartbeat", {"id": worker_id, "load": {"streams": 1, "batches": rows // 8, "rows": rows}})
            sent += 1
        time.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
    out.put(sent)


def consumers(url: str, count: int, parts: int, seconds: float, out: multiprocessing.Queue) -> None:
    """`count` consumer threads routing in a loop for `seconds`; puts every route's latency (s)."""
    latencies: list[float] = []
    lock = threading.Lock()
    command = flight.FlightDescriptor.for_command(json.dumps({"exclude": [], "workers": parts}).encode())

    def consume() -> None:
        client, mine, end = flight.FlightClient(url), [], time.monotonic() + seconds
        while time.monotonic() < end:
            asked = time.perf_counter()
            client.get_flight_info(command)
            mine.append(time.perf_counter() - asked)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=consume) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(latencies)


def measure(consumer_count: int, worker_count: int, *, seconds: float) -> dict:
    """One (C, W) point: the dispatcher in this process, its clients in two child processes."""
    from shardkit.serve.dispatcher import Dispatcher

    context = multiprocessing.get_context("spawn")  # no fork of a process running gRPC threads
    dispatcher = Dispatcher(location="grpc://127.0.0.1:0", token=None)
    url = f"grpc://127.0.0.1:{dispatcher.port}"
    try:
        ready, beats = context.Event(), context.Queue()
        workers = context.Process(target=fake_workers, args=(url, worker_count, 2 * seconds + 30, ready, beats))
        workers.start()
        ready.wait(60)
        time.sleep(1.0)
        cpu = time.process_time()
        time.sleep(seconds)
        heartbeat_cpu_per_s = (time.process_time() - cpu) / seconds
        routed = context.Queue()
        clients = context.Process(target=consumers, args=(url, consumer_count, min(8, worker_count), seconds, routed))
        start_cpu, started = time.process_time(), time.monotonic()
        clients.start()
        latencies = routed.get(timeout=seconds + 120)
        cpu, wall = time.process_time() - start_cpu, time.monotonic() - started
        clients.join()
        workers.terminate()
        workers.join()
    finally:
        dispatcher.shutdown()
    route_cpu = max(0.0, cpu - heartbeat_cpu_per_s * wall)
    ordered = sorted(latencies)
    return {"consumers": consumer_count, "workers": worker_count, "routes": len(latencies),
            "routes_per_s": len(latencies) / seconds, "heartbeat_cpu_ms_per_s": heartbeat_cpu_per_s * 1e3,
            "cpu_us_per_route": route_cpu / max(1, len(latencies)) * 1e6,
            "route_ms_p50": statistics.median(ordered) * 1e3, "route_ms_p99": ordered[int(0.99 * (len(ordered) - 1))] * 1e3}


def dispatcher_scale(points: list[tuple[int, int]], *, seconds: float, runs: int) -> list[dict]:
    """Every (consumers, workers) point, the median of `runs` measurements of each figure (every run kept under
    "runs"), printed as a table as it is measured."""
    print(f"{'consumers':>9} {'workers':>7} {'routes/s':>9} {'CPU us/route':>12} {'heartbeats CPU ms/s':>19} "
          f"{'route ms p50':>12} {'p99':>8}")
    rows = []
    for consumer_count, worker_count in points:
        measured = [measure(consumer_count, worker_count, seconds=seconds) for _ in range(runs)]
        row = {key: statistics.median(m[key] for m in measured) for key in measured[0]} | {"runs": measured}
        rows.append(row)
        print(f"{row['consumers']:>9} {row['workers']:>7} {row['routes_per_s']:>9,.0f} {row['cpu_us_per_route']:>12,.0f} "
              f"{row['heartbeat_cpu_ms_per_s']:>19.1f} {row['route_ms_p50']:>12.2f} {row['route_ms_p99']:>8.2f}",
              flush=True)
    return rows
