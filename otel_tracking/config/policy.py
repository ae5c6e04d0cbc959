"""How hard a sink tries: its queue's size, retries and backoff, the probe of a degraded backend,
and how long spans and log records may wait to leave together.  A setting (chosen in ``Settings``
or per sink).  The one place the retry policy lives: the trackers' log readers
(``delivery/reader.py``) and the OTel exporters' queues (``delivery/engine.py``) both try an
export as :meth:`Policy.pauses` says."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    queue_size: int = 2_000  # per sink; a 200-metric step is ~100 KB in memory: ~200 MB at most
    max_attempts: int = 4
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    probe_interval_s: float = 5.0
    # Spans and log records: at most one export per interval (0: each leaves as soon as it is
    # queued).  One that comes after a quiet interval still leaves at once; a busy sink's items
    # wait at most this long and leave together, one request instead of one each (an OTLP/HTTP
    # request's CPU cost hardly depends on its size).  A flush, the stop or a full export's worth
    # of items ends the wait.
    export_interval_s: float = 0.0

    def pauses(self) -> list[float]:
        """The pauses between an export's attempts: ``max_attempts - 1`` of them, from
        ``backoff_s``, doubling up to ``backoff_max_s``.  After the last attempt a backend is
        degraded, and tried once every ``probe_interval_s``."""
        pauses, pause = [], self.backoff_s
        for _ in range(self.max_attempts - 1):
            pauses.append(pause)
            pause = min(pause * 2, self.backoff_max_s)
        return pauses
