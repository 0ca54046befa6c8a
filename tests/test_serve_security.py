"""`shardkit serve`'s rules at its door (issue 43, item 5): loopback by default, a shared token for any other
address (refused in one line without it, before any data flows), and bad requests (malformed messages, another
dataset's identity or state, a step past the data's end) answered with a clear error that never takes the
dispatcher or a worker down."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.flight as flight
import pytest

from conftest import outside_address
from resume_contract import take
from shardkit.cli.main import main
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.sources.service.wire import StreamRequest
from shardkit.serve.local import LocalService
from test_serve import data, in_process, served, spec_of  # noqa: F401 - the module's data fixture

TOKEN = "tok-7f3a9c"


def test_a_non_loopback_address_without_a_token_is_refused_in_one_line(data, capsys, monkeypatch):
    monkeypatch.delenv("SHARDKIT_SERVICE_TOKEN", raising=False)
    assert main(["serve", str(data / "built"), "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host 0.0.0.0" in err and "--token" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="shared token"):
        LocalService(spec_of(data, "built"), workers=0, host="0.0.0.0")


def test_calls_without_the_token_are_refused_before_any_data(data, monkeypatch, caplog):
    address = outside_address() or "127.0.0.1"
    monkeypatch.delenv("SHARDKIT_SERVICE_TOKEN", raising=False)
    with LocalService(spec_of(data, "built"), workers=0, worker_threads=1, host=address, token=TOKEN) as service:
        service.wait_for_workers(1)
        for token in (None, "wrong"):
            with pytest.raises(PermissionError, match="needs its shared token") as refused:
                StreamingDataset(None, service=service.url, service_token=token, rank=0, world_size=1)
            assert "\n" not in str(refused.value)
        worker = service.workers()[0]["location"]
        with pytest.raises(flight.FlightUnauthenticatedError):  # the worker, asked directly, refuses too
            next(iter(flight.FlightClient(worker).do_get(flight.Ticket(b"{}"))))
        monkeypatch.setenv("SHARDKIT_SERVICE_TOKEN", TOKEN)
        batches = take(served(service.url)(0, 1), 3)
        np.testing.assert_array_equal(np.concatenate(batches), np.concatenate(take(in_process(spec_of(data, "built"))(0, 1), 3)))
    assert TOKEN not in caplog.text


def test_bad_requests_get_a_clear_error_and_the_service_goes_on(data):
    spec = spec_of(data, "built")
    with LocalService(spec, workers=0, worker_threads=1) as service:
        service.wait_for_workers(1)
        worker = flight.FlightClient(service.workers()[0]["location"])
        dispatcher = flight.FlightClient(service.url)
        identity = service.dispatcher._describe({})["identity"]
        good = dict(rank=0, world_size=1, local_rank=0, local_world_size=1, batch_size=4, identity=identity)
        bad_tickets = {
            b"\xff\x00 not json": "not a JSON object",
            b"[1, 2]": "not a JSON object",
            json.dumps({"protocol": 1, **good, "rank": 5}).encode(): "outside its world",
            json.dumps({"protocol": 1, **good, "batch_size": "8"}).encode(): "batch_size must be an integer",
            json.dumps({"protocol": 1, **good, "colour": 1}).encode(): "its fields must be",
            json.dumps({"protocol": 9, **good}).encode(): "protocol must be 1",
            StreamRequest(**{**good, "identity": "another-dataset"}).to_bytes(): "the consumer reads another-dataset",
            StreamRequest(**good, state={"version": 1, "epoch": "x"}).to_bytes(): "ValueError",
        }
        for ticket, reason in bad_tickets.items():
            with pytest.raises(flight.FlightServerError, match=f"refused: .*{reason}"):
                worker.do_get(flight.Ticket(ticket)).read_all()
        for call in (lambda: list(worker.do_action(flight.Action("drop-tables", b""))),
                     lambda: list(dispatcher.do_action(flight.Action("heartbeat", b"\x00"))),
                     lambda: dispatcher.get_flight_info(flight.FlightDescriptor.for_command(b"{\"exclude\": 3}"))):
            with pytest.raises(flight.FlightServerError, match="refused: "):
                call()
        # a state of other data, and a position past the data's end: refused when loaded, naming what differs
        other = StreamingDataLoader(StreamingDataset(str(data / "a"), tokenizer="byte", seq_len=64), batch_size=4)
        loader = served(service.url)(0, 1)
        with pytest.raises(ValueError, match="data service: .*(other|dataset)"):
            loader.load_state_dict(other.state_dict())
        saved = loader.state_dict()
        beyond = {**saved, "position": {**saved["position"], "samples": 10_000}}
        with pytest.raises(ValueError, match="data service: .*beyond the end of epoch"):
            loader.load_state_dict(beyond)
        # the dispatcher and the worker still serve
        np.testing.assert_array_equal(np.concatenate(take(loader, 4)), np.concatenate(take(in_process(spec)(0, 1), 4)))


@pytest.mark.slow
def test_shardkit_serve_runs_worker_processes_that_consumers_read(data):
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "shardkit", "serve", str(data / "built"), "--workers", "1",
                                "--port", "0", "--cache-dir", str(data / "cache")], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving ") and " at grpc://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]
        got = take(StreamingDataLoader(StreamingDataset(None, service=url, service_timeout=120), batch_size=4), 5)
        np.testing.assert_array_equal(np.concatenate(got), np.concatenate(take(in_process(spec_of(data, "built"))(0, 1), 5)))
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
