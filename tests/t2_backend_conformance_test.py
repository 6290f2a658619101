"""One conformance suite for the backup tier's object-store interface, run against every
implementation and wrapper of :class:`mtcfs.tiers.backup.backend.Backend`.

Each test body states a promise of the interface (its docstrings in backend.py) and runs,
unchanged, against:

==================  ==================================================================
``file``            FileBackend on a temporary directory
``gcs``             GCSBackend on the real gcp-storage-emulator (no mocks)
``retry-file``      RetryingBackend over FileBackend
``retry-gcs``       RetryingBackend over GCSBackend
``retry-flaky-file`` RetryingBackend over FlakyBackend (support/backends.py: a third of
                    the calls fail, before or after the work is done) over FileBackend
``retry-proxy-gcs`` RetryingBackend over GCSBackend through FlakyProxy (support/gcs.py:
                    503s, resets and lost replies on the HTTP path of the real client)
==================  ==================================================================

A new backend joins by adding one entry to :data:`KINDS` (docs/conformance.md).
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from mtcfs.tiers.backup import (
    Backend, BackupError, FileBackend, GCSBackend, NotFound, RetryingBackend, RetryPolicy,
    TransientError,
)
from support.backends import FlakyBackend
from support.gcs import FlakyProxy, GcsEmulator

FAST = RetryPolicy(max_attempts=60, base_delay=0.001, max_delay=0.01)


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


# -- the implementations ---------------------------------------------------------------------

def _file(request: pytest.FixtureRequest, tmp_path) -> Backend:
    return FileBackend(tmp_path / "backup")


def _gcs(request: pytest.FixtureRequest, tmp_path, endpoint: str | None = None) -> Backend:
    emu: GcsEmulator = request.getfixturevalue("gcs_emulator")
    return GCSBackend(emu.bucket, f"conf/{uuid.uuid4().hex}", endpoint=endpoint or emu.url)


def _retry_proxy_gcs(request: pytest.FixtureRequest, tmp_path) -> Backend:
    emu: GcsEmulator = request.getfixturevalue("gcs_emulator")
    proxy = FlakyProxy(emu.url, fail_rate=0.15, reset_fraction=0.3, lost_fraction=0.3,
                       seed=7).start()
    request.addfinalizer(proxy.stop)
    return RetryingBackend(_gcs(request, tmp_path, proxy.url), FAST)


#: name -> factory(request, tmp_path) of an empty backend of that kind.
KINDS: dict[str, Callable[[pytest.FixtureRequest, object], Backend]] = {
    "file": _file,
    "gcs": _gcs,
    "retry-file": lambda r, t: RetryingBackend(_file(r, t), FAST),
    "retry-gcs": lambda r, t: RetryingBackend(_gcs(r, t), FAST),
    "retry-flaky-file": lambda r, t: RetryingBackend(FlakyBackend(_file(r, t), 0.3, seed=3),
                                                     FAST),
    "retry-proxy-gcs": _retry_proxy_gcs,
}


@pytest.fixture(params=sorted(KINDS))
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """An empty backend of each kind."""
    return KINDS[request.param](request, tmp_path)


# -- put, get, exists --------------------------------------------------------------------------

def test_get_returns_the_bytes_put(backend: Backend) -> None:
    data = bytes(range(256)) * 3
    backend.put("a/b/c", data)
    got = backend.get("a/b/c")
    assert type(got) is bytes and got == data
    assert backend.exists("a/b/c")


def test_put_replaces_with_longer_shorter_and_empty_objects(backend: Backend) -> None:
    backend.put("k", b"x" * 1000)
    backend.put("k", b"short")
    assert backend.get("k") == b"short"          # no tail of the old object
    backend.put("k", b"y" * 5000)
    assert backend.get("k") == b"y" * 5000
    backend.put("k", b"")
    assert backend.get("k") == b"" and backend.exists("k")
    assert list(backend.list("")) == ["k"]       # replaced, never duplicated


def test_same_put_twice_is_harmless(backend: Backend) -> None:
    backend.put("once/k", b"same")
    backend.put("once/k", b"same")
    assert backend.get("once/k") == b"same"
    assert list(backend.list("once/")) == ["once/k"]


def test_empty_object_is_an_object(backend: Backend) -> None:
    backend.put("e/empty", b"")
    assert backend.exists("e/empty")
    assert backend.get("e/empty") == b""
    assert list(backend.list("e/")) == ["e/empty"]


@pytest.mark.parametrize("size", [1, 64 * 1024 + 1, 9 * 1024 * 1024 + 7])
def test_objects_of_every_size_round_trip(backend: Backend, size: int) -> None:
    # 9 MiB is above the 8 MiB where GCS uploads switch from one request to a resumable one
    data = blob(size, size)
    backend.put(f"sized/{size}", data)
    assert backend.get(f"sized/{size}") == data


def test_missing_object_is_not_found(backend: Backend) -> None:
    with pytest.raises(NotFound):
        backend.get("never/put")
    assert not backend.exists("never/put")
    backend.put("here/k", b"1")
    with pytest.raises(NotFound):
        backend.get("here/other")
    with pytest.raises(NotFound):
        backend.get("here/k/below")               # below an object, not a directory
    assert not backend.exists("here/k/below")
    assert issubclass(NotFound, BackupError) and not issubclass(NotFound, TransientError)


def test_a_key_prefix_is_not_an_object(backend: Backend) -> None:
    backend.put("dir/sub/k", b"v")
    for prefix in ("dir", "dir/sub"):
        assert not backend.exists(prefix)
        with pytest.raises(NotFound):
            backend.get(prefix)
        backend.delete(prefix)                     # nothing stored under it: no error
    assert backend.get("dir/sub/k") == b"v"        # and the object below is untouched


def test_a_key_that_is_another_keys_directory_is_refused_or_kept_apart(
        backend: Backend) -> None:
    """A key may not name the directory of another key (``a`` and ``a/b``): object stores
    keep both, a file system cannot. The promise every backend keeps: the second put either
    works and both objects read back, or fails as a permanent :class:`BackupError` and the
    first object is intact. mtcfs's layout never makes such a pair (layout.py)."""
    backend.put("pair/a", b"file")
    try:
        backend.put("pair/a/b", b"below")
    except BackupError as exc:
        assert not isinstance(exc, (TransientError, NotFound))
        assert sorted(backend.list("pair/")) == ["pair/a"]
    else:
        assert backend.get("pair/a/b") == b"below"
        assert sorted(backend.list("pair/")) == ["pair/a", "pair/a/b"]
    assert backend.get("pair/a") == b"file"
    backend.put("pair2/a/b", b"below")
    try:
        backend.put("pair2/a", b"file")
    except BackupError as exc:
        assert not isinstance(exc, (TransientError, NotFound))
        assert not backend.exists("pair2/a")
    else:
        assert backend.get("pair2/a") == b"file"
    assert backend.get("pair2/a/b") == b"below"


