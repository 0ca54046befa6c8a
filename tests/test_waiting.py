"""A long wait for the first batch says what it waits for (issue 46 item 4; shardkit.loaders.delivery.waiting): raw
units being tokenized, a resume re-reading its lanes, a cold cache's first shards. The wait is made long
deterministically: the inputs sit on a filesystem (the local one under another protocol) whose reads are held
until the notice has been logged, so the notice must come while the loader waits, whatever the machine's speed."""

from __future__ import annotations

import itertools
import logging
import threading

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from loader_helpers import write_fixed
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.loaders.delivery import waiting
from test_build import write_corpus

NOTICE = "waiting for the first batch: "


class HeldFileSystem(LocalFileSystem):
    """The local filesystem as `held://`: while `held` is set, every open waits for `gate` (a slow store)."""

    protocol = ("held",)
    held = False
    gate = threading.Event()

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("held://"):] if path.startswith("held://") else path)

    def _open(self, path, *args, **kwargs):
        if HeldFileSystem.held:
            assert HeldFileSystem.gate.wait(60), "the notice never came"
        return super()._open(path, *args, **kwargs)


class OpenOnNotice(logging.Handler):
    """Lets the held reads go once the notice is logged; keeps the notices."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
        if record.getMessage().startswith(NOTICE):
            HeldFileSystem.gate.set()


@pytest.fixture
def notices():
    fsspec.register_implementation("held", HeldFileSystem, clobber=True)
    HeldFileSystem.held = False
    HeldFileSystem.gate.clear()
    handler = OpenOnNotice()
    notice_logger = logging.getLogger(waiting.__name__)
    level = notice_logger.level
    notice_logger.setLevel(logging.INFO)
    notice_logger.addHandler(handler)
    yield handler.messages
    notice_logger.removeHandler(handler)
    notice_logger.setLevel(level)
    HeldFileSystem.held = False


def raw_loader(corpus):
    return StreamingDataLoader(StreamingDataset([f"held://{corpus}/*.jsonl*"], tokenizer="byte", seq_len=16,
                                                lanes=3, rank=0, world_size=1), batch_size=2)


def first_batch_held(loader):
    """The loader's first batch, its reads held until the notice (the loader is built: inputs listed already)."""
    HeldFileSystem.held = True
    try:
        return next(iter(loader))
    finally:
        HeldFileSystem.held = False


def test_raw_text_tokenizing_and_a_resume_re_reading_its_lanes_say_so(tmp_path, notices):
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    loader = raw_loader(corpus)
    first_batch_held(loader)
    assert notices[0] == NOTICE + "tokenizing and packing the first units of 3 raw-text lanes"
    assert notices[1].startswith("first batch after ") and len(notices) == 2
    list(itertools.islice(loader, 2))
    assert len(notices) == 2  # the batches after the first: no notice
    resumed = raw_loader(corpus)
    resumed.load_state_dict(loader.state_dict())
    HeldFileSystem.gate.clear()
    first_batch_held(resumed)
    assert notices[2] == NOTICE + "re-reading 3 raw-text lanes up to their saved cursors"


def test_a_cold_cache_says_so(tmp_path, notices):
    write_fixed(str(tmp_path / "data"), 40, per_shard=10)
    loader = StreamingDataLoader(StreamingDataset(f"held://{tmp_path / 'data'}", cache_dir=str(tmp_path / "cache"),
                                                  rank=0, world_size=1), batch_size=4)
    first_batch_held(loader)
    assert notices[0] == NOTICE + "reading the shards of epoch 0 at position 0 into the node cache (a cold cache " \
                                  "downloads them)"


def test_a_wait_below_the_threshold_says_nothing(tmp_path, notices, monkeypatch):
    """Libraries stay quiet for short waits: a first batch that comes within NOTICE_SECONDS prints nothing (the
    threshold raised so far that no machine reads 2 batches of a local corpus that slowly)."""
    monkeypatch.setattr(waiting, "NOTICE_SECONDS", 120.0)
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    list(itertools.islice(raw_loader(corpus), 2))
    assert notices == []


def test_on_a_terminal_the_wait_is_a_tqdm_line(tmp_path):
    """stderr a terminal (a pseudo-terminal here): the notice is a tqdm line with the time waited; the held reads
    go once this test has seen it on the terminal."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import termios
    import sys
    from pathlib import Path

    corpus = write_corpus(tmp_path / "corpus", docs=40)
    script = (f"import sys, threading; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "import fsspec\n"
              "from test_waiting import HeldFileSystem, first_batch_held, raw_loader\n"
              "fsspec.register_implementation('held', HeldFileSystem, clobber=True)\n"
              "threading.Thread(target=lambda: (sys.stdin.readline(), HeldFileSystem.gate.set()), daemon=True).start()\n"
              f"first_batch_held(raw_loader({str(corpus)!r}))\n"
              "print('first batch', flush=True)\n")
    terminal, stderr = pty.openpty()
    # A terminal 120 columns wide (a new pseudo-terminal has 0, into which tqdm fits nothing).
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    run = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=stderr, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    os.close(stderr)
    shown = ""
    try:
        while NOTICE + "tokenizing and packing the first units of 3 raw-text lanes (" not in shown:
            assert select.select([terminal], [], [], 300)[0], f"no notice on the terminal: {shown!r}"
            try:
                shown += os.read(terminal, 4096).decode(errors="replace")
            except OSError:  # the run ended (EIO): what it printed says why
                pytest.fail(f"the run ended without the notice: {shown!r}")
        run.stdin.write("go\n")
        run.stdin.flush()
        assert run.stdout.readline() == "first batch\n"
    finally:
        run.kill()
        run.wait()
        os.close(terminal)
