"""The reading side of a sink's log: from its position, through the sink's exporters, the position
moved as the tracker takes each record.  The one place that retries, backs off, probes a degraded
tracker and hands a tracker many steps at once (its bulk path).

    <sink>.jsonl --LogReader (its thread)--> Sink.deliver, or the bulk path --> the tracker's exporters
         |                                     retried with backoff; then, while the tracker fails,
         '-- <sink>.jsonl.pos                  once every probe interval (``Policy``)
             (delivery/position.py)

A run's trackers each have one, on a thread in the bridge process (or in the training process
when there is none), following the log as the training process appends to it (``spool.py``);
``otel-tracking replay`` runs the same reader on a log whose job is gone, on its own thread, and
stops at the first record the tracker does not take.

A group of records is read from the position: a run of log() calls for a tracker with a bulk path
(MLflow: up to 1,000 metrics a request), a run of spans or of log records as one export, else one
record.  What of a group lands is marked in the position at once (a later record may land before
an earlier one); only what did not land is tried again, so nothing that landed is sent twice by
this reader.  What happens to records on their way when the reader's process is killed depends on
``at_most_once``: the live reader leaves them before its position, and the next reader delivers
them again (at least once: the bridge process's promise); replay marks them handed first, and the
next replay sets them aside in ``<log>.in-doubt`` instead (at most once: replay's promise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource

from otel_tracking.config.policy import Policy
from otel_tracking.delivery.codec import DECODERS, ENCODERS
from otel_tracking.delivery.pipeline import PROGRESS_AFTER_S, Sink
from otel_tracking.delivery.position import LogPosition, Settled
from otel_tracking.delivery.spool import (
    CUT_SHORT,
    Damaged,
    Frame,
    item_count,
    next_part,
    part_of,
    read_frames,
    read_header,
)
from otel_tracking.signals.steps import StepBatch, step_batch_of

logger = logging.getLogger("otel_tracking")

MAX_GROUP = 256  # log() calls handed to a bulk path at once
GROUP_POINTS = 40_000  # ... and at most this many numbers: a 200 x 200 burst in one call
MAX_MERGE = 512  # records of spans (or of log records) exported in one call
_POLL_S = 0.01  # how often a reader at the end of a live log looks for more


class _Entry:
    """One record of a group: where it lies, its kind, and the payload still to deliver (what is
    left of it when part of it landed)."""

    __slots__ = ("frame", "kind", "payload")

    def __init__(self, frame: Frame, kind: str, payload: Any) -> None:
        self.frame, self.kind, self.payload = frame, kind, payload

    @property
    def items(self) -> int:
        return item_count(self.kind, self.payload)


class LogReader:
    """Delivers one sink's log to ``sink`` from the log's position.  ``follow``: the log is still
    written; at its end the reader waits for more until :meth:`stop` (the live reader); else it
    ends at the end, or at the first group the tracker did not take after its attempts (replay).
    ``landed(records, items)`` hears of every record delivered (replay's progress bar);
    ``progressed()`` of every request that landed (finish() waits while it hears of them)."""

    def __init__(
        self,
        path: Path,
        sink: Sink,
        policy: Policy,
        resource: Resource | None = None,
        *,
        follow: bool,
        at_most_once: bool = False,
        landed: Callable[[int, int], None] | None = None,
        progressed: Callable[[], None] | None = None,
        say: Callable[[str], None] | None = None,
        resume: dict[str, Any] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.path = path
        self.sink = sink
        self.policy = policy
        self.resource = resource if resource is not None else Resource({})
        self.follow = follow
        self.at_most_once = at_most_once
        self._landed = landed
        self._progressed = progressed
        self._resume = resume  # the backend run it delivers into: kept in the position, for replay
        self._say = say or (lambda line: logger.warning("otel-tracking: %s", line))
        self.position: LogPosition | None = None
        self.header_line = b""
        self.damaged = 0  # records skipped as damaged
        self.stopped = False  # (not following) a group the tracker did not take: nothing after it is tried
        self.last_progress = time.monotonic()  # when the tracker last took something
        self._cond = threading.Condition()  # guards the position's offset as others wait on it
        self._failing = False  # the head group used up its attempts: the tracker is degraded
        self._writer_done = threading.Event()  # (following) nothing more will be appended
        self._stop = stop if stop is not None else threading.Event()  # replay's: its Ctrl-C
        self._thread: threading.Thread | None = None
        self._turn: int | None = None  # (following) the run directory, held shared while it reads

    # --- the live reader's thread ----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name=f"otel-tracking-{self.sink.name}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            self.run()
        except Exception:  # the thread must never die silently: what is left stays in the log
            logger.exception("otel-tracking: the reader of %s stopped", self.path)
        finally:
            if self._turn is not None:
                os.close(self._turn)
                self._turn = None
            self._set_caught_up()

    def run(self) -> str:
        """Deliver from the position to the end (following: until stopped, part after part):
        "delivered", "stopped" (not following: the tracker did not take a group), "interrupted"
        (:meth:`stop`) or "writing" (not following: it ends in a record a process still writes)."""
        if not self._open():
            return "delivered"
        while True:
            if self._stop.is_set():
                return "interrupted"
            if self.follow and self._size() <= self.at() and not self._writer_done.is_set():
                if not self._next_part():
                    self._set_caught_up()
                    self._stop.wait(_POLL_S)  # nothing new: look again in a moment
                continue
            group, at_end = self._read_group()
            if group:
                if self._deliver(group) or self.follow or self._stop.is_set():
                    continue  # (stopped: said at the top of the loop)
                self.stopped = True
                return "stopped"
            if at_end == "torn-tail" and not self.follow:
                return "writing"
            if self.follow and self._next_part():
                continue
            if not self.follow or (self._writer_done.is_set() and at_end == "end"):
                self._set_caught_up()
                return "delivered"
            self._set_caught_up()
            self._stop.wait(_POLL_S)

    def _next_part(self) -> bool:
        """(Following.)  The writer went on in the next part of the log: this one, delivered in
        full, is removed, and reading goes on there."""
        following = next_part(self.path)
        if not following.exists() or self._size() > self.at():
            return False
        remove_if_delivered(self.path, self.position)
        with self._cond:
            self.path, self.header_line, self.position = following, b"", None
        return self._open()

    def _open(self) -> bool:
        """Load the position once the log has its header (a live log may not exist yet)."""
        while True:
            with contextlib.suppress(FileNotFoundError):
                _, self.header_line = read_header(self.path)
                if self.header_line:
                    break
            if not self.follow or self._stop.is_set() or self._writer_done.is_set():
                self._set_caught_up()
                return False
            self._stop.wait(_POLL_S)
        header, _ = read_header(self.path)
        if self.follow and not self._take_turn():
            return False
        position = LogPosition.load(self.path, self.header_line)
        if self._resume and not header.get("resume") and not position.resume:
            position.resume = self._resume  # a replay of what is left goes on into the same run
            position.save()
        with self._cond:
            self.position = position
        return True

    def _take_turn(self) -> bool:
        """(Following.)  Hold the run directory shared while this reader delivers: replay holds
        it exclusively (``replay._turn``), so that a replay never delivers a log a live reader
        delivers too.  Waits while a replay has it (it delivers this run's logs right now)."""
        if self._turn is not None:
            return True
        fd = os.open(self.path.parent, os.O_RDONLY)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                self._turn = fd
                return True
            except BlockingIOError:
                if self._stop.wait(10 * _POLL_S) or self._writer_done.is_set():
                    os.close(fd)
                    return False
            except OSError:  # a file system without flock: nothing to coordinate with
                self._turn = fd
                return True

    def _read_group(self) -> tuple[list[_Entry], str]:
        """The next group from the position, records dealt with before skipped; and why reading
        stopped: "end", "torn-tail" (a record still being written), or "full"."""
        position = self.position
        assert position is not None
        group: list[_Entry] = []
        points = 0
        _, frames = read_frames(self.path, position.offset)
        why = "end"
        try:
            for frame in frames:
                settled = position.after.get(frame.start)
                item = frame.item
                if isinstance(item, Damaged):
                    if item.reason == CUT_SHORT and self._still_written():
                        why = "torn-tail"
                        break
                    if group:
                        why = "full"
                        break
                    self._skip(frame, f"{item.path}: damaged record at byte {item.offset} skipped ({item.reason})")
                    continue
                kind, payload = item
                if kind == "end" or (settled is not None and settled.state == "landed"):
                    if group:
                        why = "full"
                        break
                    self._skip(frame)
                    continue
                if settled is not None and settled.rest is not None:  # part of it landed before: the rest
                    kind, payload = settled.rest["kind"], DECODERS[settled.rest["kind"]](settled.rest["data"])
                entry = _Entry(frame, *self._as_step(kind, payload))
                if group and not self._joins(group, entry, points):
                    why = "full"
                    break
                group.append(entry)
                points += _points(entry.payload)
                if not self._groups(entry.kind):
                    why = "full"
                    break
        finally:
            frames.close()  # type: ignore[attr-defined]
        return group, why

    def _as_step(self, kind: str, payload: Any) -> tuple[str, Any]:
        """A log() call as the sink takes it: a StepBatch with this reader's resource (a record of
        an older release, kept as metric data, made one again for a step exporter's bulk path)."""
        if kind == "step":
            return "metrics", dataclasses.replace(payload, resource=self.resource)
        if kind == "metrics" and self.sink.exporters.step_records is not None:
            return "metrics", step_batch_of(payload) or payload
        return kind, payload

    def _groups(self, kind: str) -> bool:
        return kind in ("spans", "logs") or (kind == "metrics" and self.sink.exporters.bulk is not None)

    def _joins(self, group: list[_Entry], entry: _Entry, points: int) -> bool:
        kind = group[0].kind
        if entry.kind != kind or not self._groups(kind):
            return False
        if kind == "metrics":
            return len(group) < MAX_GROUP and points + _points(entry.payload) <= GROUP_POINTS
        return len(group) < MAX_MERGE

    def _size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def _still_written(self) -> bool:
        return (self.follow and not self._writer_done.is_set()) or (not self.follow and written_now(self.path))

    # --- delivery: attempts, backoff, the degraded probe -----------------------------------------

    def _deliver(self, group: list[_Entry]) -> bool:
        """Deliver a group, retrying what did not land (the policy's attempts and pauses); True
        once all of it landed.  Not following, False after the last attempt; following, it goes on
        trying once every probe interval (the tracker is degraded meanwhile) until it lands or the
        reader is stopped."""
        if self.at_most_once:
            self._hand(group)
        pending = group
        pauses = self.policy.pauses()
        while True:
            pending = self._attempt(pending)
            if not pending:
                self._failing = False
                return True
            if pauses:
                pause = pauses.pop(0)
                self.sink.count("retried", 1)
            else:
                self._failing = True
                with self._cond:
                    self._cond.notify_all()  # a flush() waiting is told the tracker is degraded
                if not self.follow:
                    self._keep(pending)
                    return False
                pause = self.policy.probe_interval_s
            if self._stop.wait(pause):
                self._keep(pending)
                return False

    def _attempt(self, pending: list[_Entry]) -> list[_Entry]:
        """One attempt at the pending records of a group: those that landed are marked; the
        others, narrowed to what of them did not land, are returned."""
        kind = pending[0].kind
        if kind == "metrics":
            results = self._deliver_steps([entry.payload for entry in pending])
        elif len(pending) == 1:
            results = [self.sink.deliver(kind, pending[0].payload)]
        else:  # one export for the run of spans or log records
            merged = [one for entry in pending for one in entry.payload]
            results = [self.sink.deliver(kind, merged)] * len(pending)
        left = []
        for entry, result in zip(pending, results, strict=True):
            if result is True:
                self._settle(entry, Settled(entry.frame.end, "landed"))
                continue
            if result is not False:  # the rest of a partly delivered record: only that is tried again
                entry.payload = result
                rest = {"kind": "step" if isinstance(result, StepBatch) else kind, "data": _encode(result)}
                self._settle(entry, Settled(entry.frame.end, "way" if self.at_most_once else "rest", rest))
            left.append(entry)
        return left

    def _deliver_steps(self, steps: list[Any]) -> list[Any]:
        """log() calls, for each True when it landed, False when nothing of it did, or the step of
        what did not (a ``StepBatch`` of those numbers).  A tracker with a bulk path
        (``export_many``: MLflow packs steps into requests of up to 1,000 metrics) gets them all,
        and says as each request lands (progress); any other gets them one by one, and after a
        failure the rest wait (so that its retry does not land after them)."""
        sink = self.sink
        bulk = sink.exporters.bulk
        if bulk is None or not all(isinstance(step, StepBatch) for step in steps):
            results: list[Any] = []
            for step in steps:
                results.append(sink.deliver("metrics", step))
                if results[-1] is not True:
                    break
            return results + [False] * (len(steps) - len(results))
        try:
            rests = bulk([step.record() for step in steps], self._heard_progress)
        except Exception as error:
            sink.count_failure("metrics", error)
            return [False] * len(steps)
        landed: list[Any] = []
        for step, rest in zip(steps, rests, strict=True):
            if rest is None:
                landed.append(True)
            elif len(rest.scalars) >= len(step.scalars):
                landed.append(False)
            else:
                landed.append(dataclasses.replace(step, scalars=rest.scalars))
        if any(result is not True for result in landed):
            sink.count_failure("metrics", None)
        return landed

    def _hand(self, group: list[_Entry]) -> None:
        """(At most once.)  The group is on its way: a reader killed now leaves it in doubt."""
        position = self.position
        assert position is not None
        with self._cond:
            for entry in group:
                settled = position.after.get(entry.frame.start)
                if settled is not None and settled.rest is not None:
                    position.after[entry.frame.start] = Settled(entry.frame.end, "way", settled.rest)
                position.handed = max(position.handed, entry.frame.end)
            position.save()

    def _keep(self, pending: list[_Entry]) -> None:
        """(At most once.)  Records the tracker did not take are no longer on their way: the next
        reader delivers them (what is left of them) again."""
        position = self.position
        assert position is not None
        if not self.at_most_once:
            return
        with self._cond:
            for entry in pending:
                settled = position.after.get(entry.frame.start)
                rest = settled.rest if settled is not None else None
                position.after[entry.frame.start] = Settled(entry.frame.end, "rest" if rest else "kept", rest)
            position.save()

    def _settle(self, entry: _Entry, settled: Settled) -> None:
        position = self.position
        assert position is not None
        with self._cond:
            position.after[entry.frame.start] = settled
            position.compact()
            position.save()
            if settled.state == "landed":
                self.last_progress = time.monotonic()
                self._cond.notify_all()
        if settled.state == "landed" and self._landed is not None:
            self._landed(1, entry.items)

    def _skip(self, frame: Frame, damaged: str | None = None) -> None:
        """A record with nothing to deliver: the run's end, one delivered before, or a damaged one."""
        if damaged is not None:
            self.damaged += 1
            self._say(damaged)
        position = self.position
        assert position is not None
        with self._cond:
            position.after[frame.start] = Settled(frame.end, "landed")
            position.compact()
            position.save()
            self._cond.notify_all()

    def _heard_progress(self) -> None:
        self.last_progress = time.monotonic()
        if self._progressed is not None:
            self._progressed()

    def _set_caught_up(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- what the run waits for ------------------------------------------------------------------

    def at(self) -> int:
        """The position's offset: every record before it is dealt with."""
        with self._cond:
            return self.position.offset if self.position is not None else len(self.header_line)

    def caught_up(self, path: Path, end: int, timeout_s: float) -> bool:
        """Wait until every record before byte ``end`` of the log's part ``path`` is delivered, or
        the tracker is degraded (what it did not take stays in the log); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._failing and not self._past(path, end):
                if self._thread is not None and not self._thread.is_alive():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def _past(self, path: Path, end: int) -> bool:
        """(Under the lock.)"""
        if part_of(self.path) != part_of(path):
            return part_of(self.path) > part_of(path)
        if self.position is None:
            return end <= 0
        return self.position.offset >= end

    @property
    def done(self) -> bool:
        """The reader's thread has ended (or never started)."""
        return self._thread is None or not self._thread.is_alive()

    def writer_finished(self) -> None:
        """Nothing more will be appended: the reader stops once it reached the end."""
        self._writer_done.set()

    def drain(self, stall_s: float, since: float, wait_s: float = math.inf) -> str:
        """Nothing more will be appended: wait until the reader reached the end, for as long as
        the tracker makes progress; "drained", "stalled" once it took nothing for ``stall_s``
        (counted from its last progress or ``since``, whichever is later), or "moving" when
        ``wait_s`` passed first."""
        self.writer_finished()
        until = time.monotonic() + wait_s
        while not self.done:
            assert self._thread is not None
            stalled_at = max(since, self.last_progress) + stall_s
            now = time.monotonic()
            if now >= stalled_at or _hurry():
                return "stalled"
            if now >= until:
                return "moving"
            self._thread.join(min(stalled_at - now, until - now, 0.25))
        return "drained"

    def stop(self) -> None:
        """Stop reading: a delivery on its way is left to finish (or hang) on its own thread; what
        was not delivered stays in the log, past the position."""
        self._stop.set()
        self._writer_done.set()
        if self._thread is not None:
            self._thread.join(0.1)


def drain_readers(readers: Sequence[LogReader], stall_s: float, since: float) -> None:
    """Nothing more will be appended to these logs: wait for every reader, each for as long as
    its tracker makes progress (``LogReader.drain``), then stop it.  All are told first, so that
    they reach their ends side by side, not one after the other.  Every ``PROGRESS_AFTER_S`` one
    line says which trackers are still taking what is left."""
    for reader in readers:
        reader.writer_finished()
    next_line = since + PROGRESS_AFTER_S
    for reader in readers:
        while reader.drain(stall_s, since, wait_s=max(0.0, next_line - time.monotonic())) == "moving":
            next_line = time.monotonic() + PROGRESS_AFTER_S
            logger.warning(
                "otel-tracking: finishing for %.0f s: still delivering to %s; waiting while they make progress "
                "(what a backend that delivers nothing for %g s still holds is spooled)",
                time.monotonic() - since,
                ", ".join(r.sink.name for r in readers if not r.done),
                stall_s,
            )
        reader.stop()


def _hurry() -> bool:
    from otel_tracking.delivery.engine import HURRY

    return HURRY.is_set()


def _points(payload: Any) -> int:
    scalars = getattr(payload, "scalars", None)
    return len(scalars) if scalars is not None else 1


def _encode(payload: Any) -> Any:
    if isinstance(payload, StepBatch):
        return ENCODERS["step"](payload)
    return ENCODERS["metrics"](payload)


# --- what is left in a log ----------------------------------------------------------------------


def pending_items(path: Path) -> int:
    """Items in a log (one part of it) past its position (not delivered, or on their way), as the
    counts see them."""
    try:
        _, header_line = read_header(path)
    except FileNotFoundError:
        return 0
    if not header_line:
        return 0
    try:
        position = LogPosition.load(path, header_line)
    except Exception:
        position = None
    start = position.offset if position is not None else len(header_line)
    after = position.after if position is not None else {}
    n = 0
    _, frames = read_frames(path, start)
    for frame in frames:
        settled = after.get(frame.start)
        if isinstance(frame.item, Damaged) or frame.item[0] == "end" or (settled and settled.state == "landed"):
            continue
        n += item_count(*frame.item) if frame.item[0] != "step" else 1
    return n


def written_now(path: Path) -> bool:
    """Whether a process holds the log open to append to it (its writer's shared ``flock``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock at once: a writer opening now waits an instant for it
    return False


def remove_if_delivered(path: Path, position: LogPosition | None = None) -> str:
    """Remove a log whose every record is delivered, unless a writer holds it: "removed",
    "writing" (a running process still appends to it) or "grown" (records are left past the
    position).  The exclusive lock keeps writers out while it looks and removes; a writer that
    opened the log meanwhile finds it gone once it has its lock, and makes a new one."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "removed"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "writing"
        if position is None:
            _, header_line = read_header(path)
            position = LogPosition.load(path, header_line)
        size = os.fstat(fd).st_size
        tail = size - position.offset
        if tail > 0 and (tail > 4096 or os.pread(fd, tail, position.offset).strip()):
            return "grown"
        os.unlink(path)  # the log first: a position without its log names no log and is ignored
        position.remove()
        return "removed"
    finally:
        os.close(fd)
