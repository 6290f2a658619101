"""Reading back what another party may have written: strict JSON record decoding, the
process's tally of records refused, and a bounded restart for background loops.

Every record the daemon reads from etcd (members, step records, the restore decision, the
namespace log's ops and bases) may have been written by any member of the job, or by anyone
who can reach an etcd without auth: it is decoded by one strict decoder per record kind
(built from :func:`json_object` and the ``field_*`` helpers here), which raises
:class:`BadRecord` for anything it does not accept. The caller skips that record and calls
:meth:`RejectedRecords.reject`, which logs and counts it once (``mtcfs status``:
``rejected_records``; metric ``mtcfs_rejected_records_total``) and keeps the last few for
``mtcfs status``. A bad record never kills a thread, a watch, a mount or a restore
(docs/security.md, "What a job member can do").

Background loops (etcd watches, keepalives) run under :func:`supervise`, which restarts a
loop that raised (at most every 10 s while it keeps failing), logs each restart and notes it
in :data:`RESTARTS` (``mtcfs status``: ``restarted_loops``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mtcfs.untrusted")

#: Largest record body the decoders accept, in bytes (etcd's default request limit is
#: 1.5 MiB; the namespace's base snapshot is read in parts and is not one record).
MAX_RECORD_BYTES = 2 << 20
#: Largest integer a record may carry (int64).
INT64_MAX = (1 << 63) - 1


class BadRecord(ValueError):
    """A record read back does not parse as its kind (the message says why, in one line)."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def json_value(body: bytes | str, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Parse ``body`` as strict JSON: no NaN/Infinity, at most ``max_bytes``, no nesting
    deep enough to exhaust the stack.

    Raises:
        BadRecord: too large, not UTF-8, not JSON, or nested too deeply.
    """
    if len(body) > max_bytes:
        raise BadRecord(f"{len(body)} bytes, more than the {max_bytes} a record may have")
    try:
        return json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise BadRecord("JSON nested too deeply") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, bad UTF-8, a huge int
        raise BadRecord(f"not JSON: {exc}") from None


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
               float: "number", type(None): "null"}


def json_type(v: Any) -> str:
    """What a value from :func:`json_value` was in the JSON text (``object``, ``array``...)."""
    return _JSON_TYPES.get(type(v), type(v).__name__)


def json_object(body: bytes | str, max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """:func:`json_value` that must be an object.

    Raises:
        BadRecord: as :func:`json_value`, or the value is not a JSON object.
    """
    d = json_value(body, max_bytes)
    if not isinstance(d, dict):
        raise BadRecord(f"a JSON {json_type(d)}, not an object")
    return d


_MISSING: Any = object()


def _get(d: dict[str, Any], key: str, default: Any) -> Any:
    v = d.get(key, default)
    if v is _MISSING:
        raise BadRecord(f"{key} is missing")
    return v


def field_int(d: dict[str, Any], key: str, lo: int = 0, hi: int = INT64_MAX,
              default: Any = _MISSING) -> int:
    """``d[key]`` if it is a JSON integer in ``lo..hi`` (``default`` when absent, if given;
    a default is returned as given, unchecked).

    Raises:
        BadRecord: missing without a default, not an integer (booleans and numbers with a
            fraction are not), or out of range.
    """
    if key not in d and default is not _MISSING:
        return default  # type: ignore[no-any-return]
    v = _get(d, key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRecord(f"{key} is a JSON {json_type(v)}, not an integer")
    if not lo <= v <= hi:
        raise BadRecord(f"{key}={v} is outside {lo}..{hi}")
    return v


def field_float(d: dict[str, Any], key: str, lo: float = 0.0, hi: float = math.inf,
                default: Any = _MISSING) -> float:
    """``d[key]`` if it is a finite JSON number in ``lo..hi`` (integers accepted).

    Raises:
        BadRecord: missing without a default, not a number, not finite, or out of range.
    """
    if key not in d and default is not _MISSING:
        return default  # type: ignore[no-any-return]
    v = _get(d, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRecord(f"{key} is a JSON {json_type(v)}, not a number")
    try:
        f = float(v)
    except OverflowError:
        raise BadRecord(f"{key} is too large") from None
    if not math.isfinite(f) or not lo <= f <= hi:
        raise BadRecord(f"{key}={v} is outside {lo}..{hi}")
    return f


def field_str(d: dict[str, Any], key: str, max_len: int = 4096,
              default: Any = _MISSING) -> str:
    """``d[key]`` if it is a JSON string of at most ``max_len`` characters.

    Raises:
        BadRecord: missing without a default, not a string, or too long.
    """
    if key not in d and default is not _MISSING:
        return default  # type: ignore[no-any-return]
    v = _get(d, key, default)
    if not isinstance(v, str):
        raise BadRecord(f"{key} is a JSON {json_type(v)}, not a string")
    if len(v) > max_len:
        raise BadRecord(f"{key} has {len(v)} characters, more than {max_len}")
    return v


def field_int_list(d: dict[str, Any], key: str, lo: int = 0, hi: int = INT64_MAX,
                   max_items: int = 1 << 16, default: Any = _MISSING) -> list[int]:
    """``d[key]`` if it is a JSON array of at most ``max_items`` integers in ``lo..hi``.

    Raises:
        BadRecord: missing without a default, not an array, too long, or an item that is
            not an integer in range.
    """
    if key not in d and default is not _MISSING:
        return default  # type: ignore[no-any-return]
    v = _get(d, key, default)
    if not isinstance(v, list):
        raise BadRecord(f"{key} is a JSON {json_type(v)}, not an array")
    if len(v) > max_items:
        raise BadRecord(f"{key} has {len(v)} items, more than {max_items}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            raise BadRecord(f"{key} holds {x!r}, not an integer in {lo}..{hi}")
    return list(v)


def field_str_map(d: dict[str, Any], key: str, max_items: int = 64, max_len: int = 256,
                  default: Any = _MISSING) -> dict[str, str]:
    """``d[key]`` if it is a JSON object of at most ``max_items`` string values of at most
    ``max_len`` characters (JSON null is taken as an empty object).

    Raises:
        BadRecord: missing without a default, not an object, or a value not a short string.
    """
    if key not in d and default is not _MISSING:
        return default  # type: ignore[no-any-return]
    v = _get(d, key, default)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRecord(f"{key} is a JSON {json_type(v)}, not an object")
    if len(v) > max_items:
        raise BadRecord(f"{key} has {len(v)} entries, more than {max_items}")
    for k, x in v.items():
        if not isinstance(x, str) or len(k) > max_len or len(x) > max_len:
            raise BadRecord(f"{key}[{k[:40]!r}] is not a string of at most {max_len}")
    return dict(v)


class RejectedRecords:
    """The records this process refused, by kind: each refusal counted and logged once,
    the last :attr:`KEEP` kept for ``mtcfs status``. Thread-safe.

    A refusal is one (kind, key, reason): the same record read again and refused for the
    same reason (the step records are read every ~10 s, the member view again after each
    watch failure) is not counted again, so the count and the metric say how many bad
    records were seen, not how often they were read; a record rewritten and refused for
    another reason counts again (the namespace's reasons name the record's revision).
    """

    KEEP = 10
    #: Distinct (kind, key, reason) remembered (then forgotten, and counted again if seen).
    _SEEN_MAX = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[str, int] = {}
        self._last: deque[dict[str, Any]] = deque(maxlen=self.KEEP)
        self._seen: set[tuple[str, str, str]] = set()

    def reject(self, kind: str, key: bytes | str, why: str) -> None:
        """Count record ``key`` of ``kind`` (``member``, ``steps``, ``restore``,
        ``ns_op``...) as refused for ``why``, and log it, unless this very refusal was
        counted already."""
        k = key.decode(errors="replace") if isinstance(key, bytes) else key
        why = why.splitlines()[0][:300] if why else "bad record"
        with self._lock:
            if (kind, k, why) in self._seen:
                return
            if len(self._seen) >= self._SEEN_MAX:
                self._seen.clear()
            self._seen.add((kind, k, why))
            self._by_kind[kind] = self._by_kind.get(kind, 0) + 1
            self._last.append({"kind": kind, "key": k[:300], "why": why,
                               "at": round(time.time(), 3)})
        log.warning("etcd record %s (%s) refused, skipped: %s", k, kind, why)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._by_kind.values())

    def snapshot(self) -> dict[str, Any]:
        """``{"total": n, "by_kind": {kind: n}, "last": [{kind, key, why, at}, ...]}``."""
        with self._lock:
            return {"total": sum(self._by_kind.values()), "by_kind": dict(self._by_kind),
                    "last": list(self._last)}


#: This process's tally (one daemon per process; tests may make their own).
REJECTED = RejectedRecords()


class Restarts:
    """The background loops of this process that failed and were restarted
    (:func:`supervise`): how often, the last error and when. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, dict[str, Any]] = {}

    #: Loops remembered at most (a lock hold's loop is named by its key): the one restarted
    #: longest ago is forgotten first.
    KEEP = 64

    def note(self, name: str, exc: BaseException) -> None:
        """Count a restart of loop ``name`` after ``exc``."""
        with self._lock:
            if name not in self._by_name and len(self._by_name) >= self.KEEP:
                oldest = min(self._by_name, key=lambda k: self._by_name[k]["at"])
                del self._by_name[oldest]
            row = self._by_name.setdefault(name, {"restarts": 0})
            row["restarts"] += 1
            row["last_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] \
                if str(exc) else type(exc).__name__
            row["at"] = round(time.time(), 3)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{loop name: {"restarts": n, "last_error": "...", "at": unix time}}``."""
        with self._lock:
            return {k: dict(v) for k, v in self._by_name.items()}


#: This process's restarted loops (``mtcfs status``: ``restarted_loops``).
RESTARTS = Restarts()


def supervise(name: str, loop: Callable[[], None], stop: threading.Event, *,
              pause_s: float = 0.5, max_pause_s: float = 10.0,
              healthy_s: float = 60.0) -> None:
    """Run ``loop()`` until ``stop`` is set; when it raises (or returns while ``stop`` is
    not set), log the error, note it in :data:`RESTARTS` and run it again after ``pause_s``,
    doubling up to ``max_pause_s`` while it keeps failing; a run that lasted ``healthy_s``
    starts the pause over. So a loop is restarted at most every ``max_pause_s`` seconds,
    for as long as the process runs: never given up (a watch that gave up would leave the
    node wrong without a word). Meant as a thread's target.
    """
    pause = pause_s
    while not stop.is_set():
        started = time.monotonic()
        try:
            loop()
            if stop.is_set():
                return
            exc: BaseException = RuntimeError("returned")
        except Exception as e:  # noqa: BLE001 -- every failure restarts, bounded
            exc = e
        if time.monotonic() - started >= healthy_s:
            pause = pause_s
        RESTARTS.note(name, exc)
        log.warning("%s failed (%s: %s); restarting in %.1f s", name, type(exc).__name__,
                    exc, pause)
        if stop.wait(pause):
            return
        pause = min(pause * 2, max_pause_s)
