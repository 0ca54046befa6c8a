"""`shardkit serve DATA --workers N`: a data service (docs/SERVICE.md). A dispatcher on --host:--port and N worker
processes on this machine serve DATA's batches to
`StreamingDataset(service="grpc://HOST:PORT")` consumers and `shardkit train --data-service URL`.

It binds loopback by default; any other address needs a shared token (--token or $SHARDKIT_SERVICE_TOKEN),
refused in one line without it, before anything starts. Options are the fields of `ServeConfig`.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from shardkit.options import Namespace, add_command, given_values, option, parse_storage_options, \
    storage_options_option


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What `shardkit serve` serves and where (one field per option)."""

    data: str = option(help="dataset URL (holding shardkit.json), raw text inputs with --tokenizer, or a mixture: "
                            "URL:WEIGHT entries separated by commas", positional=True, metavar="DATA")
    workers: int = option(2, "worker processes on this machine")
    host: str = option("127.0.0.1", "address the dispatcher and workers bind (any non-loopback one needs --token)")
    port: int = option(8815, "the dispatcher's port (0: any free port); consumers connect to grpc://HOST:PORT")
    join: str | None = option(None, "run only the workers, on this machine, joining the dispatcher of another "
                              "shardkit serve at this address (grpc://HOST:PORT; the same DATA and options)",
                              metavar="URL")
    ray: str | None = option(None, "place the --workers as Ray actors on the Ray cluster at this address (Ray "
                             "restarts what dies); the dispatcher stays in this process", metavar="ADDRESS")
    token: str | None = option(None, "shared token every consumer sends (default $SHARDKIT_SERVICE_TOKEN); never "
                               "logged", repr=False)
    tokenizer: str | None = option(None, "serve raw text, tokenized and packed by the workers (a tokenizer spec)")
    seq_len: int | None = option(None, "with --tokenizer: tokens a model reads per sample")
    pack: str = option("concat", "with --tokenizer: 'concat', 'bestfit' or 'none'")
    text_field: str = option("text", "with --tokenizer: the JSON key / Parquet column holding the text")
    lanes: int = option(64, "with --tokenizer: independent streams the inputs' work units are dealt into")
    seed: int = option(0, "the order's seed (consumers read the order of this seed)")
    shuffle: bool = option(True, "shuffle the order")
    cache_dir: str | None = option(None, "the workers' node-local shard cache (built data)")
    storage_options: str | None = storage_options_option()
    metrics_port: int = option(0, "serve the dispatcher's Prometheus metrics (rows sent per worker) at "
                               "http://127.0.0.1:P/metrics (0: off)", metavar="P")

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} must be in 0..65535, got {getattr(self, name)}")
        if self.tokenizer is not None and self.seq_len is None:
            raise ValueError("--tokenizer serves raw text and needs --seq-len")


def register(subparsers: Any) -> None:
    add_command(subparsers, "serve", run_serve, options=[ServeConfig], bool_values=False,
                help="serve a dataset's batches to trainers over Arrow Flight (a data service)",
                description=__doc__.split("\n\n")[0].replace("\n", " "))


def data_spec(config: ServeConfig) -> Any:
    """The served data: `--data` as the trainer reads it (`shardkit.train.data`), with the loader options."""
    from shardkit.serve.data import DataSpec
    from shardkit.train.config import data_entries
    from shardkit.train.data import raw_source

    storage = parse_storage_options(config.storage_options) or None
    options: dict[str, Any] = dict(seed=config.seed, shuffle=config.shuffle)
    if storage:
        options["storage_options"] = storage
    source = raw_source(config.data, storage, built_as_built=True) if config.tokenizer else None
    if source is not None:
        options.update(tokenizer=config.tokenizer, seq_len=config.seq_len, pack=config.pack,
                       text_field=config.text_field, lanes=config.lanes)
    elif config.cache_dir:
        options["cache_dir"] = config.cache_dir
    entries = data_entries(config.data)
    if source is None:
        source = entries[0][0] if len(entries) == 1 else [{"url": u, "weight": w} for u, w in entries]
    elif not isinstance(source[0], str):
        source = [{"url": s.url, "weight": s.weight, "raw_text": s.raw_text} for s in source]
    elif len(source) == 1:
        source = source[0]
    if isinstance(source, list) and any(not isinstance(entry.get("weight", 1.0), float) for entry in source):
        raise ValueError("--data: weight schedules are not served yet; give fixed weights")
    if isinstance(source, list) and all(isinstance(entry, str) for entry in source):
        raise ValueError("--data: several raw text inputs: give them as one directory or glob")
    return DataSpec(source=source, options=options)


def run_serve(args: Namespace) -> int:
    from shardkit.serve.security import check_binding, token_from

    try:
        config = ServeConfig(**given_values(args, ServeConfig))
        token = token_from(config.token)
        check_binding(config.host, token)  # before any data is opened or a port bound
        spec = data_spec(config)
        spec.describe()  # the data opens here: a bad DATA fails now, in one line, not in N workers
    except (ValueError, OSError, TypeError) as err:
        print(f"shardkit serve: {err}", file=sys.stderr)
        return 2
    from shardkit.serve.local import LocalService

    try:
        service = LocalService(spec, workers=config.workers, host=config.host, port=config.port, token=token,
                               join=config.join, ray_address=config.ray)
    except (ValueError, OSError) as err:
        print(f"shardkit serve: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if config.metrics_port:
        from shardkit.metrics import start_metrics_server

        try:
            start_metrics_server(config.metrics_port)
        except OSError as err:
            service.close()
            print(f"shardkit serve: {err}", file=sys.stderr)
            return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a scheduler's stop: close the workers, exit 0
    with service:
        print(f"serving {config.data} {'joining' if config.join else 'at'} {service.url} with {config.workers} workers",
              flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0
