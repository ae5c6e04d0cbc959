"""Off the training thread: one bounded queue and one worker thread per sink, retry with backoff,
and a spool on disk for what the sink cannot take.

    log() --submit()--> [bounded queue] --worker--> exporter.export()  (retried with backoff)
                             | full                     | still failing
                             v                          v
                           spool (JSONL on disk, 0600; ``otel-tracking replay`` delivers it later)

``submit()`` never blocks: a full queue spools the item (or, with no spool, drops and counts it).
After an item has used up its attempts the sink is *degraded*: new items go straight to the spool
(no waiting on a dead backend), and every ``probe_interval_s`` one item is tried again; one success
ends the degraded state.  At ``stop()`` the queue is drained until the deadline, with at most one
attempt per item; what is left is spooled.  Every outcome is counted in the sink's stats.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from otel_tracking.codec import DECODERS, ENCODERS

logger = logging.getLogger("otel_tracking")

_STOP = object()
_MERGEABLE = ("spans", "logs")  # consecutive items of these kinds go out in one export call
_MAX_MERGE = 512


@dataclass(frozen=True)
class Policy:
    queue_size: int = 2_000  # per sink; a 200-metric step is ~100 KB in memory: ~200 MB at most
    max_attempts: int = 4
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    probe_interval_s: float = 5.0


class Spool:
    """Append-only file of undelivered items, readable by its owner only.  The first record is a
    header saying which sink and run the items belong to, so that replay can rebuild the sink.

    One record a line: ``<crc32 of the JSON, 8 hex digits> <JSON>``.  A record cut short (a kill
    or a full disk in the middle of a write) or damaged is detected by :func:`read_spool`, which
    skips it and goes on with the next line."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._file: Any = None
        self._lock = threading.Lock()

    def write(self, kind: str, payload: Any) -> None:
        line = frame(json.dumps({"kind": kind, "data": ENCODERS[kind](payload)}, default=str))
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                # Shared while open: replay takes it exclusively and leaves a file in use alone.
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                self._file = os.fdopen(fd, "a", buffering=1)
                if self.path.stat().st_size == 0:
                    self._file.write(frame(json.dumps({"header": self.header})))
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def frame(text: str) -> str:
    """One spool record: its checksum, then the JSON text, on one line."""
    return f"{zlib.crc32(text.encode()):08x} {text}\n"


class Damaged(NamedTuple):
    """A spool record that could not be read: where, and why."""

    path: Path
    offset: int  # byte offset of the record's line
    reason: str


SpoolItem = tuple[str, Any]


def read_spool(path: Path) -> tuple[dict[str, Any], Iterator[SpoolItem | Damaged]]:
    """(header, records): the records one at a time as ``(kind, decoded payload)``, or
    :class:`Damaged` for one that is cut short, fails its checksum or does not decode.  Streams:
    the file is never loaded whole.  Lines without a checksum (files written before the framing)
    are read as plain JSON."""
    handle = open(path, "rb")  # noqa: SIM115 - closed by the generator
    first = handle.readline()
    header: dict[str, Any] = {}
    entry = _unframe(first)
    if isinstance(entry, dict) and "header" in entry:
        header = entry["header"]
    else:
        handle.seek(0)

    def records() -> Iterator[SpoolItem | Damaged]:
        with handle:
            offset = handle.tell()
            for line in iter(handle.readline, b""):
                at, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                entry = _unframe(line)
                if isinstance(entry, str):
                    yield Damaged(path, at, entry)
                    continue
                try:
                    yield entry["kind"], DECODERS[entry["kind"]](entry["data"])
                except Exception as error:  # a record that parses but does not decode
                    yield Damaged(path, at, f"undecodable {type(error).__name__}: {error}")

    return header, records()


def _unframe(line: bytes) -> dict[str, Any] | str:
    """The JSON object of one record, or why it cannot be read."""
    if not line.endswith(b"\n"):
        return "cut short (no end of line)"
    text = line[:-1].decode("utf-8", errors="replace")
    if text.startswith("{"):  # unframed: written before records had checksums
        body = text
    else:
        checksum, _, body = text.partition(" ")
        if len(checksum) != 8 or f"{zlib.crc32(body.encode()):08x}" != checksum:
            return "checksum mismatch"
    try:
        entry = json.loads(body)
    except ValueError as error:
        return f"not JSON ({error})"
    return entry if isinstance(entry, dict) else "not a record"


