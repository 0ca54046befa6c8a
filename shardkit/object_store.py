"""The object-store path: `s3://`, `gs://`, `az://` and `http(s)://` datasets through obstore (Rust's
`object_store`: signed requests without botocore, a client set up in milliseconds) when it is installed.

`storage.Storage` asks `object_store_for(url, storage_options)` once, at the edge: it answers an
`ObjectStoreObjects` (this module's backend) or None, and None means fsspec, the path of every other protocol and
the fallback. obstore is the default where it is installed; the fallback is taken when obstore is not installed,
when `SHARDKIT_STORAGE_CLIENT=fsspec` (the opt-out), when the URL carries a user-info part, or when
`storage_options` hold a key this module does not translate (botocore's `config_kwargs`, an `aiohttp` session,
...): the options are fsspec's, so every key obstore cannot honour keeps its fsspec meaning rather than being
dropped.

One credential story for both paths: the same `storage_options` keys (fsspec's names: `key`/`secret`/`token`,
`endpoint_url`, `client_kwargs.region_name`, `anon`, `profile`, ...), else the environment (`AWS_*`, `GOOGLE_*`,
`AZURE_*`), else on S3 botocore's own chain when botocore is installed (profiles, shared files, SSO, instance
roles), exactly what s3fs would find. One retry policy: obstore's own retries are off (`max_retries` 0), so
`storage.retry_call` is the only layer, as with fsspec. Errors come back as the `OSError` family
(`FileNotFoundError`, `PermissionError`, `ConnectionError`, `OSError` with the HTTP `status`), one line, the
store's XML body reduced to its error code; credentials are never part of them.

tokio's runtime, which obstore starts in a process at its first request, does not survive `fork()`: a forked
child (a DataLoader worker) loads a fresh copy of obstore's extension with a runtime of its own
(`shardkit.object_store_runtime`), and reads through fsspec only where no copy can be made (`usable_here`).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from shardkit.object_store_runtime import STORE_CLASSES, note_request, obstore_module, usable_here
from shardkit.redaction import redact_url

# URL scheme -> obstore's kind of store.
_KINDS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
          "http": "http", "https": "http"}
_OBSTORE_SCHEMES = {"s3a": "s3", "gcs": "gs"}  # the spellings obstore's from_url knows
CLIENT_VARIABLE = "SHARDKIT_STORAGE_CLIENT"
# obstore wherever it is installed (issue 47): signed requests without botocore, about twice s3fs's samples/s
# with 0 or 2 workers and a client set up in ~11 ms (benchmarks/RESULTS.md); SHARDKIT_STORAGE_CLIENT=fsspec opts out.
DEFAULT_CLIENT = "obstore"
# fsspec's caching knobs: they mean nothing to a client without listings caches.
_FSSPEC_ONLY = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions", "asynchronous",
                "loop"}
# fsspec option -> obstore config key, per kind.
_S3_KEYS = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
            "endpoint_url": "endpoint", "region": "region", "requester_pays": "request_payer"}
_GCS_KEYS = {"endpoint_url": "base_url"}
_AZURE_KEYS = {"account_name": "account_name", "account_key": "account_key", "sas_token": "sas_key",
               "tenant_id": "tenant_id", "client_id": "client_id", "client_secret": "client_secret"}
# Objects up to this size are put in one request; larger ones as a multipart upload of their pieces.
_SINGLE_PUT = 64 * 2**20


def obstore_installed() -> bool:
    return importlib.util.find_spec("obstore") is not None


def object_store_for(url: str, storage_options: dict[str, Any]) -> ObjectStoreObjects | None:
    """The obstore backend of `url`, or None where fsspec serves it (see the module's docstring)."""
    scheme, _, rest = url.partition("://")
    kind = _KINDS.get(scheme.lower()) if rest else None
    if kind is None or os.environ.get(CLIENT_VARIABLE, DEFAULT_CLIENT).lower() != "obstore" or not usable_here():
        return None
    authority = rest.split("/", 1)[0]
    if not authority or "@" in authority or not obstore_installed():
        return None
    config = store_config(kind, url, storage_options)
    if config is None:
        return None
    scheme = _OBSTORE_SCHEMES.get(scheme.lower(), scheme.lower())
    return ObjectStoreObjects(f"{scheme}://{authority}", rest.partition("/")[2].strip("/"), kind, config)


def store_config(kind: str, url: str, storage_options: dict[str, Any]) -> dict[str, Any] | None:
    """obstore's `config`, `client_options` and credential provider for `storage_options` (fsspec's keys), or
    None when an option has no obstore meaning (the fsspec fallback keeps it)."""
    options = {k: v for k, v in storage_options.items() if k not in _FSSPEC_ONLY}
    config: dict[str, Any] = {}
    retries, client_options, check_etags = 0, {}, True
    if kind == "s3":
        botocore_config = _botocore_config(options.pop("config_kwargs", None) or {})
        if botocore_config is None:
            return None
        retries, client_options, check_etags = botocore_config
        client_kwargs = dict(options.pop("client_kwargs", None) or {})
        if "region_name" in client_kwargs:
            options.setdefault("region", client_kwargs.pop("region_name"))
        if "endpoint_url" in client_kwargs:
            options.setdefault("endpoint_url", client_kwargs.pop("endpoint_url"))
        if client_kwargs:
            return None
    if options.pop("anon", False):
        config["skip_signature"] = True
    profile = options.pop("profile", None) if kind == "s3" else None
    names = {"s3": _S3_KEYS, "gcs": _GCS_KEYS, "azure": _AZURE_KEYS, "http": {}}[kind]
    if kind == "gcs" and "token" in options:
        token = _gcs_token(options.pop("token"))
        if token is None:
            return None
        config.update(token)
    if any(key not in names for key in options):
        return None
    config.update({names[key]: value for key, value in options.items() if value is not None})
    provider = None
    if kind == "s3":
        endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            config["endpoint"] = endpoint
        provider = _s3_credentials(config, profile)
    endpoint = config.get("endpoint") or config.get("base_url") or url
    client_options["allow_http"] = str(endpoint).lower().startswith("http://")
    return {"config": config, "provider": provider, "client_options": client_options, "retries": retries,
            "check_etags": check_etags}


def _botocore_config(config_kwargs: dict[str, Any]) -> tuple[int, dict[str, str], bool] | None:
    """(obstore's max_retries, client options, whether whole reads are checked against their ETag) meaning what
    botocore's `config_kwargs` say, or None for a setting without an obstore meaning. A user's own retries stay,
    under shardkit's, as on the fsspec path. `response_checksum_validation="when_required"` turns botocore's
    check of a GET's body off (no GET requires it), and so the ETag check that stands for it here: a damaged
    body then reaches shardkit's own checks (the shard's SHA-256), on both paths alike."""
    retries, client_options, check_etags = 0, {}, True
    for key, value in config_kwargs.items():
        if key == "retries" and isinstance(value, dict):
            if "total_max_attempts" in value:
                retries = max(0, int(value["total_max_attempts"]) - 1)
            elif "max_attempts" in value:
                retries = max(0, int(value["max_attempts"]))
        elif key in ("connect_timeout", "read_timeout"):
            client_options["connect_timeout" if key == "connect_timeout" else "timeout"] = f"{value}s"
        elif key == "response_checksum_validation":
            check_etags = value != "when_required"
        elif key != "request_checksum_calculation":
            return None
    return retries, client_options, check_etags


def _gcs_token(token: Any) -> dict[str, Any] | None:
    if token == "anon":
        return {"skip_signature": True}
    if isinstance(token, dict):
        return {"service_account_key": json.dumps(token)}
    if isinstance(token, str) and os.path.isfile(token):
        return {"service_account_path": token}
    return None  # "google_default", "cloud", a credentials object: gcsfs's own ways


def _s3_credentials(config: dict[str, Any], profile: str | None) -> BotocoreCredentials | None:
    """Keys given, or no signature: none needed. Else botocore's chain (the profile, shared files, SSO, instance
    roles: what s3fs would find) when botocore is installed, and obstore's own (environment, instance roles)
    when it is not; a named profile then needs botocore."""
    if "access_key_id" in config or config.get("skip_signature"):
        return None
    if profile is None and os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return None  # obstore reads them (and AWS_SESSION_TOKEN) itself, without importing botocore
    if importlib.util.find_spec("botocore") is None:
        if profile is not None or os.environ.get("AWS_PROFILE"):
            from shardkit.errors import MissingExtraError

            raise MissingExtraError(f"the AWS profile {profile or os.environ['AWS_PROFILE']!r}", "botocore", "s3")
        return None
    return BotocoreCredentials(profile)


class BotocoreCredentials:
    """obstore's credential provider of an S3 store, from botocore's chain: refreshed credentials (SSO, assumed
    roles) are asked again at each call. Picklable: a worker process resolves its own."""

    def __init__(self, profile: str | None):
        self.profile = profile
        self._credentials = None

    def __getstate__(self) -> dict[str, Any]:
        return {"profile": self.profile, "_credentials": None}

    def region(self) -> str | None:
        return self._session().get_config_variable("region")

    def _session(self):
        import botocore.session

        return botocore.session.Session(profile=self.profile)

    def __call__(self) -> dict[str, Any]:
        import datetime

        if self._credentials is None:
            self._credentials = self._session().get_credentials()
            if self._credentials is None:
                raise PermissionError(f"no AWS credentials found (profile {self.profile or 'default'}): set "
                                      "key/secret in storage_options, AWS_ACCESS_KEY_ID, a profile, or anon=True")
        frozen = self._credentials.get_frozen_credentials()
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=10)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}


