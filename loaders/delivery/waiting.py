"""Say what a loader waits for when its first batch takes long (raw units being tokenized, a cold cache's first
shards, a resume re-reading its lanes): a tqdm line on a terminal, a log line otherwise, and nothing at all when
the batch comes within `NOTICE_SECONDS` (libraries stay quiet for short waits)."""

from __future__ import annotations

import logging
import sys
import threading
import time

logger = logging.getLogger(__name__)

NOTICE_SECONDS = 1.0  # a first batch that takes longer is announced
_REFRESH_SECONDS = 0.5  # how often the terminal line's elapsed time is redrawn


class WaitNotice:
    """Announces, after `NOTICE_SECONDS` without a first batch, what the loader is waiting for (`what`), until
    `done()`. A daemon thread watches the time, so the training process's own wait is not interrupted."""

    def __init__(self, what: str):
        self.what = what
        self.shown = False
        self._started = time.monotonic()
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="shardkit-first-batch-notice", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        if self._done.wait(NOTICE_SECONDS):
            return
        self.shown = True
        if not sys.stderr.isatty():
            logger.info("waiting for the first batch: %s", self.what)
            return
        from tqdm import tqdm

        line = tqdm(desc=f"waiting for the first batch: {self.what}", bar_format="{desc} ({elapsed})",
                    file=sys.stderr, leave=False)
        while not self._done.wait(_REFRESH_SECONDS):
            line.refresh()
        line.close()

    def done(self) -> None:
        """The first batch came: stop watching (and say after how long, where the wait was announced)."""
        if self._done.is_set():
            return
        self._done.set()
        self._watcher.join(timeout=2 * _REFRESH_SECONDS)  # the terminal line is cleared before training prints
        if self.shown:
            logger.info("first batch after %.1f s (%s)", time.monotonic() - self._started, self.what)
