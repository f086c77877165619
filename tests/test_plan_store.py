"""The persistent plan store (memsafe.plan_store): keys, entries on disk, their checks, writers in
several processes at once, the size bound, info and clear."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import plan_store
from memsafe.plan_store import Entry

SRC = str(Path(plan_store.__file__).resolve().parent.parent)


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store in a fresh directory (not created yet), with no warnings given before."""
    monkeypatch.delenv("MEMSAFE_CACHE_DIR", raising=False)
    monkeypatch.delenv("MEMSAFE_CACHE_MAX_BYTES", raising=False)
    monkeypatch.setattr(plan_store, "_chosen", plan_store._UNSET)
    monkeypatch.setattr(plan_store, "_warned", set())
    directory = tmp_path / "store"
    plan_store.set_cache_dir(directory)
    return directory


@pytest.fixture
def warnings(caplog):
    """The memsafe logger's warnings, as messages."""
    caplog.set_level(logging.WARNING, logger="memsafe")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _key(**components: str) -> str:
    return plan_store.key(**{"program": "p", "limit": "100", **components})


# -- where ----------------------------------------------------------------------------------------


def test_off_unless_a_directory_is_given(store, tmp_path, monkeypatch):
    k = _key()
    plan_store.set_cache_dir(None)
    assert plan_store.cache_dir() is None
    assert plan_store.save(k, b"x") is False and plan_store.load(k) is None
    assert "off" in str(plan_store.info()) and plan_store.clear() == 0
    monkeypatch.setenv("MEMSAFE_CACHE_DIR", str(tmp_path / "env"))
    assert plan_store.cache_dir() is None  # set_cache_dir(None) overrides the environment
    monkeypatch.setattr(plan_store, "_chosen", plan_store._UNSET)
    assert plan_store.cache_dir() == tmp_path / "env"
    monkeypatch.setenv("MEMSAFE_CACHE_DIR", "~/somewhere")
    assert plan_store.cache_dir() == Path.home() / "somewhere"
    monkeypatch.setenv("MEMSAFE_CACHE_DIR", "")
    assert plan_store.cache_dir() is None
    memsafe.set_cache_dir(tmp_path / "chosen")
    assert plan_store.cache_dir() == tmp_path / "chosen"
    assert "set_cache_dir" in memsafe.__all__


# -- hits and keys --------------------------------------------------------------------------------


def test_hit_returns_what_was_saved_and_a_save_replaces(store):
    k = _key()
    assert plan_store.load(k) is None
    assert plan_store.save(k, b"\x00plan\nbytes\xff", {"attempts": 3, "name": "knn"})
    assert plan_store.load(k) == Entry(b"\x00plan\nbytes\xff", {"attempts": 3, "name": "knn"})
    path = store / f"{k}.plan"
    assert path.is_file() and path.stat().st_mode & 0o077 == 0  # private to the user
    assert plan_store.save(k, b"newer")
    assert plan_store.load(k) == Entry(b"newer", {})
    assert [p.name for p in store.iterdir()] == [f"{k}.plan"]  # no temporary file left


def test_a_hit_marks_the_entry_recently_used(store):
    k = _key()
    plan_store.save(k, b"x")
    path = store / f"{k}.plan"
    os.utime(path, (1000, 1000))
    assert plan_store.load(k) is not None
    assert path.stat().st_mtime > time.time() - 60


def test_malformed_keys_and_components_are_errors(store):
    with pytest.raises(ValueError, match="not a key"):
        plan_store.load("../escape")
    with pytest.raises(ValueError, match="not a key"):
        plan_store.save("ABC", b"x")
    with pytest.raises(ValueError, match="not a key"):
        plan_store.load("a" * 64 + "\n")
    with pytest.raises(ValueError, match="environment parts"):
        plan_store.key(jax="0.0")
    with pytest.raises(TypeError, match="not str or bytes"):
        plan_store.key(limit=100)
    with pytest.raises(TypeError):
        plan_store.save(_key(), b"x", {"bad": object()})


def test_key_is_stable_and_covers_names_values_and_types():
    assert _key() == _key() and len(_key()) == 64
    assert plan_store.key(a="bc") != plan_store.key(ab="c")
    assert plan_store.key(a="x", b="") != plan_store.key(a="", b="x")
    assert plan_store.key(a="x") != plan_store.key(a=b"x")


