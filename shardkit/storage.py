"""All dataset I/O goes through `Storage`: one dataset prefix, resolved once at the edge to one of two
backends. Object stores (`s3://`, `gs://`, `az://`, `http(s)://`) go through obstore when it is installed
(`shardkit.object_store`: signed requests without botocore); every other protocol (local paths, file://,
memory://, ...) and the fallback go through fsspec (`FsspecObjects`). There are no per-cloud client classes.

Every remote call is wrapped in `retry_call`, the one retry policy of both backends, which retries transient
failures (5xx, throttling, resets, timeouts, a body cut short) with bounded exponential backoff and jitter, and
otherwise raises an error of the OSError family that names the URL and cause. Credentials never appear in
`repr`, logs or error messages: only the URL does.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from shardkit import metrics
from shardkit.errors import StorageError
from shardkit.names import check_relative_name
from shardkit.object_store import ObjectStoreObjects, object_store_for
from shardkit.object_store_runtime import prepare_children, ran_here, usable_here
from shardkit.redaction import redact_url, remember_credentials

logger = logging.getLogger(__name__)

T = TypeVar("T")

# HTTP statuses and S3/botocore error codes that mean "try again later".
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    # The body did not match its checksum in transit (upload or download): sending again can succeed.
    "BadDigest",
    "XAmzContentSHA256Mismatch",
}
# Exception class names (matched along the MRO, so no optional import is needed) that are transient.
_TRANSIENT_CLASS_NAMES = {
    "ConnectionError",
    "TimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientOSError",
    "ContentLengthError",
    "IncompleteRead",
    # botocore's response checksum (x-amz-checksum-*) did not match the bytes received: a re-read can succeed.
    "FlexibleChecksumError",
}
# Last resort for wrappers that keep only the message. A bare status number counts only as its own
# token: "shard-000503.tar" in a message about a missing file must not be retried six times.
_TRANSIENT_TEXT = re.compile(r"SlowDown|Service Unavailable|Internal Server Error|reset by peer"
                             r"|(?<![\w./-])(?:429|500|502|503|504)(?![\w./-])")
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.ECONNREFUSED}
# Block size of buffered whole-object reads (see Storage.read_bytes).
_READ_BLOCK = 16 * 2**20
# Never retried: the answer will not change.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter.

    Attributes:
        attempts: total tries, the first included.
        initial_delay: seconds before the second try.
        max_delay: cap on one wait.
        multiplier: growth of the wait per try.
        jitter: the wait is drawn uniformly from [delay * (1 - jitter), delay].
        deadline: seconds after the first try past which no new try starts (None: attempts alone bound it).
    """

    attempts: int = 6
    initial_delay: float = 0.2
    max_delay: float = 8.0
    multiplier: float = 2.0
    jitter: float = 0.5
    deadline: float | None = 120.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.initial_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"RetryPolicy.deadline must be positive or None, got {self.deadline}")

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits between tries: `attempts - 1` values (jittered by `rng`, else a generator seeded from the
        system's entropy once the first wait is asked for: seeding one, ~20 us, costs more than reading a small
        local file, and most calls never retry)."""
        rng = rng or random.Random()
        delay = self.initial_delay
        for _ in range(self.attempts - 1):
            capped = min(delay, self.max_delay)
            yield capped * (1 - self.jitter * rng.random())
            delay *= self.multiplier


DEFAULT_RETRY = RetryPolicy()


def _error_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised `exc` can succeed."""
    for err in _error_chain(exc):
        if isinstance(err, _PERMANENT):
            return False
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
                return True
        status = getattr(err, "status", None) or getattr(err, "status_code", None)
        if isinstance(status, int) and status in _TRANSIENT_STATUS:
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(err).__mro__):
            return True
        if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
            return True
        if _TRANSIENT_TEXT.search(str(err)):
            return True
    return False


def describe_error(exc: BaseException) -> str:
    """A one-line cause, without credentials (only exception types and messages), with the HTTP status
    of an object-store answer when the message leaves it out (s3fs turns a 404 into `Not Found`)."""
    text = redact_url(f"{type(exc).__name__}: {exc}") if str(exc) else type(exc).__name__
    return text + http_answer(exc)