# -- list ------------------------------------------------------------------------------------

def test_list_is_a_string_prefix_not_a_directory(backend: Backend) -> None:
    keys = ["steps/1/manifest", "steps/1/rank-0/complete", "steps/10/manifest",
            "steps/2/manifest", "steps1", "chunks/ab/ab01.zst", "top"]
    for k in keys:
        backend.put(k, k.encode())
    assert sorted(backend.list("")) == sorted(keys)
    assert sorted(backend.list("steps/1")) == ["steps/1/manifest", "steps/1/rank-0/complete",
                                               "steps/10/manifest"]
    assert sorted(backend.list("steps/1/")) == ["steps/1/manifest", "steps/1/rank-0/complete"]
    assert sorted(backend.list("steps")) == sorted(k for k in keys if k.startswith("steps"))
    assert sorted(backend.list("steps/1/rank-")) == ["steps/1/rank-0/complete"]
    assert list(backend.list("steps/1/manifest")) == ["steps/1/manifest"]
    assert sorted(backend.list("t")) == ["top"]
    assert list(backend.list("chunks/ab/ab01.zst/")) == []
    assert list(backend.list("nothing/")) == []
    assert list(backend.list("nothing/deeper/still")) == []


def test_list_of_an_empty_backend_is_empty(backend: Backend) -> None:
    assert list(backend.list("")) == []
    assert list(backend.list("chunks/")) == []


def test_long_listing_is_complete(backend: Backend) -> None:
    # more keys than one page of a small-paged listing, spread over fan-out directories
    keys = {f"many/{i % 7:02x}/k{i:04d}" for i in range(300)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: backend.put(k, b""), keys))
    listed = list(backend.list("many/"))
    assert len(listed) == len(set(listed)) == 300   # no key twice, none missing
    assert set(listed) == keys
    assert set(backend.list("many/03/")) == {k for k in keys if k.startswith("many/03/")}


def test_listing_reflects_deletes(backend: Backend) -> None:
    for k in ("d/x/1", "d/x/2", "d/y"):
        backend.put(k, b"1")
    backend.delete("d/x/1")
    backend.delete("d/x/2")                       # may prune d/x on a file system
    assert sorted(backend.list("d/")) == ["d/y"]
    backend.put("d/x/3", b"3")                    # and the directory comes back
    assert sorted(backend.list("d/")) == ["d/x/3", "d/y"]


