"""Off the training thread: one bounded queue and one thread per sink (a ``SinkQueue``), retry with backoff,
and a spool on disk for what the sink cannot take.

    log() --submit()--> [bounded queue] --thread--> exporter.export()  (retried with backoff)
                             | full                     | still failing
                             v                          v
                           spool (JSONL on disk, 0600; ``otel-tracking replay`` delivers it later)

``submit()`` never waits for the backend or for an export: it appends under the queue's lock, and a
full queue writes the item to the spool file instead (a local write, under that lock, so the spool
stays in order), or, with no spool, drops and counts it.  The ``done`` callback runs under the lock
too: it must not wait on anything slow (in the bridge process it queues an acknowledgement).
After an item has used up its attempts the sink is *degraded*: new items go straight to the spool
(no waiting on a dead backend), and every ``probe_interval_s`` one item is tried again; one success
ends the degraded state.  At ``stop()`` the queue is drained, with at most one attempt per item,
for as long as the backend makes progress: a slow backend that keeps delivering is waited for, and
what a backend that delivered nothing for the finish timeout still holds is spooled.  Every
outcome is counted in the sink's stats.

A sink that can take several steps in one call (``deliver_many``: MLflow packs them into requests
of up to 1,000 metrics) gets the run of metric items queued behind the first, up to ``_MAX_GROUP``
items and ``_GROUP_POINTS`` scalars, in one call.  It says of each item
whether it landed, or what of it did not (the rest of a step split over requests): only that rest
is retried or spooled, so no point is sent twice.  The items are settled (and acknowledged) when
the call returns; each request that lands before that counts as the backend's progress.

A queue can start *held*, for a backend that is still opening: its queue keeps what comes (a full
queue spools, as always) and its thread waits; ``release()`` (opened) delivers it all in order,
``give_up()`` (failed, or nobody waits any more) spools it and everything after.
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
from otel_tracking.delivery.spool import Spool

logger = logging.getLogger("otel_tracking")

# Set by SIGTERM while a run finishes (runtime/lifecycle.py): a scheduler is about to kill the
# process, so every drain stops waiting and what is left is spooled at once.
HURRY = threading.Event()
_HURRY_POLL_S = 0.25  # how soon a drain that waits notices HURRY

_MERGEABLE = ("spans", "logs")  # consecutive items of these kinds go out in one export call
_MAX_MERGE = 512
_MAX_GROUP = 256  # metric items handed to a deliver_many in one call
# ... and at most this many scalars: a 200 x 200 burst in one call.  The bigger the group, the fewer
# keys each of MLflow's requests holds (lanes group by key), and its server writes a request of few
# keys faster, so larger groups land a burst sooner.  A group is
# settled only when its call returns; each request that lands on the way counts as progress
# (``progressed``: the bridge process tells the training process, whose finish() waits while it
# hears of progress).
_GROUP_POINTS = 40_000

# What deliver_many says of each item: True (landed), False (nothing landed), or the payload of
# what did not land (the item is then retried, or spooled, as that rest only).
Landed = Any


def _points(payload: Any) -> int:
    """The scalars of a metric item (a ``StepBatch``; other payloads count one)."""
    scalars = getattr(payload, "scalars", None)
    return len(scalars) if scalars is not None else 1


class _Entry:
    """One item in flight (or a run of merged spans or log records): its payload, which a
    partial delivery narrows to what has not landed yet, its tokens, and how many of a merged
    run's spans or log records came with each token (what is set aside is set aside as it came)."""

    __slots__ = ("payload", "sizes", "tokens")

    def __init__(self, payload: Any, tokens: list[Any], sizes: list[int] | None = None) -> None:
        self.payload = payload
        self.tokens = tokens
        self.sizes = sizes

    def parts(self) -> list[tuple[Any, list[Any]]]:
        """(payload, tokens) as they were submitted: one spool record each when set aside."""
        if self.sizes is None or len(self.tokens) < 2:
            return [(self.payload, self.tokens)]
        parts, at = [], 0
        for token, size in zip(self.tokens, self.sizes, strict=True):
            parts.append((self.payload[at : at + size], [token]))
            at += size
        return parts


