"""A persistent store on disk: bytes saved under a key, shared by every process on the machine.

It knows nothing of plans: a caller builds a :func:`key` from named components (every key also
carries :func:`environment`: memsafe's and jax's versions and memsafe's source, the backend, its
devices and their topology, the host processor on a CPU backend, ``XLA_FLAGS``, this store's
format), stores a payload and a JSON-able ``meta`` under it with
:func:`save`, and gets them back, in this process or another, with :func:`load`.

The store is off unless a directory is given: :func:`set_cache_dir` (which overrides) or the
environment variable ``MEMSAFE_CACHE_DIR``. Nothing is stored by default because what a caller
stores describes the user's program (its text, the digests of its constants), the same reason
JAX's own persistent compilation cache is opt-in.

Each entry is one file, ``<key>.plan``, written to a temporary file in the same directory,
flushed to disk and renamed over the entry (``os.replace``), so a reader sees a whole entry or
none however many processes write at once. A file names its format, repeats its key and carries
the length and SHA-256 of its contents: a corrupt, truncated, foreign (copied under another key)
or other-format file is ignored with a warning on the ``memsafe`` logger and removed. I/O
failures (a read-only or missing directory, a full disk) never reach the caller: the first of
each kind is logged, and the store carries on as a miss. The directory holds at most
:func:`max_bytes` (``MEMSAFE_CACHE_MAX_BYTES``, default :data:`DEFAULT_MAX_BYTES`) of entries:
after each save the least recently used (by modification time, which a hit refreshes) go first.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np

from memsafe import _jax, log
from memsafe.cache import _text
from memsafe.limits import format_bytes, parse_limit

#: The version of the file format below; part of every key, and checked in every file.
FORMAT_VERSION = 1
#: The first line of every entry.
MAGIC = b"memsafe plan store"
#: How many bytes of entries a directory holds when ``MEMSAFE_CACHE_MAX_BYTES`` is not set.
DEFAULT_MAX_BYTES = 1 << 30
#: Temporary files older than this (seconds) are left by a writer that died: removed on eviction.
STALE_TEMP_SECONDS = 3600.0

_SUFFIX = ".plan"
_TEMP_PREFIX = ".tmp-"
_KEY = re.compile(r"[0-9a-f]{64}")
_UNSET: Any = object()
#: The directory :func:`set_cache_dir` chose (None: off), or _UNSET to read the environment.
_chosen: Path | None = _UNSET
#: The I/O failures already logged, one warning per (directory, operation).
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Entry:
    """What :func:`load` found under a key.

    Attributes:
        payload: the bytes saved.
        meta: the JSON object saved with them.
    """

    payload: bytes
    meta: dict[str, Any]


@dataclass(frozen=True)
class StoreInfo:
    """What :func:`info` reports of a store's directory.

    Attributes:
        directory: the directory, or None when the store is off.
        exists: whether the directory exists.
        entries: how many entries it holds.
        total_bytes: their total size in bytes.
        max_bytes: the bound on that total.
    """

    directory: Path | None
    exists: bool
    entries: int
    total_bytes: int
    max_bytes: int

    def __str__(self) -> str:
        if self.directory is None:
            return "memsafe plan store: off (set MEMSAFE_CACHE_DIR or call memsafe.set_cache_dir)"
        where = "" if self.exists else " (not created yet)"
        return (
            f"memsafe plan store: {self.directory}{where}\n"
            f"  entries: {self.entries}\n"
            f"  size: {format_bytes(self.total_bytes)} of at most {format_bytes(self.max_bytes)}"
        )


# -- where ----------------------------------------------------------------------------------------


def set_cache_dir(path: str | os.PathLike[str] | None) -> None:
    """Keep memsafe's persistent store in ``path`` (created when first written), or turn it off
    with None. Overrides the environment variable ``MEMSAFE_CACHE_DIR`` for this process.

    Args:
        path: a directory (``~`` is expanded), or None to store nothing.

    Example:
        >>> memsafe.set_cache_dir("~/.cache/memsafe")
    """
    global _chosen
    _chosen = None if path is None else Path(os.fspath(path)).expanduser()


def cache_dir() -> Path | None:
    """The store's directory: the one :func:`set_cache_dir` chose, else ``MEMSAFE_CACHE_DIR``
    (``~`` expanded; empty means off), else None (off).

    Returns:
        The directory, or None when the store is off.
    """
    if _chosen is not _UNSET:
        return _chosen
    text = os.environ.get("MEMSAFE_CACHE_DIR", "")
    return Path(text).expanduser() if text else None


def max_bytes() -> int:
    """The bound on a directory's total size: ``MEMSAFE_CACHE_MAX_BYTES`` (bytes or a size such
    as ``"200MiB"``; a malformed value is logged and ignored), else :data:`DEFAULT_MAX_BYTES`.

    Returns:
        The bound in bytes.
    """
    text = os.environ.get("MEMSAFE_CACHE_MAX_BYTES", "")
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        return parse_limit(int(text) if text.isdigit() else text)
    except ValueError as err:
        _warn_once("MEMSAFE_CACHE_MAX_BYTES", "read", f"ignored ({err}); using the default")
        return DEFAULT_MAX_BYTES


# -- keys -----------------------------------------------------------------------------------------


@cache
def _source_digest() -> str:
    """A digest of memsafe's own source files (a development checkout changes them without
    changing the version number)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


