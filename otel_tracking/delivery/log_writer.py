"""The writing side of the trackers' logs: every record appended once to the log of each sink it is
for, on one thread, so that neither its encoding nor the disk reaches ``log()``.

    log() --append()--> [records waiting] --otel-tracking-log-writer--> <sink>.jsonl, one per sink
                                                                         (read by its LogReader,
                                                                          delivery/reader.py)

``append()`` only puts the payload in line; the thread encodes it once (``codec``) and appends the
same line to each of its sinks' logs (``spool.Spool``: one ``write`` a record, 0600).  Nothing
waits for a tracker: the log is the record, and the sink's reader delivers from it.

Bounded in memory: past ``capacity`` records waiting (a disk slower than the training loop for
that long), ``append()`` writes what waits itself, in order, before it returns: the training loop
then goes at the disk's pace, never at a tracker's.

Bounded on disk: a log is cut into parts of ``PART_BYTES`` (``spool.next_part``); its reader
removes a part once it delivered all of it.  A sink whose parts on disk reach ``max_bytes``
(``OTEL_TRACKING_SPOOL_MAX_MB``: its tracker has taken nothing for that long) gets no more records
until its reader catches up: each one is counted ``dropped``, with one warning, never silently.  A
record that cannot be written (a full disk) is dropped and counted the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_tracking.delivery.spool import PART_BYTES, Spool, next_part, record_line

logger = logging.getLogger("otel_tracking")

CAPACITY = 10_000  # records waiting for the writer thread before append() writes them itself
MAX_BYTES = 1 << 30  # a sink's parts on disk, at most (OTEL_TRACKING_SPOOL_MAX_MB)


def items_in(kind: str, payload: Any) -> int:
    """Items in one record, as the counts see them: a log() call is one, spans and log records
    one each."""
    return len(payload) if kind in ("spans", "logs") else 1


class LogWriter:
    """Appends records to sinks' logs (``logs``: each sink's :class:`Spool`) on a thread of its
    own.  ``written()`` is told each time records reached the disk."""

    def __init__(
        self,
        logs: Mapping[str, Spool],
        capacity: int = CAPACITY,
        written: Callable[[], None] | None = None,
        max_bytes: int = MAX_BYTES,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.logs = dict(logs)  # each sink's part being written
        self.parts: dict[str, list[Path]] = {name: [log.path] for name, log in self.logs.items()}
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.part_bytes = part_bytes
        self._part_size = dict.fromkeys(self.logs, 0)  # bytes this writer put in each sink's part
        self._on_disk = dict.fromkeys(self.logs, 0)  # ... and in all its parts (less those removed)
        self._full: set[str] = set()  # sinks at max_bytes (said once each)
        self._written = written
        self.appended: dict[str, int] = defaultdict(int)  # items handed, per sink
        self.dropped: dict[str, int] = defaultdict(int)  # items that could not be written, per sink
        self._waiting: deque[tuple[Sequence[str], str, Any]] = deque()
        self._cond = threading.Condition()
        self._one_writer = threading.Lock()  # the thread, or append() past capacity: records stay in order
        self._handed = 0  # records handed to append(), and of those written (or dropped)
        self._done = 0
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="otel-tracking-log-writer", daemon=True)
        self._thread.start()

    def append(self, names: Sequence[str], kind: str, payload: Any) -> None:
        """Put one record in line for the logs of ``names``; never waits for a tracker."""
        n = items_in(kind, payload)
        with self._cond:
            self._waiting.append((names, kind, payload))
            self._handed += 1
            for name in names:
                self.appended[name] += n
            if len(self._waiting) == 1:
                self._cond.notify_all()
            over = len(self._waiting) > self.capacity
        if over:
            self._write_waiting()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting and self._closed:
                    return
            self._write_waiting()
            if self._written is not None:
                self._written()

    def _write_waiting(self) -> None:
        with self._one_writer:
            with self._cond:
                batch = list(self._waiting)
                self._waiting.clear()
            for names, kind, payload in batch:
                self._write(names, kind, payload)
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()

    def _write(self, names: Sequence[str], kind: str, payload: Any) -> None:
        try:
            line = record_line(kind, payload)  # encoded once, for every sink it is for
        except Exception:
            logger.exception("otel-tracking: a %s record could not be encoded; dropped", kind)
            for name in names:
                self.dropped[name] += items_in(kind, payload)
            return
        for name in names:
            if self._on_disk[name] + len(line) > self.max_bytes and not self._room(name, len(line)):
                self.dropped[name] += items_in(kind, payload)
                continue
            try:
                self.logs[name].append(line)
                self._part_size[name] += len(line)
                self._on_disk[name] += len(line)
                if self._part_size[name] >= self.part_bytes:
                    self._next_part(name)
            except OSError as error:
                self.dropped[name] += items_in(kind, payload)
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "otel-tracking: %s cannot be written (%s); what cannot be written is dropped and counted",
                        self.logs[name].path,
                        error.strerror or type(error).__name__,
                    )

    def _next_part(self, name: str) -> None:
        """Go on in the next part of a sink's log (this one is whole: its reader may remove it)."""
        current = self.logs[name]
        current.close()
        self.logs[name] = Spool(next_part(current.path), dict(current.header))
        self.parts[name].append(self.logs[name].path)
        self._part_size[name] = 0

    def _room(self, name: str, size: int) -> bool:
        """Whether a sink at its bound has room again (its reader removed parts it delivered)."""
        self.parts[name] = [path for path in self.parts[name] if path.exists() or path == self.logs[name].path]
        self._on_disk[name] = sum(_size(path) for path in self.parts[name])
        if self._on_disk[name] + size <= self.max_bytes:
            self._full.discard(name)
            return True
        if name not in self._full:
            self._full.add(name)
            logger.warning(
                "otel-tracking: %s has %d MB in the spool that its tracker has not taken "
                "(OTEL_TRACKING_SPOOL_MAX_MB); what is logged for it is dropped, and counted, until it catches up",
                name,
                self.max_bytes >> 20,
            )
        return False

    def flush(self, timeout_s: float) -> bool:
        """Wait until every record appended so far is written (or counted dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._handed
            self._cond.notify_all()
            while self._done < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def end(self, name: str, exit_code: int) -> None:
        """The last record of a sink's log when no tracker ended the backend's run: replay ends it
        so.  (After :meth:`close`.)"""
        try:
            self.logs[name].end(exit_code)
        except OSError as error:
            logger.warning("otel-tracking: %s: could not record the run's end: %s", self.logs[name].path, error)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what waits (within ``timeout_s``; what is left then is written here), end the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._write_waiting()
        for log in self.logs.values():
            log.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