def item_count(kind: str, payload: Any) -> int:
    """Items in one payload, as the counts see them: a log() call is one, spans and log records
    one each."""
    return len(payload) if kind in _MERGEABLE else 1


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
    export call; ``count(field, n)`` updates the sink's stats; ``done(token, outcome)``, when given,
    hears of every submitted item that reached its end (``outcome``: "delivered", "spooled" or
    "dropped"), by the token it was submitted with; ``progressed()``, when given, hears when part
    of a group landed before any of its items is settled.  ``held``: the backend is still opening (see
    :meth:`release`).  ``set_aside(kind, payload, tokens) -> outcome``, when given, keeps what
    cannot be delivered instead of ``spool`` (the bridge link spools an item for each tracker it is
    for; replay leaves it in its log and notes what of it is left, by its tokens).

    Every move of an item (handed, queued, taken, delivered, spooled, dropped) happens under one
    condition lock together with its count in :attr:`ledger`; exports and retry waits happen
    outside it."""

    def __init__(
        self,
        name: str,
        deliver: Callable[[str, Any], bool],
        count: Callable[[str, int], None],
        spool: Spool | None,
        policy: Policy | None = None,
        *,
        done: Callable[[Any, str], None] | None = None,
        held: bool = False,
        set_aside: Callable[[str, Any, list[Any]], str] | None = None,
        deliver_many: Callable[[str, list[Any], Callable[[], None]], list[Landed]] | None = None,
        progressed: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._heard_progress = progressed
        self._deliver = deliver
        self._deliver_many = deliver_many
        self._keep = set_aside
        self._sink_count = count
        self._done = done
        self.spool = spool
        self.policy = policy or Policy()
        self.ledger = Ledger()
        self._lock = threading.Condition()  # guards everything below and the ledger
        self._items: deque[tuple[str, Any, Any]] = deque()
        self._inflight: tuple[str, list[_Entry]] | None = None  # the items being exported, not settled yet
        self._closed = False  # stop(): the thread ends once it has settled what it holds
        self._given_up = False  # stop() spooled the in-flight item while its export hung
        self._next_export = 0.0  # spans and log records wait until then (policy.export_interval_s)
        self._hurry = 0  # flushes waiting: nothing is held for the export interval meanwhile
        self._opening = held  # the backend is still opening: items wait (release() / give_up())
        self._never_opened = False  # give_up() came first: every item goes to the spool
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

    # --- a backend still opening -----------------------------------------------------------------

    @property
    def held(self) -> bool:
        return self._opening

    def release(self) -> bool:
        """The backend opened: deliver what was held, in order, then everything after.  False if
        it was given up first."""
        with self._lock:
            if self._never_opened:
                return False
            self._opening = False
            self._lock.notify_all()
            return True

    @property
    def never_opened(self) -> bool:
        with self._lock:
            return self._never_opened

    def give_up(self) -> bool:
        """The backend will not open: spool what was held and everything after.  False (and
        nothing changes) if it had opened."""
        with self._lock:
            if not self._opening and not self._never_opened:
                return False
            self._never_opened, self._opening = True, False
            self._lock.notify_all()
            return True

    # --- the training thread's side --------------------------------------------------------------

    def submit(self, kind: str, payload: Any, token: Any = None) -> None:
        """Queues the item without waiting for the backend: a full queue (or a stopped queue) spools
        it instead (a local write, under the lock)."""
        n = item_count(kind, payload)
        with self._lock:
            self.ledger.handed += n
            full = len(self._items) >= self.policy.queue_size
            if self._closed or (full and not self._opening):
                self._report_done([token], self._set_aside(kind, payload, [token]))
                return
            if full:
                # Held for a backend still opening: the oldest goes to the spool instead, so the
                # spool stays oldest-first (the held rest follows it there if the open fails, and
                # replay delivers in order) and the newest wait to go live.
                old_kind, old_payload, old_token = self._items.popleft()
                self.ledger.queued -= item_count(old_kind, old_payload)
                self._report_done([old_token], self._set_aside(old_kind, old_payload, [old_token]))
            self._items.append((kind, payload, token))
            self.ledger.queued += n
            if len(self._items) == 1 or len(self._items) >= _MAX_MERGE:
                self._lock.notify_all()  # the thread waits for a first item, or holds a full export

    # --- the queue thread's side ------------------------------------------------------------------

    def _take(self) -> tuple[str, list[_Entry]] | None:
        """The next item (same-kind spans or log records merged, up to _MAX_MERGE; with
        ``deliver_many``, the run of metric items behind it, up to _MAX_GROUP), now in flight;
        None once stopped and empty."""
        with self._lock:
            while not self._items or self._opening or self._holding_back():
                if self._closed and not self._items:
                    return None
                holding = self._items and not self._opening
                self._lock.wait(max(0.0, self._next_export - time.monotonic()) if holding else None)
            if self._items[0][0] in _MERGEABLE and self.policy.export_interval_s:
                self._next_export = time.monotonic() + self.policy.export_interval_s
            kind, payload, token = self._items.popleft()
            entries = [_Entry(payload, [token])]
            if kind in _MERGEABLE:  # take the run of same-kind items behind it
                payload = entries[0].payload = list(payload)
                sizes = entries[0].sizes = [len(payload)]
                while self._items and self._items[0][0] == kind and len(entries[0].tokens) < _MAX_MERGE:
                    _, more, token = self._items.popleft()
                    payload.extend(more)
                    sizes.append(len(more))
                    entries[0].tokens.append(token)
            elif kind == "metrics" and self._deliver_many is not None:
                points = _points(payload)
                while self._items and self._items[0][0] == kind and len(entries) < _MAX_GROUP:
                    points += _points(self._items[0][1])
                    if points > _GROUP_POINTS:
                        break
                    _, more, token = self._items.popleft()
                    entries.append(_Entry(more, [token]))
            n = sum(item_count(kind, entry.payload) for entry in entries)
            self.ledger.queued -= n
            self.ledger.in_flight += n
            self._inflight = (kind, entries)
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
            kind, entries = item
            try:
                self._attempt(kind, entries)
            except Exception:  # the thread must never die: keep the items and go on
                logger.exception("otel-tracking: sink %r queue thread error", self.name)
                for entry in list(entries):
                    self._settle(kind, entry, delivered=False)
            with self._lock:
                self._inflight = None
                self._lock.notify_all()

    def _settle(self, kind: str, entry: _Entry, delivered: bool) -> None:
        """An in-flight item reached its end: delivered, or spooled (or dropped), and its tokens
        are told so.  Nothing when stop() had given it up (spooled it) meanwhile: then it is not
        this thread's to count."""
        with self._lock:
            if self._given_up or self._inflight is None or entry not in self._inflight[1]:
                return
            self._inflight[1].remove(entry)
            self.ledger.in_flight -= item_count(kind, entry.payload)
            if delivered:
                self._count("delivered", item_count(kind, entry.payload))
                self._last_delivery = time.monotonic()
                outcomes = [(entry.tokens, "delivered")]
            else:
                outcomes = self._set_aside_entry(kind, entry)
        for tokens, outcome in outcomes:
            self._report_done(tokens, outcome)

    def _set_aside_entry(self, kind: str, entry: _Entry) -> list[tuple[list[Any], str]]:
        """(Under the lock.)  Set an in-flight item aside as it was submitted (a merged run of
        spans or log records as one record each); the outcome of each part's tokens."""
        return [(tokens, self._set_aside(kind, payload, tokens)) for payload, tokens in entry.parts()]

    def _report_done(self, tokens: list[Any], outcome: str) -> None:
        if self._done is not None:
            for token in tokens:
                self._done(token, outcome)

    def _attempt(self, kind: str, entries: list[_Entry]) -> None:
        """Deliver the in-flight items, retrying what did not land (only that: the rest of a
        partly delivered item), each settled as soon as it landed; what is left after the last
        attempt is set aside."""
        pending = list(entries)
        if self._never_opened or (self._degraded_until and time.monotonic() < self._degraded_until):
            for entry in pending:
                self._settle(kind, entry, delivered=False)
            return
        attempts = 1 if (self._stopping.is_set() or self._degraded_until) else self.policy.max_attempts
        delay = self.policy.backoff_s
        for attempt in range(attempts):
            pending = self._deliver_pending(kind, pending)
            if not pending:
                self._degraded_until = 0.0
                return
            if attempt + 1 < attempts:
                self._count("retried", 1)
                if self._stopping.wait(delay):
                    break  # finishing: no more waiting on a failing backend
                delay = min(delay * 2, self.policy.backoff_max_s)
        self._degraded_until = time.monotonic() + self.policy.probe_interval_s
        for entry in pending:
            self._settle(kind, entry, delivered=False)

    def _progressed(self) -> None:
        """Part of a group landed (one request of it): the backend makes progress, which is what
        stop() waits for, though no item of the group is settled yet."""
        with self._lock:
            self._last_delivery = time.monotonic()
            self._lock.notify_all()
        if self._heard_progress is not None:
            self._heard_progress()

    def _deliver_pending(self, kind: str, pending: list[_Entry]) -> list[_Entry]:
        """One attempt at the pending items: those that landed are settled; the others, narrowed
        to what of them did not land, are returned."""
        if kind == "metrics" and self._deliver_many is not None:
            results = self._deliver_many(kind, [entry.payload for entry in pending], self._progressed)
        else:  # one item (or one merged run of spans or log records)
            results = [self._deliver(kind, entry.payload) for entry in pending]
        left = []
        for entry, landed in zip(pending, results, strict=True):
            if landed is True:
                self._settle(kind, entry, delivered=True)
                continue
            if landed is not False:
                with self._lock:  # the rest of a partly delivered item: only that is retried or spooled
                    entry.payload = landed
            left.append(entry)
        return left

    def _set_aside(self, kind: str, payload: Any, tokens: list[Any]) -> str:
        if self._keep is None:
            return set_aside(self.name, self.spool, kind, payload, self._count)
        outcome = self._keep(kind, payload, tokens)
        self._count(outcome, item_count(kind, payload))
        return outcome

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
        """Drain (one attempt per item) while the backend makes progress (see :meth:`drain`; one
        still opening makes none); once it delivered nothing for ``stall_s`` (from ``since``,
        default now), spool what is left (giving up an open that did not come), including an item
        whose export still hangs then; end the thread."""
        self._stopping.set()
        since = time.monotonic() if since is None else since
        self.drain(stall_s, since)
        self.give_up()  # a backend still opening is given up (no-op if it opened)
        with self._lock:  # stalled: whatever is still queued goes to the spool
            while self._items:
                kind, payload, token = self._items.popleft()
                self.ledger.queued -= item_count(kind, payload)
                self._report_done([token], self._set_aside(kind, payload, [token]))
            self._closed = True
            self._lock.notify_all()
            stalled_at = max(since, self._last_delivery) + stall_s
        self._thread.join(0.1 if HURRY.is_set() else max(0.1, stalled_at - time.monotonic()))
        given_up: list[tuple[list[Any], str]] = []
        with self._lock:
            inflight = self._inflight if self._thread.is_alive() else None
            if inflight is not None:
                kind, entries = inflight
                self._given_up = True
                for entry in entries:
                    self.ledger.in_flight -= item_count(kind, entry.payload)
                    given_up.extend(self._set_aside_entry(kind, entry))
        for tokens, outcome in given_up:
            self._report_done(tokens, outcome)
        if self.spool is not None:
            self.spool.close()
