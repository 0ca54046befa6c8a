"""Credentials in URLs never reach a message: masked in what shardkit formats and in what others format.

A URL may carry credentials in its user-info part (`s3://KEY:SECRET@bucket/prefix`). shardkit masks that
part where it formats a URL (`redact_url`), but other libraries quote the parts of a URL in their own
words: botocore says `Invalid bucket name "KEY:SECRET@bucket"`, with no `://` left to recognise. So every
URL that shardkit opens (`remember_credentials`, called by `storage.open_filesystem`) records its user-info,
and `redact_url` masks those strings wherever they appear too. The command line writes everything it
prints through `redacted_output()`, so a message is masked whoever formatted it: an error, a log record,
a warning.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

MASK = "***"
_USERINFO = re.compile(r"([a-zA-Z][\w+.-]*://)([^/@\s]*)@")
# A password is also looked for alone (not followed by "@") when it is at least this long: a short one
# ("pw") would mask pieces of ordinary words; it is still masked as part of its user-info.
_MIN_SECRET = 8
_credentials: set[str] = set()  # each user-info followed by "@", and each long password alone
_lock = threading.Lock()


def remember_credentials(*texts: str) -> None:
    """Record the user-info parts of the URLs in `texts`, so that `redact_url` masks them in any message."""
    found = set()
    for text in texts:
        for match in _USERINFO.finditer(text if isinstance(text, str) else ""):
            userinfo = match.group(2)
            if userinfo:
                found.add(f"{userinfo}@")
            password = userinfo.partition(":")[2]
            if len(password) >= _MIN_SECRET:
                found.add(password)
    if found - _credentials:
        with _lock:
            _credentials.update(found)


def redact_url(text: str) -> str:
    """`text` (a URL, or any message holding URLs) with credentials masked: every user-info part of a URL
    (`s3://key:secret@bucket` -> `s3://***@bucket`), and every user-info remembered from a URL opened in
    this process, wherever it appears (`Invalid bucket name "key:secret@bucket"` -> `"***@bucket"`)."""
    text = _USERINFO.sub(rf"\1{MASK}@", text)
    for secret in sorted(_credentials, key=len, reverse=True):  # a whole user-info before its password alone
        text = text.replace(secret, f"{MASK}@" if secret.endswith("@") else MASK)
    return text


class RedactingStream:
    """A text stream that writes through `redact_url`; everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact_url(text))
        return len(text)  # what the caller handed over, as io streams count it

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def redacted_output(*urls: str) -> Iterator[None]:
    """Within the block, `sys.stdout` and `sys.stderr` mask credentials (see `redact_url`); the user-info
    of `urls` (e.g. the command line's arguments) is remembered first, before any URL is opened."""
    remember_credentials(*urls)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(saved[0]), RedactingStream(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