ENVIRONMENT = tuple(plan_store.environment())


def test_environment_names_the_versions_the_backend_and_its_devices():
    env = plan_store.environment()
    assert env["jax"] == jax.__version__ and env["backend"] == jax.default_backend()
    assert env["device_count"] == str(jax.device_count())
    assert env["store_format"] == str(plan_store.FORMAT_VERSION)
    assert {"memsafe", "memsafe_source", "jaxlib", "device_kinds", "platform_version"} <= set(env)


@pytest.mark.parametrize("part", ENVIRONMENT)
def test_miss_on_every_environment_part(part, store, monkeypatch):
    k = _key()
    plan_store.save(k, b"x")
    env = plan_store.environment()
    monkeypatch.setattr(plan_store, "environment", lambda: {**env, part: env[part] + "-other"})
    other = _key()
    assert other != k and plan_store.load(other) is None


def _program(scale=2.0, const=(1.0, 2.0, 3.0), shape=(3,), dtype=jnp.float32):
    c = jnp.asarray(const, dtype)

    def f(x):
        return x * scale + c

    return jax.make_jaxpr(f)(jax.ShapeDtypeStruct(shape, dtype))


def _digest(closed=None, avals=None, in_shardings=None):
    closed = _program() if closed is None else closed
    avals = [jax.ShapeDtypeStruct((3,), jnp.float32)] if avals is None else avals
    return plan_store.program_digest(closed, avals, in_shardings)


def _mesh_sharding(*spec):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


VARIANTS = {
    "jaxpr text": lambda: _digest(_program(scale=3.0)),
    "constant contents": lambda: _digest(_program(const=(1.0, 2.0, 4.0))),
    "shape": lambda: _digest(avals=[jax.ShapeDtypeStruct((4,), jnp.float32)]),
    "dtype": lambda: _digest(avals=[jax.ShapeDtypeStruct((3,), jnp.float16)]),
    "weak type": lambda: _digest(avals=[jax.ShapeDtypeStruct((3,), jnp.float32, weak_type=True)]),
    "aval sharding": lambda: _digest(
        avals=[jax.ShapeDtypeStruct((3,), jnp.float32, sharding=_mesh_sharding("x"))]
    ),
    "in_shardings": lambda: _digest(in_shardings=[_mesh_sharding("x")]),
    "another sharding": lambda: _digest(in_shardings=[_mesh_sharding()]),
    "single-device sharding": lambda: _digest(
        in_shardings=[jax.sharding.SingleDeviceSharding(jax.devices()[0])]
    ),
}


def test_program_digest_is_by_content_not_identity():
    assert _digest() == _digest()  # two traces, two constant arrays with the same contents
    assert _digest(in_shardings=[_mesh_sharding("x")]) == _digest(
        in_shardings=[_mesh_sharding("x")]
    )


@pytest.mark.parametrize("part", [*VARIANTS, "limit", "compiler options"])
def test_miss_on_every_program_part(part, store):
    base = plan_store.key(program=_digest(), limit="1000", options='{"a": "1"}')
    plan_store.save(base, b"x")
    if part == "limit":
        other = plan_store.key(program=_digest(), limit="1001", options='{"a": "1"}')
    elif part == "compiler options":
        other = plan_store.key(program=_digest(), limit="1000", options='{"a": "2"}')
    else:
        other = plan_store.key(program=VARIANTS[part](), limit="1000", options='{"a": "1"}')
    assert other != base and plan_store.load(other) is None
    assert plan_store.load(base) is not None


def test_program_digest_sees_every_element_of_large_literals_and_constants():
    big = np.zeros(5000, np.float32)
    changed = big.copy()
    changed[2500] = 1.0
    a = jax.make_jaxpr(lambda x: x + big)(big)
    b = jax.make_jaxpr(lambda x: x + changed)(big)
    avals = [jax.ShapeDtypeStruct((5000,), jnp.float32)]
    assert plan_store.program_digest(a, avals) != plan_store.program_digest(b, avals)


