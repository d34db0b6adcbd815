"""Filesystem access and the manifest-last commit protocol shared by shards, weights and checkpoints.

A directory is *committed* when its `_manifest.json` exists: the manifest is written after every file
it lists, and lists each file's size and sha256 plus a checksum of itself. Readers trust only what a
manifest lists and verify checksums, so a reader never sees a half-written directory, on a local disk
or on an object store (which has no atomic rename).

Object stores fail transiently (5xx, throttling, timeouts, connection resets). `get_fs` wraps every
non-local filesystem in `RetryingFileSystem`, which retries idempotent calls with exponential backoff
and full jitter inside a time budget, and raises `StorageUnavailable` (naming the operation, the path
and the budget) once the budget is spent. Settings that are not secret (endpoint, region, timeouts,
retry budget, retention, delta publication) are the process's own config slice (`StorageConfig`): each
process builds one `Storage` from it in its entry point, and every filesystem it opens carries them;
credentials never pass through here, only through the usual AWS environment variables or profiles that
botocore reads itself.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import random
import re
import stat
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from config.storage import StorageConfig

MANIFEST = "_manifest.json"
MANIFEST_CHECKSUM = "manifest_sha256"

log = logging.getLogger("rollflow.storage")


class CorruptError(IOError):
    """A committed file does not match its manifest (truncated, corrupted or missing)."""


class StorageUnavailable(IOError):
    """Storage kept failing transiently for longer than the retry budget."""


# ---------------------------------------------------------------------------------------------------
# Settings: `config.storage.StorageConfig`, carried by the filesystem objects a `Storage` hands out

DEFAULT_SETTINGS = StorageConfig()


def fs_settings(fs: Any) -> StorageConfig:
    """The settings a filesystem from `Storage.open`/`get_fs` carries; defaults for a bare fsspec one."""
    return getattr(fs, "settings", DEFAULT_SETTINGS)


def storage_options(protocol: str, s: StorageConfig) -> dict[str, Any]:
    """fsspec keyword arguments for `protocol`. For s3, botocore's and s3fs's own retries are switched
    off (s3fs's in `get_fs`) so that one layer, ours, owns backoff and the budget; timeouts bound a
    stalled request."""
    if protocol not in ("s3", "s3a"):
        return {}  # the settings describe the object store; local paths (configs, exports) need none
    client_kwargs: dict[str, Any] = {}
    # botocore would read AWS_ENDPOINT_URL itself; passing it makes it part of fsspec's instance cache key,
    # so a changed endpoint never reuses a client bound to the old one.
    endpoint = s.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    if s.region:
        client_kwargs["region_name"] = s.region
    config_kwargs = {
        "connect_timeout": s.timeout_s,
        "read_timeout": s.timeout_s,
        "retries": {"total_max_attempts": 1},
    }
    return {"client_kwargs": client_kwargs, "config_kwargs": config_kwargs, **s.options}


# ---------------------------------------------------------------------------------------------------
# Transient errors and retries

_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
}
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.EREMOTEIO}
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import botocore.exceptions as bex
        from botocore.parsers import ResponseParserError

        types += [bex.HTTPClientError, bex.ConnectionError, bex.IncompleteReadError, ResponseParserError]
    except ImportError:
        pass
    try:
        import aiohttp

        types.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(types)


def _client_error_is_transient(exc: BaseException) -> bool | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    code = str(response.get("Error", {}).get("Code", ""))
    return status >= 500 or status == 429 or code in _TRANSIENT_CODES or code.isdigit() and int(code) >= 500


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: 5xx/throttling answers, timeouts, refused or reset connections.
    Missing files, permissions and other 4xx answers are permanent. s3fs re-raises botocore errors as
    plain OSErrors, so the cause chain is inspected too."""
    if isinstance(exc, _PERMANENT):
        return False
    transient = _transient_types()
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 10:
        verdict = _client_error_is_transient(cur)
        if verdict is not None:
            return verdict
        if isinstance(cur, transient):
            return True
        if isinstance(cur, OSError) and cur.errno in _TRANSIENT_ERRNOS:
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


_USERINFO = re.compile(r"(://)[^/@\s]+@")


def _describe(exc: BaseException) -> str:
    """`Type: message`, with any `user:pass@` in URLs masked (messages may quote endpoint URLs)."""
    return _USERINFO.sub(r"\1***@", f"{type(exc).__name__}: {exc}")[:500]


def call_with_retry(fn: Callable[[], Any], what: str, s: StorageConfig, idempotent_rm: bool = False):
    """Run `fn`; retry transient failures with exponential backoff and full jitter until
    `retry_max_attempts` or `retry_budget_s` runs out, then raise `StorageUnavailable`."""
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except FileNotFoundError:
            if idempotent_rm and attempt > 1:
                return None  # an earlier attempt deleted it before its answer was lost
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            delay = random.uniform(0, min(s.retry_max_backoff_s, s.retry_base_s * 2 ** (attempt - 1)))
            if attempt >= s.retry_max_attempts or elapsed + delay > s.retry_budget_s:
                raise StorageUnavailable(
                    f"storage unavailable: {what} failed {attempt} time(s) over {elapsed:.1f}s, which exhausts "
                    f"the retry budget (storage.retry_budget_s={s.retry_budget_s}, "
                    f"storage.retry_max_attempts={s.retry_max_attempts}); last error: {_describe(exc)}. "
                    "Everything committed before this point is intact (readers trust only manifests); "
                    "restore storage access, then resume the run."
                ) from exc
            log.warning(f"storage: {what} failed ({_describe(exc)}); retry {attempt} in {delay:.2f}s")
            time.sleep(delay)


# Calls that are safe to repeat: reads, whole-object PUTs, deletes, listings.
_RETRIED = frozenset(
    {"cat_file", "pipe_file", "exists", "ls", "find", "glob", "info", "isdir", "isfile", "size", "du"}
    | {"makedirs", "mkdir", "rm", "rm_file", "cat", "put_file", "get_file"}
)


class RetryingFileSystem:
    """Wraps an fsspec filesystem together with this process's storage settings (`.settings`). On an
    object store the calls in `_RETRIED` go through `call_with_retry`; a local disk is not retried
    (its errors are not transient). Anything else passes straight through. `.fs` is the wrapped
    filesystem (e.g. for pyarrow)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, s: StorageConfig):
        self.fs = fs
        self.settings = s
        self._retry = not isinstance(fs, LocalFileSystem)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fs, name)
        if not self._retry or name not in _RETRIED or not callable(attr):
            return attr

        @functools.wraps(attr)
        def retried(*args, **kwargs):
            target = args[0] if args else kwargs.get("path", "")
            what = f"{name} {self.fs.unstrip_protocol(str(target)) if target else ''}".strip()
            return call_with_retry(
                lambda: attr(*args, **kwargs), what, self.settings, idempotent_rm=name in ("rm", "rm_file")
            )

        return retried

    def __repr__(self) -> str:
        return f"RetryingFileSystem({self.fs!r})"


def get_fs(url: str, s: StorageConfig = DEFAULT_SETTINGS) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) for a local path or URL with settings `s`, wrapped in `RetryingFileSystem`.
    A process uses its `Storage` object's `open`; this is the same without the reuse."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    fs, root = fsspec.core.url_to_fs(url, **storage_options(protocol, s))
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs retries some errors itself (a class attribute, not an option)
    return cast(fsspec.AbstractFileSystem, RetryingFileSystem(fs, s)), root.rstrip("/")


class Storage:
    """One per process, built in its entry point from its own config slice and passed down: the storage
    settings and the filesystems opened with them (one wrapper per fsspec instance)."""

    def __init__(self, settings: StorageConfig | None = None):
        self.settings = settings or DEFAULT_SETTINGS
        self._wrapped: dict[int, fsspec.AbstractFileSystem] = {}

    def open(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, root = get_fs(url, self.settings)
        inner = raw_fs(fs)
        return self._wrapped.setdefault(id(inner), fs), root


def raw_fs(fs: Any) -> fsspec.AbstractFileSystem:
    """The plain fsspec filesystem under a `RetryingFileSystem` (pyarrow wants a real one)."""
    return fs.fs if isinstance(fs, RetryingFileSystem) else fs


def is_local(fs: Any) -> bool:
    return isinstance(raw_fs(fs), LocalFileSystem)


# ---------------------------------------------------------------------------------------------------
# Paths, atomic writes, the commit protocol


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the entries of local `directory` (a rename into it, a folder made in it) durable across power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(directory: str, durable: bool) -> None:
    """makedirs, then (if `durable`) fsync the parent of every folder it made, so the new path survives a crash."""
    missing = []
    probe = directory
    while probe and not os.path.isdir(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(directory, exist_ok=True)
    if durable:
        for made in reversed(missing):
            fsync_dir(os.path.dirname(made) or ".")


def _fenced(fs: fsspec.AbstractFileSystem, path: str) -> None:
    from storage import fence  # imported late: fence reads leases through storage.runstate, which imports this

    fence.check(fs, path)


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Whole-or-nothing write: temp file + rename (+ fsync of both and of the folder) locally; a single PUT
    (atomic per object) elsewhere. Refused (`LeaseLost`) under a run directory whose lease this process lost."""
    parent, name = path.rsplit("/", 1)
    if not is_local(fs):
        _fenced(fs, path)
        fs.pipe_file(path, data)  # object stores have no directories to create
        return
    durable = fs_settings(fs).fsync  # durable across power loss; a process crash is covered by the rename
    _makedirs_durable(parent, durable)
    # A leading '.' keeps a crash's leftover out of Arrow dataset discovery (it skips '.' and '_').
    tmp = f"{parent}/.tmp-{uuid.uuid4().hex[:8]}-{name}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        _fenced(fs, path)
        os.replace(tmp, path)
        if durable:
            fsync_dir(parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def append_durable(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Append `data` to an existing local file (fsync'd when the storage is durable). A crash can leave part of
    it: readers of such a file take complete lines only. Refused (`LeaseLost`) like `write_bytes_atomic`."""
    _fenced(fs, path)
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        if fs_settings(fs).fsync:
            os.fsync(f.fileno())


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`write_bytes_atomic` of a local file outside any run directory (a cache, a data folder), by path."""
    fs, local = get_fs(str(path))
    write_bytes_atomic(fs, local, text.encode())


def _manifest_digest(manifest: dict) -> str:
    """The checksum of the manifest as a reader sees it: JSON turns integer keys (a step's `versions`) into
    strings, whose sorted order differs ("10" < "9"), so the digest is taken over that form."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}))
    return sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _legacy_digest(manifest: dict) -> str:
    """What writers before that fix recorded: integer keys sorted as numbers (digit-string keys read back)."""

    def ints(v: Any) -> Any:
        if isinstance(v, dict):
            return {(int(k) if isinstance(k, str) and k.isdigit() else k): ints(x) for k, x in v.items()}
        return [ints(x) for x in v] if isinstance(v, list) else v

    body = ints({k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM})
    try:
        return sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    except TypeError:  # digit and other keys in one table: no writer made that
        return ""


def commit_dir(
    fs: fsspec.AbstractFileSystem,
    directory: str,
    files: dict[str, bytes],
    meta: dict,
    digests: dict[str, str] | None = None,
    written: dict[str, dict] | None = None,
) -> dict:
    """Write `files` into `directory`, then the manifest that commits them. Returns the manifest.
    `written`: manifest entries ({"bytes", "sha256"}) of files others already wrote there (DCP shards).

    Rewriting a committed directory first removes its manifest, so no reader ever pairs the old
    manifest with new files. The manifest carries a checksum of its own content (`manifest_sha256`).
    `digests` are sha256s the caller already computed (hashing is the dearest part of a local commit).
    """
    manifest_path = join(directory, MANIFEST)
    _remove_if_present(fs, manifest_path)
    entries = dict(written or {})
    for name, data in files.items():
        write_bytes_atomic(fs, join(directory, name), data)
        entries[name] = {"bytes": len(data), "sha256": (digests or {}).get(name) or sha256(data)}
    manifest = {**meta, "files": entries}
    manifest[MANIFEST_CHECKSUM] = _manifest_digest(manifest)
    write_bytes_atomic(fs, manifest_path, json.dumps(manifest, indent=1).encode())
    return manifest


def _remove_if_present(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """One DELETE on an object store (deleting a missing key succeeds there), where exists()+rm() costs a
    HEAD, a LIST (s3fs looks for a "directory" after a 404) and a DELETE."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)
    fs.invalidate_cache(path.rsplit("/", 1)[0])


def is_committed(fs: fsspec.AbstractFileSystem, directory: str) -> bool:
    """Whether `directory` has a manifest. One GET of the (small) manifest: on an object store, exists()
    on a missing key costs a HEAD and a LIST, and pollers ask this many times."""
    fs.invalidate_cache(directory)  # object-store listings are cached; commits by other processes must show
    try:
        fs.cat_file(join(directory, MANIFEST))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def check_name(name: Any, where: str) -> str:
    """A file name read from a run directory (a manifest's `files` key), which whoever can write that directory
    chose: it must be a plain relative path that stays inside its directory (no absolute path, no `..`, `.` or
    empty part, no backslash or NUL), else `CorruptError` naming the name and `where` it was read."""
    if not isinstance(name, str) or not name:
        raise CorruptError(f"{where}: file name {name!r} is not a non-empty string")
    parts = name.split("/")
    bad = (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or any(p in ("", ".", "..") for p in parts)
        or re.match(r"^[A-Za-z]:", name) is not None  # a drive letter: absolute on Windows, a URL scheme elsewhere
    )
    if bad:
        raise CorruptError(
            f"{where}: file name {name!r} is not a relative path inside its directory (absolute, '..', '.', "
            "empty part, backslash or NUL); the manifest is corrupted or was written by someone else: not read"
        )
    return name


def local_path(base: str | os.PathLike[str], name: str, where: str) -> str:
    """Where file `name` (checked with `check_name`) of a manifest goes under local directory `base`;
    `CorruptError` if, symlinks resolved, that is not inside `base`."""
    check_name(name, where)
    root = os.path.realpath(base)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise CorruptError(f"{where}: file name {name!r} resolves to {path}, outside {root}; not read")
    return path


def not_private(path: str | os.PathLike[str]) -> str | None:
    """Why local directory `path` is not one only this user can use (a shared /tmp lets another user make it
    first), or None: it must be a real directory (not a symlink), owned by this user, closed to group and others."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory (a symlink?)"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & 0o077:
        return f"open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def read_manifest(fs: fsspec.AbstractFileSystem, directory: str) -> dict[str, Any]:
    """A committed directory's manifest; `CorruptError` (naming the path) when it is not valid JSON, fails its
    own checksum, or lists a file name that leaves the directory (`check_name`)."""
    path = join(directory, MANIFEST)
    try:
        manifest = json.loads(fs.cat_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptError(f"{path}: manifest is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptError(f"{path}: manifest has no 'files' table")
    expected = manifest.get(MANIFEST_CHECKSUM)
    # Manifests written before the self-checksum existed have none; those are trusted as before.
    if expected is not None and expected not in (_manifest_digest(manifest), _legacy_digest(manifest)):
        raise CorruptError(f"{path}: manifest checksum mismatch; the manifest was altered or corrupted")
    for name in manifest["files"]:
        check_name(name, path)
    return manifest


def read_verified(fs: fsspec.AbstractFileSystem, directory: str, name: str, manifest: dict) -> bytes:
    """Read one committed file and check it against its manifest entry."""
    where = join(directory, MANIFEST)
    path = join(directory, check_name(name, where))
    entry = manifest["files"].get(name)
    if entry is None:
        raise CorruptError(f"{path}: not listed in {where}")
    try:  # locally, a symlink in the directory must not lead the read outside it
        data = fs.cat_file(local_path(directory, name, where) if is_local(fs) else path)
    except FileNotFoundError as exc:
        raise CorruptError(f"{path}: listed in the manifest but missing") from exc
    if len(data) != entry["bytes"] or sha256(data) != entry["sha256"]:
        raise CorruptError(
            f"{path}: checksum mismatch ({len(data)} bytes, manifest says {entry['bytes']}); "
            "the file is truncated or corrupted"
        )
    return data


def committed_steps(fs: fsspec.AbstractFileSystem, parent: str, sub: str = "", key: str = "step") -> list[int]:
    """Steps `N` for which `parent/<key>=N/<sub>` is committed, ascending.

    One recursive listing (a single paged LIST on an object store) instead of a request per step."""
    fs.invalidate_cache(parent)
    try:
        paths = fs.find(parent)
    except FileNotFoundError:
        return []
    finally:
        fs.invalidate_cache()  # find() fills listing caches below `parent`; never answer from them later
    want = join(sub, MANIFEST) if sub else MANIFEST
    prefix = parent.rstrip("/") + "/"
    steps = set()
    for path in paths:
        rel = path[len(prefix) :] if path.startswith(prefix) else ""
        head, _, rest = rel.partition("/")
        n = step_number(head, parent, key)
        if n is not None and rest == want:
            steps.add(n)
    return sorted(steps)


def newest_committed_step(fs: fsspec.AbstractFileSystem, parent: str) -> int | None:
    """The newest committed `parent/step=N`, or None: one listing of `parent`, then a manifest read per folder
    from the newest down, usually one. A poller's cost stays flat as steps accumulate, where `committed_steps`
    lists every file of every step."""
    dirs = step_dirs(fs, parent)
    for n in sorted(dirs, reverse=True):
        if is_committed(fs, dirs[n]):
            return n
    return None


def step_dirs(fs: fsspec.AbstractFileSystem, parent: str) -> dict[int, str]:
    """Every `step=N` folder under `parent`, committed or not: N -> path."""
    fs.invalidate_cache(parent)
    if not fs.exists(parent):
        return {}
    out = {}
    for entry in fs.ls(parent, detail=False):
        if (n := step_number(entry.rstrip("/").rsplit("/", 1)[-1], parent)) is not None:
            out[n] = entry
    return out


_warned: set[str] = set()


def step_number(name: str, parent: str, key: str = "step") -> int | None:
    """N for a folder named `<key>=N`; None for any other name. A `<key>=` folder whose N is not a number
    (made by hand, or by another tool) is skipped with one warning per folder, never a crash."""
    if not name.startswith(f"{key}="):
        return None
    value = name[len(key) + 1 :]
    if value.isascii() and value.isdigit():
        return int(value)
    where = join(parent, name)
    if where not in _warned:
        _warned.add(where)
        log.warning(f"ignoring {where}: not a {key}=<number> folder rollflow wrote; move it out of {parent}")
    return None


def remove_committed(fs: fsspec.AbstractFileSystem, directory: str, manifests: list[str] | None = None) -> None:
    """Uncommit, then delete: the manifests go first (by default the directory's own), so a reader racing
    the removal sees an uncommitted directory, never a half-deleted committed one."""
    _fenced(fs, directory)
    for path in manifests if manifests is not None else [join(directory, MANIFEST)]:
        if fs.exists(path):
            fs.rm(path)
    fs.rm(directory, recursive=True)
    fs.invalidate_cache(directory)


def step_dir(parent: str, step: int) -> str:
    return join(parent, f"step={step:06d}")


# The flow passes a component its storage settings in this variable, for reading its config file only:
# the config may live on the object store those settings describe. Everything after reads the config's own slice.
CONFIG_STORAGE_ENV = "ROLLFLOW_STORAGE"


def read_json(url: str, s: StorageConfig | None = None) -> Any:
    """Read a JSON document from a local path or any fsspec URL (component configs travel this way);
    without `s`, with the settings in ROLLFLOW_STORAGE, else the defaults."""
    if s is None:
        raw = os.environ.get(CONFIG_STORAGE_ENV)
        s = StorageConfig.model_validate_json(raw) if raw else DEFAULT_SETTINGS
    fs, path = get_fs(url, s)
    return json.loads(fs.cat_file(path))


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    write_bytes_atomic(fs, path, (json.dumps(obj, indent=2) + "\n").encode())
