"""The OTel exporters' path off the training thread: one bounded queue and one thread per sink (a
``SinkQueue``), retry with backoff, and a spool on disk for what the sink cannot take.  The OTLP
sinks and those ``OTEL_*_EXPORTER`` names have one; the ML trackers named in ``Tracking()`` have a
log and its reader instead (``tracker_logs.py``), which ``otel-tracking replay`` runs on what
these queues spool too.

    spans/records --submit()--> [bounded queue] --thread--> exporter.export()  (retried with backoff)
                                     | full                     | still failing
                                     v                          v
                                   spool (JSONL on disk, 0600; ``otel-tracking replay`` delivers it later)

``submit()`` never waits for the backend or for an export: it appends under the queue's lock, and a
full queue writes the item to the spool file instead (a local write, under that lock, so the spool
stays in order), or, with no spool, drops and counts it.  The attempts and their pauses are the
policy's (``Policy.pauses``).  After an item has used up its attempts the sink is *degraded*: new
items go straight to the spool (no waiting on a dead backend), and every ``probe_interval_s`` one
item is tried again; one success ends the degraded state.  At ``stop()`` the queue is drained, with
at most one attempt per item, for as long as the backend makes progress: a slow backend that keeps
delivering is waited for, and what a backend that delivered nothing for the finish timeout still
holds is spooled.  Every outcome is counted in the sink's stats.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_tracking.config.policy import Policy
from otel_tracking.delivery.spool import Spool, item_count

logger = logging.getLogger("otel_tracking")

# Set by SIGTERM while a run finishes (runtime/lifecycle.py): a scheduler is about to kill the
# process, so every drain stops waiting and what is left is spooled at once.
HURRY = threading.Event()
_HURRY_POLL_S = 0.25  # how soon a drain that waits notices HURRY

_MERGEABLE = ("spans", "logs")  # consecutive items of these kinds go out in one export call
_MAX_MERGE = 512


def set_aside(sink: str, spool: Spool | None, kind: str, payload: Any, count: Callable[[str, int], None]) -> str:
    """Keep what a sink cannot deliver now in its spool (counted ``spooled``); with no spool, or
    one that cannot be written, the items are lost and counted ``dropped``.  Which of the two."""
    n = item_count(kind, payload)
    if spool is None:
        count("dropped", n)
        return "dropped"
    try:
        spool.write(kind, payload)
        count("spooled", n)
        return "spooled"
    except Exception:
        logger.exception("otel-tracking: sink %r could not spool; data dropped", sink)
        count("dropped", n)
        return "dropped"


@dataclass
class Ledger:
    """Where every item handed to a queue is, counted under the queue's lock, so that at every
    moment ``handed == delivered + in_flight + queued + spooled + dropped``."""

    handed: int = 0
    delivered: int = 0
    spooled: int = 0
    dropped: int = 0
    queued: int = 0
    in_flight: int = 0

    def settled(self, outcome: str, n: int) -> None:
        """``n`` items reached their end: "delivered", "spooled" or "dropped"."""
        if outcome == "delivered":
            self.delivered += n
        elif outcome == "spooled":
            self.spooled += n
        elif outcome == "dropped":
            self.dropped += n
        else:
            raise ValueError(f"not an outcome: {outcome!r}")

    def balanced(self) -> bool:
        return self.handed == self.delivered + self.in_flight + self.queued + self.spooled + self.dropped


class SinkQueue:
    """The queue and thread of one sink.  ``deliver(kind, payload) -> bool`` is the sink's guarded
    export call; ``count(field, n)`` updates the sink's stats.

    Every move of an item (handed, queued, taken, delivered, spooled, dropped) happens under one
    condition lock together with its count in :attr:`ledger`; exports and retry pauses happen
    outside it."""

    def __init__(
        self,
        name: str,
        deliver: Callable[[str, Any], bool],
        count: Callable[[str, int], None],
        spool: Spool | None,
        policy: Policy | None = None,
    ) -> None:
        self.name = name
        self._deliver = deliver
        self._sink_count = count
        self.spool = spool
        self.policy = policy or Policy()
        self.ledger = Ledger()
        self._lock = threading.Condition()  # guards everything below and the ledger
        self._items: deque[tuple[str, Any]] = deque()
        self._inflight: tuple[str, Any] | None = None  # the item being exported, not settled yet
        self._closed = False  # stop(): the thread ends once it has settled what it holds
        self._given_up = False  # stop() spooled the in-flight item while its export hung
        self._next_export = 0.0  # spans and log records wait until then (policy.export_interval_s)
        self._hurry = 0  # flushes waiting: nothing is held for the export interval meanwhile
        self._stopping = threading.Event()
        self._degraded_until = 0.0  # monotonic time of the next probe while degraded
        self._last_delivery = 0.0  # monotonic time the backend last took an item: stop() waits while it does
        self._thread = threading.Thread(target=self._run, name=f"otel-tracking-{name}", daemon=True)
        self._thread.start()

    def _count(self, field: str, n: int) -> None:
        if field in ("delivered", "spooled", "dropped"):
            self.ledger.settled(field, n)
        self._sink_count(field, n)

    def snapshot(self) -> Ledger:
        with self._lock:
            return dataclasses.replace(self.ledger)

    # --- the training thread's side --------------------------------------------------------------

    def submit(self, kind: str, payload: Any) -> None:
        """Queues the item without waiting for the backend: a full queue (or a stopped queue) spools
        it instead (a local write, under the lock)."""
        n = item_count(kind, payload)
        with self._lock:
            self.ledger.handed += n
            if self._closed or len(self._items) >= self.policy.queue_size:
                self._set_aside(kind, payload)
                return
            self._items.append((kind, payload))
            self.ledger.queued += n
            if len(self._items) == 1 or len(self._items) >= _MAX_MERGE:
                self._lock.notify_all()  # the thread waits for a first item, or holds a full export

    # --- the queue thread's side ------------------------------------------------------------------

    def _take(self) -> tuple[str, Any] | None:
        """The next item (same-kind spans or log records merged, up to _MAX_MERGE), now in flight;
        None once stopped and empty."""
        with self._lock:
            while not self._items or self._holding_back():
                if self._closed and not self._items:
                    return None
                self._lock.wait(max(0.0, self._next_export - time.monotonic()) if self._items else None)
            if self._items[0][0] in _MERGEABLE and self.policy.export_interval_s:
                self._next_export = time.monotonic() + self.policy.export_interval_s
            kind, payload = self._items.popleft()
            if kind in _MERGEABLE:  # take the run of same-kind items behind it
                payload, merged = list(payload), 1
                while self._items and self._items[0][0] == kind and merged < _MAX_MERGE:
                    payload.extend(self._items.popleft()[1])
                    merged += 1
            n = item_count(kind, payload)
            self.ledger.queued -= n
            self.ledger.in_flight += n
            self._inflight = (kind, payload)
            return self._inflight

    def _holding_back(self) -> bool:
        """Whether the spans or log records at the head of the queue wait for the export interval
        (under the lock)."""
        return (
            self.policy.export_interval_s > 0
            and self._items[0][0] in _MERGEABLE
            and time.monotonic() < self._next_export
            and len(self._items) < _MAX_MERGE
            and not self._hurry
            and not self._stopping.is_set()
        )

    def _run(self) -> None:
        while (item := self._take()) is not None:
            kind, payload = item
            try:
                delivered = self._attempt(kind, payload)
            except Exception:  # the thread must never die: keep the item and go on
                logger.exception("otel-tracking: sink %r queue thread error", self.name)
                delivered = False
            self._settle(kind, payload, delivered)

    def _settle(self, kind: str, payload: Any, delivered: bool) -> None:
        """The in-flight item reached its end: delivered, or spooled (or dropped).  Nothing when
        stop() had given it up (spooled it) meanwhile: then it is not this thread's to count."""
        with self._lock:
            if not self._given_up and self._inflight is not None:
                self.ledger.in_flight -= item_count(kind, payload)
                if delivered:
                    self._count("delivered", item_count(kind, payload))
                    self._last_delivery = time.monotonic()
                else:
                    self._set_aside(kind, payload)
            self._inflight = None
            self._lock.notify_all()

    def _attempt(self, kind: str, payload: Any) -> bool:
        """Deliver the in-flight item with the policy's attempts; False once they are used up (or
        the sink is degraded and it is not time to probe)."""
        if self._degraded_until and time.monotonic() < self._degraded_until:
            return False
        pauses = [] if (self._stopping.is_set() or self._degraded_until) else self.policy.pauses()
        for pause in [*pauses, None]:
            if self._deliver(kind, payload):
                self._degraded_until = 0.0
                return True
            if pause is None:
                break
            self._count("retried", 1)
            if self._stopping.wait(pause):
                break  # finishing: no more waiting on a failing backend
        self._degraded_until = time.monotonic() + self.policy.probe_interval_s
        return False

    def _set_aside(self, kind: str, payload: Any) -> None:
        """(Under the lock.)"""
        set_aside(self.name, self.spool, kind, payload, self._count)

    # --- the end ---------------------------------------------------------------------------------

    def hold_for(self, export_interval_s: float) -> None:
        """From now on spans and log records wait up to ``export_interval_s`` to leave together
        (the policy's ``export_interval_s``); a flush or the stop still sends them at once."""
        with self._lock:
            self.policy = dataclasses.replace(self.policy, export_interval_s=export_interval_s)
            self._next_export = min(self._next_export, time.monotonic() + export_interval_s)
            self._lock.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted so far was handled; False on timeout."""
        with self._lock:
            self._hurry += 1
            self._lock.notify_all()  # a thread holding items for the export interval sends them now
            try:
                return self._lock.wait_for(lambda: not self._items and self._inflight is None, timeout_s)
            finally:
                self._hurry -= 1

    def drain(self, stall_s: float, since: float, wait_s: float = math.inf) -> str:
        """Wait until everything submitted so far was handled, for as long as the backend makes
        progress: "drained"; "stalled" once it delivered nothing for ``stall_s``, counted from its
        last delivery or from ``since`` (monotonic), whichever is later; "moving" when ``wait_s``
        passed first.  A slow backend that keeps delivering is waited for; a hung one is not."""
        until = time.monotonic() + wait_s
        with self._lock:
            self._hurry += 1
            self._lock.notify_all()  # a thread holding items for the export interval sends them now
            try:
                while self._items or self._inflight is not None:
                    now = time.monotonic()
                    stalled_at = max(since, self._last_delivery) + stall_s
                    if now >= stalled_at or HURRY.is_set():
                        return "stalled"
                    if now >= until:
                        return "moving"
                    # woken as each item is done, and often enough to notice HURRY
                    self._lock.wait(min(stalled_at, until, now + _HURRY_POLL_S) - now)
                return "drained"
            finally:
                self._hurry -= 1

    def backlog(self) -> int:
        """Items queued or in flight."""
        with self._lock:
            return self.ledger.queued + self.ledger.in_flight

    def stop(self, stall_s: float, since: float | None = None) -> None:
        """Drain (one attempt per item) while the backend makes progress (see :meth:`drain`);
        once it delivered nothing for ``stall_s`` (from ``since``, default now), spool what is
        left, including an item whose export still hangs then; end the thread."""
        self._stopping.set()
        since = time.monotonic() if since is None else since
        self.drain(stall_s, since)
        with self._lock:  # stalled: whatever is still queued goes to the spool
            while self._items:
                kind, payload = self._items.popleft()
                self.ledger.queued -= item_count(kind, payload)
                self._set_aside(kind, payload)
            self._closed = True
            self._lock.notify_all()
            stalled_at = max(since, self._last_delivery) + stall_s
        self._thread.join(0.1 if HURRY.is_set() else max(0.1, stalled_at - time.monotonic()))
        with self._lock:
            if self._thread.is_alive() and self._inflight is not None:
                kind, payload = self._inflight
                self._given_up = True
                self.ledger.in_flight -= item_count(kind, payload)
                self._set_aside(kind, payload)
        if self.spool is not None:
            self.spool.close()