def test_program_digest_reads_keys_and_refuses_what_it_cannot_read():
    k0, k1 = jax.random.key(0), jax.random.key(1)
    a = jax.make_jaxpr(lambda x: jax.random.normal(k0, (3,)) + x)(jnp.ones(3))
    b = jax.make_jaxpr(lambda x: jax.random.normal(k1, (3,)) + x)(jnp.ones(3))
    avals = [jax.ShapeDtypeStruct((3,), jnp.float32)]
    assert plan_store.program_digest(a, avals) != plan_store.program_digest(b, avals)
    keys = jax.ShapeDtypeStruct((2,), k0.dtype)
    c = jax.make_jaxpr(lambda k: jax.random.key_data(k))(keys)
    assert plan_store.program_digest(c, [keys]) == plan_store.program_digest(c, [keys])
    with pytest.raises(TypeError, match="closed-over"):
        plan_store._const_text(object())


def test_another_process_computes_the_same_key():
    """Nothing process-specific (an object's identity, an address) enters a key."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from memsafe import plan_store
        c = jnp.asarray((1.0, 2.0, 3.0), jnp.float32)
        closed = jax.make_jaxpr(lambda x: x * 2.0 + c)(jax.ShapeDtypeStruct((3,), jnp.float32))
        avals = [jax.ShapeDtypeStruct((3,), jnp.float32)]
        print(plan_store.key(program=plan_store.program_digest(closed, avals), limit="100"))
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC, "JAX_PLATFORMS": jax.default_backend()}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == plan_store.key(program=_digest(), limit="100")


# -- entries that are not to be trusted -----------------------------------------------------------


def _saved(store) -> tuple[str, Path, bytes]:
    k = _key()
    assert plan_store.save(k, b"payload " * 100, {"attempts": 12})
    path = store / f"{k}.plan"
    return k, path, path.read_bytes()


def _rejected(k, path, warnings, reason):
    assert plan_store.load(k) is None
    assert any(reason in w and str(path) in w for w in warnings()), warnings()
    assert not path.exists()  # removed


@pytest.mark.parametrize("where", ["magic", "format", "key", "meta", "payload line", "payload"])
def test_a_flipped_byte_anywhere_is_ignored_and_removed(where, store, warnings):
    k, path, data = _saved(store)
    lines = data.split(b"\n")
    line = {"magic": 0, "format": 1, "key": 2, "meta": 3, "payload line": 4, "payload": 5}[where]
    at = sum(len(x) + 1 for x in lines[:line]) + len(lines[line]) - 2
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
    _rejected(k, path, warnings, "")


@pytest.mark.parametrize("cut", [0, 10, 150, -100, -1])
def test_a_truncated_entry_is_ignored_and_removed(cut, store, warnings):
    k, path, data = _saved(store)
    path.write_bytes(data[:cut])
    _rejected(k, path, warnings, "truncated")


def test_an_overlong_entry_is_ignored(store, warnings):
    k, path, data = _saved(store)
    path.write_bytes(data + b"x")
    _rejected(k, path, warnings, "overlong")


def test_an_entry_copied_under_another_key_is_foreign(store, warnings):
    k, _, data = _saved(store)
    other = _key(limit="200")
    copy = store / f"{other}.plan"
    copy.write_bytes(data)
    _rejected(other, copy, warnings, "foreign")
    assert plan_store.load(k) is not None  # the original is sound


def test_another_format_version_is_ignored(store, warnings):
    k, path, data = _saved(store)
    path.write_bytes(data.replace(b"format 1\n", b"format 2\n", 1))
    _rejected(k, path, warnings, "another format")


def test_a_corrupt_entry_that_cannot_be_removed_is_still_ignored(store, warnings, monkeypatch):
    k, path, data = _saved(store)
    path.write_bytes(data[:-1])
    monkeypatch.setattr(plan_store, "_remove", lambda p: False)
    assert plan_store.load(k) is None and path.exists()
    assert any("truncated" in w for w in warnings())


def test_a_bad_entry_a_writer_replaced_meanwhile_is_left(store, monkeypatch):
    k, path, data = _saved(store)
    path.write_bytes(data[:-1])
    decode = plan_store._decode

    def racing(key, blob):  # another process saves between this read and the removal
        assert plan_store.save(k, b"fresh")
        return decode(key, blob)

    monkeypatch.setattr(plan_store, "_decode", racing)
    assert plan_store.load(k) is None
    monkeypatch.setattr(plan_store, "_decode", decode)
    assert plan_store.load(k) == Entry(b"fresh", {})


# -- directories that cannot be written -----------------------------------------------------------


def _writable(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` despite its mode (as root can)."""
    try:
        (directory / "probe").touch()
    except PermissionError:
        return False
    (directory / "probe").unlink()
    return True


