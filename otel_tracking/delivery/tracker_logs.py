"""The trackers' logs of a run, and what is counted from them.

Every record a tracker must get is appended once to that tracker's log by the training process
(``spool.py``), and read from the log's position by the tracker's reader (``reader.py``): in
the bridge process (``bridges/``), or, with ``OTEL_TRACKING_BRIDGE_PROCESS=false``, on a thread
here (:class:`LocalTrackers`).  Either way a tracker's counts at the end come from its log, in one
place, :func:`count_from_log`: what is past the position is *spooled* (``otel-tracking replay``
delivers it), what the writer could not write is *dropped*, and the rest was *delivered*.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource

from otel_tracking.config.settings import Settings
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.reader import LogReader, drain_readers, pending_items, remove_if_delivered
from otel_tracking.delivery.spool import LogWriter, Spool, sink_spool


def logs_settings(settings: Settings) -> Settings:
    """The settings the trackers' logs are made with: a spool directory that cannot be written
    gives way to a private one for the run (what is not delivered by its end cannot be replayed
    then; the run said so when it found the directory unwritable)."""
    if settings.spool_writable is not False:
        return settings
    private = Path(tempfile.mkdtemp(prefix="otel-tracking-logs-"))
    return dataclasses.replace(settings, spool_dir=private, spool_writable=True)


def open_logs(sinks: Sequence[Any], settings: Settings, pid: int) -> dict[str, Spool]:
    """Each tracker's log (its spool file: ``spool.sink_spool``), by name; ``settings`` from
    :func:`logs_settings`."""
    logs = {}
    for sink in sinks:
        log = sink_spool(sink, settings, pid)
        assert log is not None, "logs_settings() makes the spool directory writable"
        logs[sink.name] = log
    return logs


def writer_for(sinks: Sequence[Any], settings: Settings) -> LogWriter:
    """The writer of these trackers' logs; ``settings`` from :func:`logs_settings`."""
    return LogWriter(
        open_logs(sinks, settings, os.getpid()),
        capacity=max(settings.delivery.queue_size, 1),
        max_bytes=settings.spool_max_bytes,
    )


def count_from_log(sink: Sink, writer: LogWriter, attempts: dict[str, int] | None = None) -> None:
    """A tracker's counts at the end of the run, from its log and its position: spooled (past
    the position), dropped (not written), delivered (the rest); ``attempts``: the export attempts
    (failed, retried) that another process saw."""
    appended, dropped = writer.appended[sink.name], writer.dropped[sink.name]
    pending = sum(pending_items(path) for path in writer.parts[sink.name])
    sink.count("delivered", max(0, appended - dropped - pending))
    sink.count("spooled", pending)
    sink.count("dropped", dropped)
    for field in ("failed", "retried"):
        sink.count(field, (attempts or {}).get(field, 0))


def close_log(name: str, writer: LogWriter, ended: bool, exit_code: int) -> None:
    """After its counts: a log delivered in full is removed; one of a tracker that did not end
    its backend's run gets an end record (replay ends that run with ``exit_code``)."""
    parts = [path for path in writer.parts[name] if path.exists()]
    for path in parts[:-1] if not ended else parts:
        if pending_items(path) == 0:
            remove_if_delivered(path)
    if not ended and parts:
        writer.end(name, exit_code)


class LocalTrackers:
    """The trackers of a run without a bridge process: their logs, and a reader for each on a
    thread of this process.  Their sinks' transport is the logs' writer: ``log()`` hands it each
    record once, for all of them."""

    def __init__(self, sinks: Sequence[Sink], settings: Settings, resource: Resource) -> None:
        settings = logs_settings(settings)
        self.sinks = list(sinks)
        self.writer = writer_for(sinks, settings)
        self.readers: dict[str, LogReader] = {}
        self._finished = False
        self._lock = threading.Lock()
        for sink in self.sinks:
            sink.transport, sink.owner = self.writer, self
            if not any(sink.exporters):  # opened with nothing to write to: its log waits for replay
                continue
            reader = LogReader(
                self.writer.logs[sink.name].path, sink, sink.policy or settings.delivery, resource, follow=True,
                resume=sink.resume,
            )  # fmt: skip
            self.readers[sink.name] = reader
            reader.start()

    def flush(self, timeout_s: float) -> bool:
        """Every record so far written, and taken by its tracker (or its tracker is failing: the
        rest waits in the log)."""
        deadline = time.monotonic() + timeout_s
        if not self.writer.flush(timeout_s):
            return False
        ok = True
        for name, reader in self.readers.items():
            path = self.writer.logs[name].path
            ok = reader.caught_up(path, _size(path), max(0.0, deadline - time.monotonic())) and ok
        return ok

    def finish(self, exit_code: int, timeout_s: float) -> None:
        """Write the rest, deliver it while each tracker makes progress (``timeout_s``: the bound
        for one that takes nothing), and count each tracker from its log; once."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        since = time.monotonic()
        self.writer.close(timeout_s)
        drain_readers(list(self.readers.values()), timeout_s, since)
        for sink in self.sinks:
            count_from_log(sink, self.writer)
            close_log(sink.name, self.writer, ended=sink.name in self.readers, exit_code=exit_code)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
