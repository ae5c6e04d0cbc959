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

A worker can start *held*, for a backend that is still opening: its queue keeps what comes (a full
queue spools, as always) and its thread waits; ``release()`` (opened) delivers it all in order,
``give_up()`` (failed, or nobody waits any more) spools it and everything after.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """Append-only JSONL of undelivered items, readable by its owner only.  The first line is a
    header saying which sink and run the items belong to, so that replay can rebuild the sink."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._file: Any = None
        self._lock = threading.Lock()

    def write(self, kind: str, payload: Any) -> None:
        line = json.dumps({"kind": kind, "data": ENCODERS[kind](payload)}, default=str) + "\n"
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._file = os.fdopen(fd, "a", buffering=1)
                if self.path.stat().st_size == 0:
                    self._file.write(json.dumps({"header": self.header}) + "\n")
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_spool(path: Path) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """(header, [(kind, decoded payload), ...]) of a spool file."""
    header: dict[str, Any] = {}
    items: list[tuple[str, Any]] = []
    with open(path) as f:
        for number, line in enumerate(f):
            if not line.strip():
                continue
            entry = json.loads(line)
            if number == 0 and "header" in entry:
                header = entry["header"]
                continue
            items.append((entry["kind"], DECODERS[entry["kind"]](entry["data"])))
    return header, items


def wait_handled(items: queue.Queue[Any], timeout_s: float) -> bool:
    """Wait until every item put in ``items`` so far was marked done; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while items.unfinished_tasks:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def set_aside(sink: str, spool: Spool | None, kind: str, payload: Any, count: Callable[[str, int], None]) -> None:
    """Keep what a sink cannot deliver now in its spool (counted ``spooled``); with no spool, or
    one that cannot be written, the items are lost and counted ``dropped``."""
    n = len(payload) if kind in _MERGEABLE else 1
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
    was submitted with.  ``held``: the backend is still opening (see :meth:`release`)."""

    def __init__(
        self,
        name: str,
        deliver: Callable[[str, Any], bool],
        count: Callable[[str, int], None],
        spool: Spool | None,
        policy: Policy | None = None,
        done: Callable[[Any], None] | None = None,
        held: bool = False,
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
        self._hold = threading.Lock()  # release() and give_up(): whichever comes first decides
        self._released = threading.Event()  # the thread may take items
        self._given_up = False  # the backend never opened: every item goes to the spool
        if not held:
            self._released.set()
        self._thread = threading.Thread(target=self._run, name=f"otel-tracking-{name}", daemon=True)
        self._thread.start()

    # --- a backend still opening -----------------------------------------------------------------

    @property
    def held(self) -> bool:
        return not self._released.is_set()

    def release(self) -> bool:
        """The backend opened: deliver what was held, in order, then everything after.  False if
        it was given up first."""
        with self._hold:
            if self._given_up:
                return False
            self._released.set()
            return True

    def give_up(self) -> bool:
        """The backend will not open: spool what was held and everything after.  False (and
        nothing changes) if it had opened."""
        with self._hold:
            if self._released.is_set() and not self._given_up:
                return False
            self._given_up = True
            self._released.set()
            return True

    # --- the training thread's side --------------------------------------------------------------

    def submit(self, kind: str, payload: Any, token: Any = None) -> None:
        try:
            self._queue.put_nowait((kind, payload, token))
        except queue.Full:
            self._set_aside(kind, payload)
            self._report_done([token])

    # --- the worker's side -----------------------------------------------------------------------

    def _run(self) -> None:
        self._released.wait()
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
            self._handle(kind, payload)
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
        if self._given_up or (self._degraded_until and now < self._degraded_until):
            self._set_aside(kind, payload)
            return
        attempts = 1 if (self._stopping.is_set() or self._degraded_until) else self.policy.max_attempts
        delay = self.policy.backoff_s
        for attempt in range(attempts):
            if self._deliver(kind, payload):
                self._degraded_until = 0.0
                return
            if attempt + 1 < attempts:
                self._count("retried", 1)
                if self._stopping.wait(delay):
                    break  # finishing: no more waiting on a failing backend
                delay = min(delay * 2, self.policy.backoff_max_s)
        self._degraded_until = time.monotonic() + self.policy.probe_interval_s
        self._set_aside(kind, payload)

    def _set_aside(self, kind: str, payload: Any) -> None:
        set_aside(self.name, self.spool, kind, payload, self._count)

    # --- the end ---------------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far was handled; False on timeout."""
        return wait_handled(self._queue, timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Drain (one attempt per item) until the deadline, a backend still opening included;
        spool what is left (giving up an open that did not come); end the thread."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        self.flush(max(0.0, deadline - time.monotonic()))
        self.give_up()  # no-op if it opened; else the thread wakes to spool and stop
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
        if self.spool is not None:
            self.spool.close()