def wait_handled(items: queue.Queue[Any], timeout_s: float) -> bool:
    """Wait until every item put in ``items`` so far was marked done; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while items.unfinished_tasks:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def item_count(kind: str, payload: Any) -> int:
    """Items in one payload, as the counts see them: a log() call is one, spans and log records
    one each."""
    return len(payload) if kind in _MERGEABLE else 1


def set_aside(sink: str, spool: Spool | None, kind: str, payload: Any, count: Callable[[str, int], None]) -> None:
    """Keep what a sink cannot deliver now in its spool (counted ``spooled``); with no spool, or
    one that cannot be written, the items are lost and counted ``dropped``."""
    n = item_count(kind, payload)
    if spool is None:
        count("dropped", n)
        return
    try:
        spool.write(kind, payload)
        count("spooled", n)
    except Exception:
        logger.exception("otel-tracking: sink %r could not spool; data dropped", sink)
        count("dropped", n)


class Worker:
    """The queue and thread of one sink.  ``deliver(kind, payload) -> bool`` is the sink's guarded
    export call; ``count(field, n)`` updates the sink's stats; ``done(token)``, when given, hears
    of every submitted item that reached its end (delivered, spooled or dropped), by the token it
    was submitted with."""

    def __init__(
        self,
        name: str,
        deliver: Callable[[str, Any], bool],
        count: Callable[[str, int], None],
        spool: Spool | None,
        policy: Policy | None = None,
        done: Callable[[Any], None] | None = None,
    ) -> None:
        self.name = name
        self._deliver = deliver
        self._count = count
        self._done = done
        self.spool = spool
        self.policy = policy or Policy()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self.policy.queue_size)
        self._stopping = threading.Event()
        self._degraded_until = 0.0  # monotonic time of the next probe while degraded
        # The item being exported, and whether stop() gave it up (spooled it) while the export hung.
        self._state = threading.Lock()
        self._inflight: tuple[str, Any, list[Any]] | None = None
        self._given_up = False
        self._thread = threading.Thread(target=self._run, name=f"otel-tracking-{name}", daemon=True)
        self._thread.start()

    # --- the training thread's side --------------------------------------------------------------

    def submit(self, kind: str, payload: Any, token: Any = None) -> None:
        try:
            self._queue.put_nowait((kind, payload, token))
        except queue.Full:
            self._set_aside(kind, payload)
            self._report_done([token])

    # --- the worker's side -----------------------------------------------------------------------

    def _run(self) -> None:
        pending = None
        while True:
            item = pending if pending is not None else self._queue.get()
            pending = None
            if item is _STOP:
                self._queue.task_done()
                return
            kind, payload, token = item
            tokens = [token]
            if kind in _MERGEABLE:  # take the run of same-kind items behind it, up to _MAX_MERGE
                payload = list(payload)
                while len(tokens) < _MAX_MERGE:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _STOP or nxt[0] != kind:
                        pending = nxt
                        break
                    payload.extend(nxt[1])
                    tokens.append(nxt[2])
            with self._state:
                self._inflight = (kind, payload, tokens)
            self._handle(kind, payload)
            with self._state:
                self._inflight = None
                mine = not self._given_up
            if mine:
                self._report_done(tokens)
            for _ in tokens:
                self._queue.task_done()

    def _report_done(self, tokens: list[Any]) -> None:
        if self._done is not None:
            for token in tokens:
                self._done(token)

    def _handle(self, kind: str, payload: Any) -> None:
        try:
            self._attempt(kind, payload)
        except Exception:  # the worker must never die: count and go on
            logger.exception("otel-tracking: sink %r worker error", self.name)
            self._set_aside(kind, payload)

    def _attempt(self, kind: str, payload: Any) -> None:
        now = time.monotonic()
        if self._degraded_until and now < self._degraded_until:
            self._set_aside(kind, payload)
            return
        attempts = 1 if (self._stopping.is_set() or self._degraded_until) else self.policy.max_attempts
        delay = self.policy.backoff_s
        for attempt in range(attempts):
            delivered = self._deliver(kind, payload)
            with self._state:
                if self._given_up:  # stop() spooled this item while the export hung: not ours to count
                    return
                if delivered:
                    self._count("delivered", item_count(kind, payload))
            if delivered:
                self._degraded_until = 0.0
                return
            if attempt + 1 < attempts:
                self._count("retried", 1)
                if self._stopping.wait(delay):
                    break  # finishing: no more waiting on a failing backend
                delay = min(delay * 2, self.policy.backoff_max_s)
        self._degraded_until = time.monotonic() + self.policy.probe_interval_s
        with self._state:
            if not self._given_up:
                self._set_aside(kind, payload)

    def _set_aside(self, kind: str, payload: Any) -> None:
        set_aside(self.name, self.spool, kind, payload, self._count)

    # --- the end ---------------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far was handled; False on timeout."""
        return wait_handled(self._queue, timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Drain (one attempt per item) until the deadline; spool what is left; end the thread."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        self.flush(max(0.0, deadline - time.monotonic()))
        while True:  # past the deadline: whatever is still queued goes to the spool
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                kind, payload, token = item
                self._set_aside(kind, payload)
                self._report_done([token])
            self._queue.task_done()
        self._queue.put(_STOP)
        self._thread.join(max(0.1, deadline - time.monotonic()))
        with self._state:  # an export still hanging past the deadline: its item goes to the spool
            inflight, self._inflight = self._inflight, None
            self._given_up = self._thread.is_alive()
        if inflight is not None and self._given_up:
            kind, payload, tokens = inflight
            self._set_aside(kind, payload)
            self._report_done(tokens)
        if self.spool is not None:
            self.spool.close()