# -- delete ----------------------------------------------------------------------------------

def test_delete_removes_and_missing_is_no_error(backend: Backend) -> None:
    backend.put("del/k", b"v")
    backend.put("del/k2", b"v2")
    backend.delete("del/k")
    assert not backend.exists("del/k")
    with pytest.raises(NotFound):
        backend.get("del/k")
    backend.delete("del/k")                       # again
    backend.delete("never/was/there")
    assert backend.get("del/k2") == b"v2"         # its neighbour is untouched
    backend.delete("del/k2")
    assert list(backend.list("")) == []


# -- keys ------------------------------------------------------------------------------------

BAD_KEYS = [
    "", "/abs", "trailing/", "a//b", "..", "../x", "a/../b", "a/./b", ".", "a/\n", "tab\tkey",
    "nul\x00", "del\x7f", "x" * 1025, "é" * 513,
    # found by this suite: FileBackend failed these with a permanent BackupError
    # (ENAMETOOLONG) or refused them, GCSBackend stored them; now every backend refuses
    "s" * 256, "a/" + "é" * 128, ".mtcfs-tmp-x", "d/.mtcfs-tmp-1",
]


@pytest.mark.parametrize("key", BAD_KEYS, ids=range(len(BAD_KEYS)))
def test_bad_keys_are_refused_by_every_operation(backend: Backend, key: str) -> None:
    backend.put("keep", b"1")
    for op in (lambda: backend.put(key, b"x"), lambda: backend.get(key),
               lambda: backend.exists(key), lambda: backend.delete(key)):
        with pytest.raises(ValueError):
            op()
    assert list(backend.list("")) == ["keep"]     # nothing was stored


@pytest.mark.parametrize("prefix", ["/abs", "a//", "../", "a/../", "x\n", "x" * 1025])
def test_bad_prefixes_are_refused(backend: Backend, prefix: str) -> None:
    with pytest.raises(ValueError):
        list(backend.list(prefix))


def test_unusual_but_valid_keys_round_trip(backend: Backend) -> None:
    keys = [
        "sp ace/and+plus", "per%25cent/%2F", "q?mark/h#sh", "uni/ü日本語", "quote/'\"",
        "star/*[x]", "back\\slash", "-dash/_u/~t", "dots/a.b.c/..x/x..", "@at/=eq/&amp",
    ]
    for k in keys:
        backend.put(k, k.encode())
    for k in keys:
        assert backend.get(k) == k.encode(), k
        assert backend.exists(k)
    assert sorted(backend.list("")) == sorted(keys)
    assert list(backend.list("uni/ü")) == ["uni/ü日本語"]
    for k in keys:
        backend.delete(k)
    assert list(backend.list("")) == []


def test_longest_keys_are_accepted(backend: Backend) -> None:
    # 1024 bytes of UTF-8 is the limit; every segment within NAME_MAX (255 bytes)
    long_ascii = "/".join(["s" * 200] * 5) + "/" + "t" * 19
    assert len(long_ascii.encode()) == 1024
    long_utf8 = "/".join(["é" * 127] * 4)          # 4 * 254 + 3 = 1019 bytes
    for k in (long_ascii, long_utf8):
        backend.put(k, b"long")
        assert backend.get(k) == b"long" and backend.exists(k)
        assert k in set(backend.list(k[:300]))
        backend.delete(k)
        assert not backend.exists(k)


# -- threads and description ---------------------------------------------------------------

def test_concurrent_calls_from_many_threads(backend: Backend) -> None:
    """Implementations are thread-safe: the daemon calls them from worker threads."""
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            mine = blob(i, 2000 + i)
            backend.put(f"t/{i}", mine)
            backend.put("t/shared", b"shared")
            assert backend.get(f"t/{i}") == mine
            assert backend.get("t/shared") == b"shared"
            assert backend.exists(f"t/{i}")
            backend.delete(f"t/{i}")
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert list(backend.list("t/")) == ["t/shared"]


def test_describe_is_one_line(backend: Backend) -> None:
    d = backend.describe()
    assert isinstance(d, str) and d and "\n" not in d
    assert d.startswith(("file://", "gs://", "flaky("))
    assert d in repr(backend)


def test_list_returns_an_iterator_of_str(backend: Backend) -> None:
    backend.put("it/k", b"")
    keys = backend.list("it/")
    assert isinstance(keys, Iterator)
    assert [type(k) for k in keys] == [str]