def http_answer(exc: BaseException) -> str:
    """' (HTTP 404 ...)' for an error caused by an object store's answer, else ''."""
    for err in _error_chain(exc):
        if isinstance(getattr(err, "http_answer", None), str):
            return err.http_answer  # set by `object_store.as_os_error`
        response = getattr(err, "response", None)
        if not isinstance(response, dict):
            continue
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = str(response.get("Error", {}).get("Code", ""))
        operation = str(getattr(err, "operation_name", "") or "")
        if status is None:
            return ""
        # S3 answers every request but HEAD with an XML error code (NoSuchKey, NoSuchBucket, ...):
        # none means the endpoint is not an S3 API (a web server, a wrong port or path).
        if code in ("", str(status)) and operation and not operation.startswith("Head"):
            return (f" (HTTP {status} to {operation} with no S3 error code: is endpoint_url an S3 API endpoint?)")
        return f" (HTTP {status}{', ' + code if code and code != str(status) else ''})"
    return ""


def retry_call(
    fn: Callable[[], T],
    *,
    url: str,
    what: str,
    policy: RetryPolicy = DEFAULT_RETRY,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """Call `fn`, retrying transient errors under `policy`.

    Raises:
        StorageError: after the last try, or at once for a non-transient error; names `url`.
        FileNotFoundError: kept a FileNotFoundError (callers test for absence), its message naming `url`.
    """
    delays = policy.delays(rng)
    clock = time.monotonic
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        metrics.storage_attempt(what)
        try:
            return fn()
        except FileNotFoundError as err:
            # Made by a function: an error held in a local of this frame, whose traceback holds this frame,
            # would be a reference cycle keeping every caller's frame (and their objects) alive.
            raise _not_found(what, url, err) from err
        except Exception as err:  # noqa: BLE001 - classified below, re-raised with context
            transient = is_transient(err)
            delay = next(delays, None) if transient else None
            if delay is not None and policy.deadline is not None and clock() - started + delay > policy.deadline:
                delay = None  # the next try would start past the deadline
            if delay is None:
                tries = f" after {attempt} attempts" if transient else ""
                spent = f" ({clock() - started:.1f}s)" if transient else ""
                raise StorageError(f"{what} {url} failed{tries}: {describe_error(err)}{spent}") from err
            metrics.storage_retry(what, err)
            logger.warning("%s %s failed (attempt %d/%d, retrying in %.2fs): %s",
                           what, url, attempt, policy.attempts, delay, describe_error(err))
            sleep(delay)
            if policy.deadline is not None and clock() - started > policy.deadline:
                # A sleep can run long (a loaded machine): the deadline holds for the start of every try.
                raise StorageError(f"{what} {url} failed after {attempt} attempts: {describe_error(err)} "
                                   f"({clock() - started:.1f}s, past the {policy.deadline:g}s deadline)") from err


def _not_found(what: str, url: str, err: FileNotFoundError) -> FileNotFoundError:
    missing = FileNotFoundError(f"{what} {url}: not found ({describe_error(err)})")
    missing.errno = errno.ENOENT
    return missing


_S3_PROTOCOLS = ("s3", "s3a")


def filesystem_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """`storage_options` for fsspec, with botocore's own retries turned off on S3 unless the user
    configured them: `retry_call` is the one retry policy, so that tries do not multiply (botocore's
    5 legacy retries x s3fs's x ours made a refused connection take about a minute to fail)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in _S3_PROTOCOLS:
        return storage_options
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    return {**storage_options, "config_kwargs": config}


def _single_retry_policy(fs: fsspec.AbstractFileSystem) -> None:
    # s3fs retries some errors itself (`S3FileSystem.retries`, a class attribute, 5 tries, no option to
    # change it): one try each. Retries a user configures in botocore stay, under ours.
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if set(protocol) & set(_S3_PROTOCOLS):
        fs.retries = 1


# botocore's data loader of this process, by data path: it holds the parsed service models (S3's API, endpoints,
# rule set: JSON that took 0.2-0.3 s to parse for every new S3 filesystem on a loaded 2-core machine, 37% of a
# cold one-pass read of 10M tokens from S3). A loader is read-only data once filled, so every filesystem's
# session shares it, and worker processes forked after the first filesystem inherit it filled.
_MODEL_LOADERS: dict[Any, Any] = {}


def _share_model_loader(fs: fsspec.AbstractFileSystem) -> None:
    """Give a new s3fs filesystem a session of its own (credentials, profile: as s3fs would make it) whose
    service models come from the process's shared loader."""
    if getattr(fs, "session", True) is not None or getattr(fs, "_s3", None) is not None:
        return  # not s3fs, a session the caller gave, or a cached filesystem already connected
    import aiobotocore.session

    session = aiobotocore.session.AioSession(**getattr(fs, "kwargs", {}))
    key = session.get_config_variable("data_path")
    loader = _MODEL_LOADERS.setdefault(key, session.get_component("data_loader"))
    session.register_component("data_loader", loader)
    fs.session = session


def _prepare_forked_fallback() -> None:
    """Before a fork: where obstore read S3 in this process and its children cannot load a copy of their own
    (`object_store_runtime.prepare_children`), import s3fs and parse botocore's S3 models here, once.

    Such a child (a DataLoader worker) reads S3 through s3fs. Before obstore, the parent's own s3fs filesystem had imported and parsed all that, and every
    worker inherited it; without this each worker would pay for it (1-2 s on a loaded 2-core machine)."""
    if not ran_here("s3") or prepare_children() or importlib.util.find_spec("s3fs") is None:
        return
    try:
        import aiobotocore.session
        import s3fs  # noqa: F401 - imported for the children

        session = aiobotocore.session.AioSession()
        loader = _MODEL_LOADERS.setdefault(session.get_config_variable("data_path"),
                                           session.get_component("data_loader"))
        if not getattr(loader, "_shardkit_prepared", False):
            import botocore.session

            # A client built on the shared loader fills it with everything an S3 client reads (no request is made).
            builder = botocore.session.Session()
            builder.register_component("data_loader", loader)
            builder.create_client("s3", region_name="us-east-1", aws_access_key_id="-", aws_secret_access_key="-")
            loader._shardkit_prepared = True
    except Exception as err:  # noqa: BLE001 - a child then parses them itself: slower, not wrong
        logger.debug("could not prepare s3fs for forked children: %s", describe_error(err))


os.register_at_fork(before=_prepare_forked_fallback)


def open_filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """`(filesystem, path)` of `url`, built the one way shardkit builds them: its options (see
    `filesystem_options`), one try per call in s3fs, so that `retry_call` is the only retry layer, and
    S3's service models parsed once per process (`_share_model_loader`)."""
    remember_credentials(url)  # before any library can quote the URL's parts in an error
    options = dict(storage_options or {})
    fs, path = fsspec.core.url_to_fs(url, **filesystem_options(url, options))
    _single_retry_policy(fs)
    if url.split("://", 1)[0] in _S3_PROTOCOLS:
        _share_model_loader(fs)
    return fs, path


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol



# The one spelling of a temporary file: beside its target (same filesystem, so the rename is atomic),
# unique per writer, and recognisable to the cleaners of what a kill left (`tools.state.clear_state`,
# `loaders.cache_dir.remove_stale_temporaries`).
TEMPORARY_MARK = ".tmp-"


@contextlib.contextmanager
def atomic_path(path: str, *, fsync: bool = True) -> Iterator[str]:
    """A temporary path beside the local file `path`, for the block to write by any means (`open`, a
    library's `save(path)`, a download). When the block ends without an error the temporary is renamed over
    `path`, so readers, a crash or a concurrent writer see the old file or the whole new one, never part of
    one; when it raises, the temporary is removed. This is the only single-file rename of the package.

    Args:
        fsync: flush the data to the disk before the rename, so that a power loss cannot leave an empty or
            partial file under `path`. False for caches, whose files are fetched again when lost and fail
            their checks when cut short.
    """
    temporary = f"{path}{TEMPORARY_MARK}{uuid.uuid4().hex}"
    try:
        yield temporary
        if fsync:
            fd = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def write_file_atomic(path: str, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                      fsync: bool = True) -> None:
    """Write `data` (or its pieces, one after another) to the local file `path` (creating its directory)
    through `atomic_path`."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with atomic_path(path, fsync=fsync) as temporary, open(temporary, "xb") as fh:
        fh.writelines(_pieces(data))


def _pieces(data: bytes | memoryview | Sequence[bytes | memoryview]) -> Sequence[bytes | memoryview]:
    return (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data


class FsspecObjects:
    """The objects of one fsspec filesystem, by path: the backend of every protocol obstore does not serve
    (local, file://, memory://, ...) and the fallback of those it does (see `shardkit.object_store`).
    Pickles as its filesystem (fsspec filesystems do)."""

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs
        self.is_local = _is_local(fs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _single_retry_policy(self.fs)  # an unpickled filesystem is built afresh

    def invalidate(self, path: str) -> None:
        # Object-store filesystems (s3fs, gcsfs) answer stat and listing calls from cached directory
        # listings, which never see what another process or instance wrote or deleted since. A
        # dataset prefix is shared by writers and readers, so always ask the store.
        self.fs.invalidate_cache(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def identity(self, path: str) -> str:
        info = self.fs.info(path)
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
        return f"{info.get('size')}:{tag}"

    def read(self, path: str, size: int | None = None) -> bytes:
        # With the size known, one buffered file with large blocks, which s3fs serves several times faster
        # than `cat_file`, with no metadata round trip.
        if size is None or self.is_local:
            return self.fs.cat_file(path)
        with self.fs.open(path, "rb", block_size=_READ_BLOCK, size=size) as fh:
            return fh.read()

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def list(self, root: str) -> list[str]:
        self.fs.invalidate_cache(root)
        if not self.fs.exists(root):
            return []
        return [path.replace(os.sep, "/") if self.is_local else path for path in self.fs.find(root)]

    def download(self, path: str, local_path: str) -> None:
        self.fs.get_file(path, local_path)

    def download_with_identity(self, path: str, local_path: str, asked: str | None = None) -> str:
        """Copy the object to `local_path`; returns the identity of the copy or of an older version. fsspec's copy
        answers no identity, so it is asked first (`asked`, an identity asked just before, stands for that): the
        next `identity` sees an object replaced between the two as a change, never the reverse."""
        if asked is None:
            self.invalidate(path)
            asked = self.identity(path)
        self.download(path, local_path)
        return asked

    def write(self, path: str, pieces: Sequence[bytes | memoryview]) -> None:
        if self.is_local:
            write_file_atomic(path, pieces)
        else:
            self.fs.pipe_file(path, b"".join(pieces))  # what every fsspec put takes

    def delete(self, path: str) -> None:
        self.fs.invalidate_cache(path)
        if self.fs.exists(path):
            self.fs.rm_file(path)


class Storage:
    """One dataset prefix (a "directory" URL), on obstore for object stores where it is installed
    (`shardkit.object_store`), else on an fsspec filesystem.

    Names handed to its methods are relative to the prefix and validated with
    `check_relative_name`, so a manifest can never make shardkit read or write outside it.
    Instances pickle, so they can be handed to worker processes.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 *, retry: RetryPolicy = DEFAULT_RETRY):
        if not isinstance(url, str) or not url:
            raise ValueError(f"dataset URL must be a non-empty string, got {url!r}")
        # Drop trailing slashes, but keep a bare "memory://" or "file:///" whole: stripping it to
        # "memory:" would silently make it a local directory of that name.
        stripped = url.rstrip("/")
        self.url = url if not stripped or stripped.endswith(":") else stripped
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        remember_credentials(self.url)  # before any library can quote the URL's parts in an error
        objects = object_store_for(self.url, self.storage_options)
        if objects is not None:
            self.objects: FsspecObjects | ObjectStoreObjects = objects
            self.root = objects.prefix
        else:
            self._open_fsspec()
        self.is_local = self.objects.is_local

    def _open_fsspec(self) -> None:
        fs, root = open_filesystem(self.url, self.storage_options)
        root = root or fs.root_marker  # "memory://" is the memory filesystem's "/"
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.objects = FsspecObjects(fs)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem behind the prefix (built on first use where obstore serves the reads)."""
        if not isinstance(self.objects, FsspecObjects):
            fs, _ = open_filesystem(self.url, self.storage_options)
            return fs
        return self.objects.fs

    @property
    def client(self) -> str:
        """"obstore" or "fsspec": the path this prefix's reads and writes take in this process."""
        return "fsspec" if isinstance(self.objects, FsspecObjects) else "obstore"

    def _backend(self) -> FsspecObjects | ObjectStoreObjects:
        if not isinstance(self.objects, FsspecObjects) and not usable_here():
            self._open_fsspec()  # forked after obstore ran in the parent: its runtime did not come along
        return self.objects

    @property
    def display_url(self) -> str:
        """The URL for messages: a password in its user-info part (`https://user:pw@host/`) is masked."""
        return redact_url(self.url)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        remember_credentials(self.url)  # a worker process masks what its parent masked

    def __repr__(self) -> str:  # never show storage_options: they may hold credentials
        return f"Storage({self.display_url!r})"

    # -- names -------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """Path (fsspec) or key (obstore) of `name` under the prefix (validated)."""
        check_relative_name(name, what="object name")
        return f"{self.root.rstrip('/')}/{name}" if self.root else name

    def url_of(self, name: str) -> str:
        """Full URL of `name`, for messages."""
        check_relative_name(name, what="object name")
        url = self.display_url
        return f"{url.rstrip('/')}/{name}" if not url.endswith("://") else f"{url}{name}"

    def _call(self, fn: Callable[[FsspecObjects | ObjectStoreObjects, str], T], name: str, what: str) -> T:
        objects = self._backend()  # first: a fallback changes the root
        path = self.path(name)
        return retry_call(lambda: fn(objects, path), url=self.url_of(name), what=what, policy=self.retry)

    # -- reads -------------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return self._call(lambda objects, path: objects.invalidate(path) or objects.exists(path), name, "stat")

    def size(self, name: str) -> int:
        return self._call(lambda objects, path: objects.invalidate(path) or objects.size(path), name, "stat")

    def identity(self, name: str) -> str:
        """What changes when the object is replaced: its size and the store's ETag (else mtime).

        One metadata request (a HEAD on object stores); a node cache compares it with the copy it holds.
        """
        return self._call(lambda objects, path: objects.invalidate(path) or objects.identity(path), name, "stat")

    def read_bytes(self, name: str, *, size: int | None = None) -> bytes:
        """The whole object. Pass `size` when it is known (e.g. from the manifest): a remote object is then
        read with no metadata round trip, and a body that arrives short is read again."""
        return self._call(lambda objects, path: objects.read(path, size), name, "read")

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self._call(lambda objects, path: objects.read_range(path, start, end), name, "read")

    def read_range_into(self, name: str, start: int, end: int, scratch: bytearray) -> memoryview:
        """Bytes [start, end) of `name` (fewer at the end of the object), as a view valid until the next
        read into `scratch` (at least end - start bytes, reused from read to read). A local file is read into
        `scratch`: a fresh buffer's pages are faulted in one at a time, which made reading 32 MiB 3x
        slower; a remote object arrives as new bytes anyway, so the view is of those."""
        if len(scratch) < end - start:
            raise ValueError(f"scratch holds {len(scratch)} bytes, the range {end - start}")
        if not self.is_local:
            return memoryview(self.read_range(name, start, end))
        target = memoryview(scratch)[:end - start]

        def read(objects, path: str) -> memoryview:
            count = 0
            with open(path, "rb", buffering=0) as fh:
                fh.seek(start)
                while count < len(target) and (got := fh.readinto(target[count:])):
                    count += got
            return target[:count]
        return self._call(read, name, "read")

    def list_names(self) -> list[str]:
        """Names of all files under the prefix, relative to it, sorted."""
        objects = self._backend()
        paths = retry_call(lambda: objects.list(self.root), url=self.display_url, what="list", policy=self.retry)
        prefix = f"{self.root.rstrip('/')}/" if self.root else ""
        names = []
        for path in paths:
            if path.startswith(prefix):
                names.append(path[len(prefix):])
            elif prefix and path.startswith(prefix.lstrip("/")):
                names.append(path[len(prefix.lstrip("/")):])
        return sorted(names)

    def download(self, name: str, local_path: str) -> None:
        """Copy `name` to a local file path (the caller makes it atomic)."""
        self._call(lambda objects, path: objects.download(path, local_path), name, "download")

    def download_with_identity(self, name: str, local_path: str, *, asked: str | None = None) -> str:
        """Copy `name` to a local file path (the caller makes it atomic) and return the identity (as `identity`) of
        the copy, or of an older version (which the next `identity` sees as a change), never of a newer one. Each
        backend gives it its own way: obstore's GET answers it with the bytes (one request); fsspec asks first
        (a HEAD or stat, for which `asked`, an identity asked just before, stands)."""
        return self._call(lambda objects, path: objects.download_with_identity(path, local_path, asked),
                          name, "download")

    # -- writes ------------------------------------------------------------------------------
    def write_bytes(self, name: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
        """Write `data` to `name` atomically: readers see the old object or the whole new one. `data` may
        be the object's pieces in order (a local file is written piece by piece, never joined in memory).

        Local files are written to a temporary name and renamed; object stores publish an object
        only when its (single or multipart) upload completes, so a plain put is already atomic.
        """
        pieces = _pieces(data)
        self._call(lambda objects, path: objects.write(path, pieces), name, "write")

    def delete(self, name: str) -> None:
        self._call(lambda objects, path: objects.delete(path), name, "delete")

    def makedirs(self) -> None:
        """Create the prefix where the filesystem has real directories (no-op on object stores)."""
        if self.is_local:
            os.makedirs(self.root, exist_ok=True)