@pytest.mark.parametrize("how", ["read-only directory", "under a regular file"])
def test_an_unwritable_directory_is_a_miss_with_one_warning(how, store, tmp_path, warnings):
    k = _key()
    if how == "read-only directory":
        assert plan_store.save(k, b"before")
        store.chmod(0o500)
        if _writable(store):
            store.chmod(0o700)
            pytest.skip("root writes to a read-only directory (see 'under a regular file')")
    else:
        (tmp_path / "file").write_text("not a directory")
        plan_store.set_cache_dir(tmp_path / "file" / "store")
    try:
        assert plan_store.save(_key(limit="1"), b"x") is False
        assert plan_store.save(_key(limit="2"), b"x") is False
        assert plan_store.load(_key(limit="1")) is None
        if how == "read-only directory":
            assert plan_store.load(k) == Entry(b"before", {})  # what is there still reads
    finally:
        if store.exists():
            store.chmod(0o700)
    writes = [w for w in warnings() if "writing" in w]
    assert len(writes) == 1 and "carrying on without the store" in writes[0], warnings()


def test_a_full_disk_is_a_miss_and_leaves_no_temporary_file(store, warnings, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert plan_store.save(_key(), b"x") is False
    assert list(store.iterdir()) == []
    assert any("No space left" in w for w in warnings())


# -- several processes at once --------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import logging, os, sys, time
    from memsafe import plan_store

    base, me = sys.argv[1], int(sys.argv[2])
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("memsafe").addHandler(Seen())
    logging.getLogger("memsafe").setLevel(logging.WARNING)
    shared, mine = "a" * 64, format(me, "064x")

    def payload(writer, i):
        return bytes([writer]) * (100_000 + 997 * i)

    open(os.path.join(base, f"ready-{me}"), "w").close()
    while not os.path.exists(os.path.join(base, "go")):
        time.sleep(0.005)
    for phase, bound in (("unbounded", ""), ("bounded", "600000")):
        os.environ["MEMSAFE_CACHE_MAX_BYTES"] = bound
        plan_store.set_cache_dir(os.path.join(base, phase))
        for i in range(15):
            assert plan_store.save(shared, payload(me, i), {"writer": me, "i": i})
            assert plan_store.save(mine, payload(me, i), {"writer": me, "i": i})
            for k in (shared, mine):
                entry = plan_store.load(k)
                if entry is None:
                    assert phase == "bounded"  # evicted by another writer
                    continue
                assert entry.payload == payload(entry.meta["writer"], entry.meta["i"])
                if k == mine:
                    assert entry.meta == {"writer": me, "i": i}
    assert not seen, seen
    print("done")
    """
)


def test_eight_processes_writing_at_once(store, tmp_path):
    """Eight writers save the same key and one key each, and read them back, at once, first in
    an unbounded directory, then in one whose bound evicts all the time: every read is a whole
    entry or a miss, nothing is logged, and afterwards every entry loads intact."""
    env = {**os.environ, "PYTHONPATH": SRC, "JAX_PLATFORMS": jax.default_backend()}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(me)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(8)
    ]
    try:
        deadline = time.time() + 300
        while len(list(tmp_path.glob("ready-*"))) < 8 and time.time() < deadline:
            assert all(w.poll() is None for w in writers), [w.communicate() for w in writers]
            time.sleep(0.05)
        (tmp_path / "go").touch()
        results = [w.communicate(timeout=300) for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    for w, (out, err) in zip(writers, results, strict=True):
        assert w.returncode == 0 and out.strip() == "done", err
    plan_store.set_cache_dir(tmp_path / "unbounded")
    keys = ["a" * 64, *(format(me, "064x") for me in range(8))]
    for k in keys:
        entry = plan_store.load(k)
        assert entry is not None
        assert entry.payload == bytes([entry.meta["writer"]]) * (100_000 + 997 * entry.meta["i"])
        assert entry.meta["i"] == 14
    for phase in ("unbounded", "bounded"):
        names = [p.name for p in (tmp_path / phase).iterdir()]
        assert all(n.endswith(".plan") and len(n) == 69 for n in names), names
    # the last eviction listed every write; a size it read may predate a replacement (one entry)
    assert plan_store.info(tmp_path / "bounded").total_bytes <= 600_000 + 120_000


# -- the size bound, info and clear ---------------------------------------------------------------


def _fill(store, n, size=1000):
    keys = [_key(limit=str(i)) for i in range(n)]
    for i, k in enumerate(keys):
        assert plan_store.save(k, bytes(size))
        os.utime(store / f"{k}.plan", (1000 + i, 1000 + i))  # saved in this order
    return keys


def test_the_size_bound_evicts_the_least_recently_used(store, monkeypatch):
    entry = len(plan_store._encode(_key(), bytes(1000), {}))
    monkeypatch.setenv("MEMSAFE_CACHE_MAX_BYTES", str(3 * entry + 10))
    a, b, c = _fill(store, 3)
    assert plan_store.load(a) is not None  # a is now the most recently used
    d = _key(limit="new")
    assert plan_store.save(d, bytes(1000))
    assert plan_store.load(b) is None  # the least recently used went
    assert all(plan_store.load(k) is not None for k in (a, c, d))
    assert plan_store.info().total_bytes == 3 * entry
    assert plan_store.info().max_bytes == 3 * entry + 10


def test_an_entry_over_the_bound_is_not_stored(store, monkeypatch, warnings):
    monkeypatch.setenv("MEMSAFE_CACHE_MAX_BYTES", "1KiB")
    (a,) = _fill(store, 1, size=100)
    assert plan_store.save(_key(limit="big"), bytes(2000)) is False
    assert plan_store.load(a) is not None  # nothing was evicted for it
    assert any("exceeds the bound" in w for w in warnings())


def test_the_bound_reads_sizes_and_ignores_malformed_values(monkeypatch, warnings):
    monkeypatch.setattr(plan_store, "_warned", set())
    monkeypatch.delenv("MEMSAFE_CACHE_MAX_BYTES", raising=False)
    assert plan_store.max_bytes() == plan_store.DEFAULT_MAX_BYTES == 1 << 30
    monkeypatch.setenv("MEMSAFE_CACHE_MAX_BYTES", "200MiB")
    assert plan_store.max_bytes() == 200 << 20
    monkeypatch.setenv("MEMSAFE_CACHE_MAX_BYTES", "12345")
    assert plan_store.max_bytes() == 12345
    monkeypatch.setenv("MEMSAFE_CACHE_MAX_BYTES", "lots")
    assert plan_store.max_bytes() == plan_store.DEFAULT_MAX_BYTES
    assert any("MEMSAFE_CACHE_MAX_BYTES" in w for w in warnings())


def test_eviction_removes_temporary_files_a_dead_writer_left(store):
    _fill(store, 1)
    stale, fresh = store / ".tmp-dead.plan", store / ".tmp-writing.plan"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - plan_store.STALE_TEMP_SECONDS - 10
    os.utime(stale, (old, old))
    plan_store.save(_key(limit="next"), b"x")
    assert not stale.exists() and fresh.exists()
    assert plan_store.info().entries == 2  # temporary files are not entries


def test_info_and_clear(store):
    assert plan_store.info() == plan_store.StoreInfo(store, False, 0, 0, 1 << 30)
    assert "not created yet" in str(plan_store.info())
    keys = _fill(store, 3)
    (store / "notes.txt").write_text("not the store's")
    (store / ".tmp-x.plan").write_bytes(b"partial")
    info = plan_store.info()
    sizes = sum((store / f"{k}.plan").stat().st_size for k in keys)
    assert (info.directory, info.exists, info.entries, info.total_bytes) == (store, True, 3, sizes)
    assert f"entries: 3\n  size: {memsafe.format_bytes(sizes)} of at most 1.0 GiB" in str(info)
    assert plan_store.clear() == 3
    assert sorted(p.name for p in store.iterdir()) == ["notes.txt"]
    assert plan_store.info().entries == 0 and plan_store.clear() == 0
    other = store.parent / "other"
    plan_store.set_cache_dir(other)
    keys = _fill(other, 2)
    plan_store.set_cache_dir(None)
    assert plan_store.info(other).entries == 2 and plan_store.clear(other) == 2