#: The lines of /proc/cpuinfo that name a processor and its instruction set (x86 and Arm), not
#: those that differ from core to core or moment to moment (its clock, its ids).
_CPU_IDENTITY = (
    "vendor_id",
    "cpu family",
    "model",
    "model name",
    "flags",
    "CPU implementer",
    "CPU architecture",
    "CPU variant",
    "CPU part",
    "Features",
)


@cache
def _host_cpu() -> str:
    """A digest of the host processor's model and instruction-set features: a CPU backend's
    executables are machine code for them (one from a newer processor may not run on an older
    one). Read from /proc/cpuinfo's first processor where there is one, else from
    :mod:`platform`."""
    try:
        first = Path("/proc/cpuinfo").read_text().strip().split("\n\n")[0]
    except OSError:
        first = ""
    lines = []
    for line in first.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in _CPU_IDENTITY:
            lines.append(f"{name.strip()}:{value.strip()}")
    if not lines:
        lines = [platform.machine(), platform.processor(), platform.platform()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@cache
def _version() -> str:
    """memsafe's installed version (read from its metadata: memsafe's ``__init__`` imports
    this module)."""
    try:
        return importlib.metadata.version("memsafe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def environment() -> dict[str, str]:
    """What every key carries besides the caller's components (:func:`key` adds it).

    Returns:
        ``memsafe`` (its version), ``memsafe_source`` (a digest of its source files), ``jax``,
        ``jaxlib``, ``python`` (major.minor), ``backend`` (the default backend's platform),
        ``platform_version`` (its compiler and runtime, e.g. the CUDA version), ``device_kinds``
        (sorted, distinct), ``device_count``, ``process_count``, ``topology`` (JAX's
        fingerprint of the devices and their links, where the backend gives one),
        ``host_cpu`` (on the CPU backend, a digest of the processor's model and instruction set,
        which its executables are compiled for; else empty), ``xla_flags`` (``XLA_FLAGS``,
        which change what XLA compiles) and ``store_format``.
    """
    import jaxlib

    devices = jax.devices()
    try:
        platform_version = str(devices[0].client.platform_version)
    except AttributeError:  # not every client reports one
        platform_version = ""
    return {
        "memsafe": _version(),
        "memsafe_source": _source_digest(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": ".".join(platform.python_version_tuple()[:2]),
        "backend": jax.default_backend(),
        "platform_version": platform_version,
        "device_kinds": ",".join(sorted({d.device_kind for d in devices})),
        "device_count": str(jax.device_count()),
        "process_count": str(jax.process_count()),
        "topology": _jax.topology_fingerprint(),
        "host_cpu": _host_cpu() if jax.default_backend() == "cpu" else "",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "store_format": str(FORMAT_VERSION),
    }


def key(**components: str | bytes) -> str:
    """The key of an entry: a SHA-256 over the sorted names and values of ``components`` and of
    :func:`environment`, so an entry made under another memsafe, jax, backend or device is never
    found.

    Args:
        **components: what the entry depends on, e.g. ``program=program_digest(...)``,
            ``limit=str(limit)``, ``options=json.dumps(options, sort_keys=True)``.

    Returns:
        64 lowercase hex digits.

    Raises:
        ValueError: a component named like a part of :func:`environment`.
        TypeError: a component that is neither str nor bytes.
    """
    env = environment()
    clash = sorted(set(components) & set(env))
    if clash:
        raise ValueError(f"plan_store.key: {clash} are environment parts, set by key() itself")
    digest = hashlib.sha256()
    for name, value in sorted({**env, **components}.items()):
        if isinstance(value, str):
            data = b"s" + value.encode()
        elif isinstance(value, bytes):
            data = b"b" + value
        else:
            raise TypeError(f"plan_store.key: {name}={value!r} is not str or bytes")
        digest.update(b"%d:%s%d:" % (len(name), name.encode(), len(data)) + data)
    return digest.hexdigest()


def _sharding_text(sharding: Any) -> str:
    """A sharding as text that names its devices (a NamedSharding's repr shows only the mesh's
    axis sizes): a mesh's device ids in order, else the ids of the devices it uses."""
    if sharding is None:
        return "None"
    text = f"{type(sharding).__name__}:{sharding!r}"
    mesh = getattr(sharding, "mesh", None)
    ids = getattr(mesh, "device_ids", None)
    if ids is not None:
        return text + f" devices={np.asarray(ids).tolist()}"
    devices = getattr(sharding, "device_set", None)
    if devices is not None:
        text += f" devices={sorted(d.id for d in devices)}"
    return text


def _const_text(value: Any) -> str:
    """A closed-over constant by content: shape, dtype, weak type and a digest of its bytes."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(value))
        return f"key<{impl}>:" + _const_text(jax.random.key_data(value))
    try:
        array = np.asarray(value)
    except Exception as err:  # e.g. an array spread over other processes' devices
        raise TypeError(
            f"plan_store.program_digest: a closed-over {type(value).__name__} cannot be read "
            f"as an array ({err}); such a program cannot be keyed by content"
        ) from err
    if array.dtype == object:
        raise TypeError(f"plan_store.program_digest: a closed-over {type(value).__name__}")
    data = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
    weak = bool(getattr(value, "weak_type", False))
    return f"{array.shape}:{array.dtype}:{weak}:{data}"


def program_digest(
    closed: Any, avals: Sequence[Any], in_shardings: Sequence[Any] | None = None
) -> str:
    """A digest of a traced program that is the same in every process that traces it alike.

    It covers the jaxpr's text (NumPy printing every element of any array it shows), its
    closed-over constants by content (shape, dtype, weak type and bytes; JAX arrays are read to
    the host: an identity does not survive the process), and each argument's shape, dtype, weak
    type and sharding (an aval's ``sharding`` attribute, and ``in_shardings`` when given).

    Args:
        closed: a ClosedJaxpr.
        avals: its flat arguments (ShapeDtypeStructs or abstract values).
        in_shardings: the arguments' shardings, when they are not on the avals.

    Returns:
        64 lowercase hex digits, for a :func:`key` component.

    Raises:
        TypeError: a constant that cannot be read as an array (such as one spread over other
            processes' devices): the program cannot be keyed across processes.
    """
    digest = hashlib.sha256()

    def add(tag: str, text: str) -> None:
        data = text.encode()
        digest.update(b"%s %d:" % (tag.encode(), len(data)) + data)

    add("jaxpr", _text(closed))
    for value in closed.consts:
        add("const", _const_text(value))
    for aval in avals:
        shape = tuple(str(d) for d in aval.shape)
        weak = bool(getattr(aval, "weak_type", False))
        add("arg", f"{shape}:{aval.dtype}:{weak}")
        add("sharding", _sharding_text(getattr(aval, "sharding", None)))
    for sharding in in_shardings or ():
        add("in_sharding", _sharding_text(sharding))
    return digest.hexdigest()


# -- entries --------------------------------------------------------------------------------------


def _warn_once(where: str, operation: str, message: str) -> None:
    if (where, operation) in _warned:
        return
    _warned.add((where, operation))
    log.note(logging.WARNING, "memsafe plan store: %s %s: %s", operation, where, message)


def _checked_key(k: str) -> str:
    if not isinstance(k, str) or not _KEY.fullmatch(k):
        raise ValueError(f"plan_store: {k!r} is not a key (64 lowercase hex digits, from key())")
    return k


def _encode(k: str, payload: bytes, meta: Mapping[str, Any]) -> bytes:
    """An entry's bytes: five header lines, then the payload. The fifth line has the payload's
    length and a SHA-256 of the first four lines and the payload."""
    text = json.dumps(dict(meta), sort_keys=True, ensure_ascii=True, allow_nan=False)
    head = b"%s\nformat %d\nkey %s\nmeta %s\n" % (MAGIC, FORMAT_VERSION, k.encode(), text.encode())
    check = hashlib.sha256(head + payload).hexdigest()
    return head + b"payload %d %s\n" % (len(payload), check.encode()) + payload


def _decode(k: str, data: bytes) -> Entry | str:
    """The entry in ``data``, or why it is not one to trust."""
    lines = data.split(b"\n", 5)
    if len(lines) < 6 or lines[0] != MAGIC:
        return "not a memsafe plan store entry (or truncated)"
    if lines[1] != b"format %d" % FORMAT_VERSION:
        return f"written in another format ({lines[1][:40]!r}, this memsafe reads {FORMAT_VERSION})"
    if lines[2] != b"key " + k.encode():
        return "foreign: it was saved under another key"
    parts = lines[4].split(b" ")
    if len(parts) != 3 or parts[0] != b"payload" or not parts[1].isdigit():
        return "malformed payload line"
    payload = lines[5]
    if len(payload) != int(parts[1]):
        return f"truncated or overlong: {len(payload)} payload bytes, {int(parts[1])} expected"
    head = b"\n".join(lines[:4]) + b"\n"
    if hashlib.sha256(head + payload).hexdigest().encode() != parts[2]:
        return "corrupt: its checksum does not match"
    if not lines[3].startswith(b"meta "):
        return "malformed meta line"
    try:
        meta = json.loads(lines[3][5:])
    except ValueError:
        return "malformed meta"
    if not isinstance(meta, dict):
        return "malformed meta"
    return Entry(payload, meta)


def _path(directory: Path, k: str) -> Path:
    return directory / (k + _SUFFIX)


def load(k: str) -> Entry | None:
    """The entry saved under ``k`` in :func:`cache_dir`, or None: the store is off, there is
    none, it cannot be read, or it is not to be trusted (corrupt, truncated, foreign, another
    format: logged and removed). A hit marks the entry recently used.

    Args:
        k: a key from :func:`key`.

    Returns:
        The :class:`Entry`, or None.

    Raises:
        ValueError: ``k`` is not a key.
    """
    _checked_key(k)
    directory = cache_dir()
    if directory is None:
        return None
    path = _path(directory, k)
    try:
        with open(path, "rb") as file:
            data = file.read()
            stat = os.fstat(file.fileno())
    except FileNotFoundError:
        return None
    except OSError as err:
        _warn_once(str(directory), "reading", f"{err}; carrying on without the store")
        return None
    found = _decode(k, data)
    if isinstance(found, str):
        log.note(logging.WARNING, "memsafe plan store: ignored %s: %s", path, found)
        with contextlib.suppress(OSError):  # unless a writer has replaced it meanwhile
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (stat.st_dev, stat.st_ino):
                _remove(path)
        return None
    with contextlib.suppress(OSError):  # read-only, or evicted meanwhile: the hit stands
        os.utime(path)
    return found


def save(k: str, payload: bytes, meta: Mapping[str, Any] | None = None) -> bool:
    """Save ``payload`` and ``meta`` under ``k`` in :func:`cache_dir` (created if need be),
    replacing any entry there, then evict the least recently used entries past
    :func:`max_bytes`. Readers and writers in other processes see the old entry or the new one,
    never a part.

    Args:
        k: a key from :func:`key`.
        payload: the bytes to store.
        meta: a JSON-serializable dict saved with them (default empty).

    Returns:
        Whether the entry was written: False when the store is off, the entry alone exceeds the
        bound, or the directory cannot be written (logged once).

    Raises:
        ValueError: ``k`` is not a key, or ``meta`` holds a NaN or an infinity.
        TypeError: ``meta`` holds a value JSON cannot represent.
    """
    _checked_key(k)
    data = _encode(k, bytes(payload), meta or {})
    directory = cache_dir()
    if directory is None:
        return False
    bound = max_bytes()
    if len(data) > bound:
        log.note(
            logging.WARNING,
            "memsafe plan store: an entry of %s exceeds the bound %s: not stored",
            format_bytes(len(data)),
            format_bytes(bound),
        )
        return False
    temp: str | None = None
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=directory, prefix=_TEMP_PREFIX, suffix=_SUFFIX)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, _path(directory, k))
        temp = None
    except OSError as err:
        _warn_once(str(directory), "writing", f"{err}; carrying on without the store")
        return False
    finally:
        if temp is not None:
            _remove(temp)
    _evict(directory, bound, keep=k)
    return True


# -- the directory --------------------------------------------------------------------------------


def _remove(path: str | Path) -> bool:
    """Remove ``path``; whether it is gone (another process may have removed it first)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _entries(directory: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """The entries in ``directory`` with their stats, skipping files that vanish meanwhile."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.endswith(_SUFFIX) and _KEY.fullmatch(name[: -len(_SUFFIX)]):
            path = directory / name
            try:
                yield path, path.stat()
            except FileNotFoundError:
                continue


def _evict(directory: Path, bound: int, keep: str) -> None:
    """Remove the least recently used entries (but ``keep``) until the total is within
    ``bound``, and temporary files older than :data:`STALE_TEMP_SECONDS`."""
    try:
        now = time.time()
        for name in os.listdir(directory):
            if name.startswith(_TEMP_PREFIX):
                try:
                    if now - os.stat(directory / name).st_mtime > STALE_TEMP_SECONDS:
                        _remove(directory / name)
                except FileNotFoundError:
                    continue
        entries = sorted(_entries(directory), key=lambda e: (e[1].st_mtime, e[0].name))
    except OSError as err:
        _warn_once(str(directory), "evicting from", str(err))
        return
    total = sum(stat.st_size for _, stat in entries)
    for path, stat in entries:
        if total <= bound:
            break
        if path.name != keep + _SUFFIX and _remove(path):
            total -= stat.st_size


def info(directory: str | os.PathLike[str] | None = None) -> StoreInfo:
    """What the store holds.

    Args:
        directory: the directory to look at; default :func:`cache_dir`.

    Returns:
        A :class:`StoreInfo` (``str()`` of it is what ``memsafe cache info`` prints).

    Raises:
        OSError: the directory exists but cannot be listed.
    """
    where = cache_dir() if directory is None else Path(os.fspath(directory)).expanduser()
    if where is None:
        return StoreInfo(None, False, 0, 0, max_bytes())
    entries = list(_entries(where)) if where.is_dir() else []
    total = sum(stat.st_size for _, stat in entries)
    return StoreInfo(where, where.is_dir(), len(entries), total, max_bytes())


def clear(directory: str | os.PathLike[str] | None = None) -> int:
    """Remove every entry (and leftover temporary file) from the store.

    Args:
        directory: the directory to clear; default :func:`cache_dir`.

    Returns:
        How many entries were removed (those that cannot be are logged and left).

    Raises:
        OSError: the directory exists but cannot be listed.
    """
    where = cache_dir() if directory is None else Path(os.fspath(directory)).expanduser()
    if where is None or not where.is_dir():
        return 0
    removed = 0
    for path, _ in list(_entries(where)):
        if _remove(path):
            removed += 1
        else:
            _warn_once(str(where), "clearing", f"cannot remove {path.name}")
    with contextlib.suppress(OSError):
        for name in os.listdir(where):
            if name.startswith(_TEMP_PREFIX):
                _remove(where / name)
    return removed