# One store built at a time: a fresh process's first requests come from several threads at once (the node cache
# GETs the manifest, its binary index and its block indexes together), and each built a store of its own: two or
# three builds of 6-33 ms each, contending for the GIL, before the first request could leave (traced on moto).
_STORE_BUILD = threading.Lock()


def _new_build_lock() -> None:
    """In a forked child: a lock of its own (the parent's may have been held by a thread that does not exist here)."""
    global _STORE_BUILD
    _STORE_BUILD = threading.Lock()


os.register_at_fork(after_in_child=_new_build_lock)


class ObjectStoreObjects:
    """The objects of one bucket (container, host) through obstore, by key; `storage.Storage` names, validates
    and retries. Pickles as its URL and options: the store is built again where it is unpickled."""

    is_local = False

    def __init__(self, root_url: str, prefix: str, kind: str, settings: dict[str, Any]):
        self.root_url, self.prefix, self.kind, self.settings = root_url, prefix, kind, settings
        self._store = self._store_module = None
        self._etags_are_md5: bool | None = None  # unknown until one matches or one mismatch repeats
        self._mismatches: dict[str, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "_store_module": None}

    @property
    def store(self):
        """obstore's store, made with the extension this process can run (`object_store_runtime`): a store
        inherited through fork() from a parent whose runtime started is made again."""
        module = obstore_module()
        if self._store is None or self._store_module is not module:
            with _STORE_BUILD:  # the threads that asked at once wait for one build
                if self._store is None or self._store_module is not module:
                    self._build(module)
        return self._store

    def _build(self, module) -> None:
        """Build the store with `module` (the caller holds `_STORE_BUILD`)."""
        config = dict(self.settings["config"])
        provider = self.settings["provider"]
        if self.kind == "s3" and "region" not in config and not os.environ.get("AWS_REGION") \
                and not os.environ.get("AWS_DEFAULT_REGION"):
            config["region"] = (provider.region() if provider is not None else None) \
                or bucket_region(self.root_url, config.get("endpoint")) or "us-east-1"
        extra = {"credential_provider": provider} if provider is not None else {}
        if self.kind != "http":  # a web server takes no configuration
            extra["config"] = config or None
        store_class = getattr(module._store, STORE_CLASSES[self.kind])
        self._store = store_class.from_url(self.root_url, client_options=self.settings["client_options"],
                                           retry_config={"max_retries": self.settings["retries"]}, **extra)
        self._store_module = module

    def _run(self, operation, *args, **kwargs):
        """`operation(obstore, store, *args, **kwargs)`, obstore's errors as the OSError family."""
        try:
            store = self.store
            note_request(self.kind)
            return operation(self._store_module, store, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - every obstore error becomes the OSError family
            raise as_os_error(err, self.kind) from err

    # -- the backend's operations (paths are keys in the bucket) ------------------------------------
    def exists(self, path: str) -> bool:
        try:
            self.head(path)
        except FileNotFoundError:
            return False
        return True

    def head(self, path: str) -> dict[str, Any]:
        return self._run(lambda obstore, store: obstore.head(store, path))

    def size(self, path: str) -> int:
        return int(self.head(path)["size"])

    def identity(self, path: str) -> str:
        return identity_of(self.head(path))

    def read(self, path: str, size: int | None = None) -> bytes:
        """The whole object, checked against its size and its ETag, as botocore checks s3fs's whole-object reads
        against their checksum (a damaged body is read again here, not handed to the caller)."""
        def get(obstore, store):
            result = obstore.get(store, path)
            return bytes(result.bytes()), result.meta
        data, meta = self._run(get)
        if size is not None and len(data) != size:
            raise ShortReadError(f"{len(data)} bytes arrived of the {size} the object holds")
        if self.settings.get("check_etags", True):
            self._check_etag(path, data, str(meta.get("e_tag") or ""))
        return data

    def _check_etag(self, path: str, data: bytes, etag: str) -> None:
        """A single-part upload's ETag is its MD5 on S3, GCS's XML API and Azure (Content-MD5) alike, except under
        SSE-KMS: a mismatch is read again (`BodyMismatchError` is transient), and one that a second read repeats
        exactly means an ETag that is no MD5, accepted from then on."""
        tag = etag.strip('"').lower()
        if self._etags_are_md5 is False or not _MD5.fullmatch(tag):
            return
        digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
        if digest == tag:
            self._etags_are_md5 = True
            return
        if self._etags_are_md5 is None and self._mismatches.get(path) == digest:
            self._etags_are_md5 = False  # the same bytes twice: the store's ETags are not MD5s
            return
        self._mismatches[path] = digest
        raise BodyMismatchError(f"the bytes that arrived do not match the object's ETag {etag}")

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end), fewer at the end of the object, none past it (as fsspec answers)."""
        if end <= start:
            return b""
        try:
            return bytes(self._run(lambda obstore, store: obstore.get_range(store, path, start=start, end=end)))
        except OSError as err:
            if getattr(err, "status", None) != 416:
                raise
            return b""  # the range starts at or past the object's end

    def list(self, root: str) -> list[str]:
        prefix = f"{root.rstrip('/')}/" if root else None
        if self.kind == "http":  # obstore lists over WebDAV only; fsspec reads a web server's index pages
            import fsspec

            found = fsspec.filesystem("http").find(f"{self.root_url}/{prefix or ''}")
            return [url.removeprefix(f"{self.root_url}/") for url in found]
        # The listing arrives page by page as it is iterated: inside `_run`, so that a broken page is an OSError.
        return self._run(lambda obstore, store: [meta["path"] for chunk in obstore.list(store, prefix=prefix)
                                                 for meta in chunk])

    def download(self, path: str, local_path: str) -> None:
        self.download_with_identity(path, local_path)

    def download_with_identity(self, path: str, local_path: str, asked: str | None = None) -> str:
        """Copy the object to `local_path`; returns its identity (as `identity`) from the GET's own answer: the
        identity of exactly the bytes written, with no HEAD before them (so an identity `asked` before is not
        needed)."""
        def stream(obstore, store):
            result = obstore.get(store, path)
            count = 0
            with open(local_path, "wb") as fh:
                for chunk in result:
                    fh.write(chunk)
                    count += len(chunk)
            if count != result.meta["size"]:
                raise ShortReadError(f"{count} bytes arrived of the {result.meta['size']} the object holds")
            return identity_of(result.meta)
        return self._run(stream)

    def write(self, path: str, pieces: Sequence[bytes | memoryview]) -> None:
        total = sum(memoryview(piece).nbytes for piece in pieces)
        if total <= _SINGLE_PUT:  # one request; a multipart upload of a small object costs three
            self._run(lambda obstore, store: obstore.put(store, path, b"".join(pieces), use_multipart=False))
        else:
            self._run(lambda obstore, store: obstore.put(store, path, list(pieces), use_multipart=True))

    def delete(self, path: str) -> None:
        self._run(lambda obstore, store: obstore.delete(store, path))

    def invalidate(self, path: str) -> None:
        """Nothing to forget: obstore keeps no listings cache."""


def identity_of(meta: dict[str, Any]) -> str:
    """What changes when an object is replaced, from obstore's metadata of it (a HEAD's or a GET's): its size and
    ETag, else its last-modified time."""
    return f"{meta['size']}:{meta.get('e_tag') or meta.get('last_modified') or ''}"


_BUCKET_REGIONS: dict[tuple[str, str], str | None] = {}  # (endpoint, bucket) -> region, once per process


def bucket_region(root_url: str, endpoint: str | None) -> str | None:
    """The region S3 names for the bucket of `root_url` (`s3://bucket`) in its answer to an unsigned HEAD of the
    bucket (`x-amz-bucket-region`, sent with a 200, 301 or 403 alike), as botocore's redirects find it for s3fs;
    None where the answer names none (the endpoint is no S3, or cannot be reached: signing for us-east-1 then
    fails with the store's own message)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    bucket = root_url.partition("://")[2]
    base = (endpoint or "https://s3.amazonaws.com").rstrip("/")
    if (base, bucket) not in _BUCKET_REGIONS:
        request = urllib.request.Request(f"{base}/{urllib.parse.quote(bucket)}", method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                region = answer.headers.get("x-amz-bucket-region")
        except urllib.error.HTTPError as err:
            region = err.headers.get("x-amz-bucket-region")
        except OSError:
            region = None
        _BUCKET_REGIONS[base, bucket] = region
    return _BUCKET_REGIONS[base, bucket]


class ShortReadError(ConnectionError):
    """Fewer bytes arrived than the object holds: the connection broke mid-body (transient: read again)."""


class BodyMismatchError(ConnectionError):
    """The body that arrived does not match the object's ETag: damaged in transit (transient: read again)."""


_MD5 = re.compile(r"[0-9a-f]{32}")


_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]+)</Code>")
# In obstore's "Debug source" part: the HTTP client's kind of failure, and the innermost OS message.
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_TRANSIENT_KINDS = {"Connect", "Request", "Timeout", "Interrupted", "Decode"}


