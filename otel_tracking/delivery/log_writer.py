"""The writing side of the trackers' logs: every record appended once to the log of each sink it is
for, on one thread, so that neither its encoding nor the disk reaches ``log()``.

    log() --append()--> [records waiting] --otel-tracking-log-writer--> <sink>.jsonl, one per sink
                                                                         (read by its LogReader,
                                                                          delivery/reader.py)

``append()`` only puts the payload in line; the thread encodes it once (``codec``) and appends the
same line to each of its sinks' logs (``spool.Spool``: one ``write`` a record, 0600).  Nothing
waits for a tracker: the log is the record, and the sink's reader delivers from it.

Bounded: past ``capacity`` records waiting (a disk slower than the training loop for that long),
``append()`` writes what waits itself, in order, before it returns: the training loop then goes at
the disk's pace, never at a tracker's, and memory stays bounded.  A record that cannot be written
(a full disk) is counted ``dropped`` for its sinks, with one warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_tracking.delivery.spool import Spool, record_line

logger = logging.getLogger("otel_tracking")

CAPACITY = 10_000  # records waiting for the writer thread before append() writes them itself


def items_in(kind: str, payload: Any) -> int:
    """Items in one record, as the counts see them: a log() call is one, spans and log records
    one each."""
    return len(payload) if kind in ("spans", "logs") else 1


class LogWriter:
    """Appends records to sinks' logs (``logs``: each sink's :class:`Spool`) on a thread of its
    own.  ``written()`` is told each time records reached the disk."""

    def __init__(
        self, logs: Mapping[str, Spool], capacity: int = CAPACITY, written: Callable[[], None] | None = None
    ) -> None:
        self.logs = dict(logs)
        self.capacity = capacity
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
            try:
                self.logs[name].append(line)
            except OSError as error:
                self.dropped[name] += items_in(kind, payload)
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "otel-tracking: %s cannot be written (%s); what cannot be written is dropped and counted",
                        self.logs[name].path,
                        error.strerror or type(error).__name__,
                    )

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