def as_os_error(err: BaseException, kind: str) -> OSError:
    """`err` (an obstore error) as the builtin it means, in one line: FileNotFoundError, PermissionError,
    ConnectionError (the request or its answer broke: transient), or OSError with `status` (the HTTP answer,
    which `storage.is_transient` reads)."""
    text, full = _one_line(err), str(err)
    if isinstance(err, FileNotFoundError) or type(err).__name__ == "NotFoundError":
        missing = FileNotFoundError(errno.ENOENT, text)
        if kind == "s3" and "<Code>" not in full and "performing HEAD" not in full:
            # S3 answers every request but HEAD with an XML error code (NoSuchKey, NoSuchBucket, ...): none
            # means the endpoint is not an S3 API (a web server, a wrong port or path). `storage.http_answer`
            # adds it to the messages.
            missing.http_answer = " (HTTP 404 with no S3 error code: is endpoint_url an S3 API endpoint?)"
        return missing
    if isinstance(err, OSError) and not type(err).__module__.startswith("obstore"):
        return err
    if type(err).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
        return PermissionError(errno.EACCES, text)
    status = _STATUS.search(full)
    if status:
        failure = OSError(errno.EIO, text)
        failure.status = int(status.group(1))
        return failure
    http_kind = _HTTP_KIND.search(full)
    if http_kind and http_kind.group(1) in _TRANSIENT_KINDS:
        return (TimeoutError if http_kind.group(1) == "Timeout" else ConnectionError)(text)
    return OSError(errno.EIO, text)


def _one_line(err: BaseException) -> str:
    """The store's message without its XML body (the error code kept) or debug dump (the OS's message kept),
    at most 300 characters."""
    text = str(err)
    first = re.split(r"\s*<\?xml|\n", text, maxsplit=1)[0].rstrip(": ")
    if code := _CODE.search(text):
        first += f" ({code.group(1)})"
    if cause := _OS_MESSAGE.findall(text):
        first += f": {cause[-1]}"
    return redact_url(first[:300])
