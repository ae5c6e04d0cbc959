"""The bridge process itself: ``python -m otel_tracking.bridges.child <inbox fd> <outbox fd> <parent pid>``.

It opens each tracker on a thread of its own (a slow or hung open delays no other) and reports
each outcome; for each tracker that opened it runs a :class:`~otel_tracking.delivery.reader.LogReader`
on the tracker's log, which the training process appends to (retry, backoff, bulk, position: as
``otel-tracking replay`` does); it answers ``flush`` and ``finish``, and says while finishing that
its trackers make progress; and it ends on its own, as a crash, once the training process is gone
(a watchdog makes sure of that whatever the trackers are doing).  It writes no log: the training
process is each log's one writer.  The training process's side is ``process.py``; the messages are
listed in ``wire.py``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from otel_tracking.bridges.wire import (
    GRACE_S,
    Failed,
    Finish,
    Finished,
    Flush,
    Flushed,
    Open,
    Opened,
    Progress,
    TrackerInfo,
)
from otel_tracking.config.run_config import RunConfig
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.reader import LogReader, drain_readers
from otel_tracking.delivery.spool import next_part

logger = logging.getLogger("otel_tracking")

_PROGRESS_INTERVAL_S = 0.05  # how often the child tells the training process its trackers took something
_TEARDOWN_S = 60.0  # after it finished every backend, the child exits within this, hung SDK threads or not
_CRASH_TEARDOWN_S = 5.0  # the same after the training process died: nobody waits for a clean exit
_WATCH_INTERVAL_S = 0.2  # how often the child looks whether the training process is still there
_NICE = 10  # the child yields the CPU to the training loop
# One tracker SDK import at a time: two threads importing packages that import each other can
# fail ("partially initialized module").  The opens themselves (a server, maybe hung) overlap.
_IMPORTING = threading.Lock()


class _Tracker:
    """One tracker in the child: its sink, its opener thread, and its log's reader once it opened."""

    def __init__(self, sink: Sink, log: Any) -> None:
        self.sink = sink
        self.log = log  # the path of its log (spool.sink_spool: the same one the training process writes)
        self.reader: LogReader | None = None
        self.opener: threading.Thread | None = None
        self.lock = threading.Lock()
        self.finishing = False  # finish() came: an open that ends now starts no reader


def serve(inbox: Connection, outbox: Connection, parent: int) -> int:
    """The bridge process: open the trackers (each on its own thread), deliver their logs until
    told to finish (or the training process is gone), then finish them and report the counts."""
    from otel_tracking.config.resource import build_resource
    from otel_tracking.delivery.spool import sink_spool

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(_NICE)
    replies = _Outbox(outbox)
    try:
        opening: Open = pickle.loads(inbox.recv_bytes())
    except (OSError, EOFError):
        return 1  # the training process died before it asked for anything
    settings, config, names = opening.settings, opening.config, opening.names
    sys.argv = opening.argv
    watchdog = _Watchdog(parent, settings.finish_timeout_s + GRACE_S, replies)
    resource = build_resource(settings)
    trackers: dict[str, _Tracker] = {}
    for name in names:
        sink = Sink(name, named_events_only=True)
        log = sink_spool(sink, settings, parent)
        assert log is not None  # (the training process made sure the spool directory is writable)
        trackers[name] = _Tracker(sink, log.path)
    replies.start()
    for tracker in trackers.values():
        tracker.opener = threading.Thread(
            target=_open_tracker,
            args=(tracker, settings, config, resource, replies),
            name=f"otel-tracking-open-{tracker.sink.name}",
        )
        tracker.opener.daemon = True  # an open stuck on a hung server must not keep the process alive
        tracker.opener.start()
    finish = _serve_requests(inbox, trackers, replies, watchdog)
    if finish is not None:  # the training process asked: every backend is finished
        exit_code, stall_s = finish
        unended = _finish(trackers, exit_code, stall_s)
        counts = {name: tracker.sink.stats.as_dict() for name, tracker in trackers.items()}
        replies.send(Finished(counts, unended))
        _exit_after(_TEARDOWN_S)
        return 0
    # The training process ended without finishing the run: deliver what it wrote, as a crash.
    # Nobody waits for a tracker still opening: its log waits for replay.
    _finish(trackers, 1, settings.finish_timeout_s, wait_for_opens=False)
    _exit_after(_CRASH_TEARDOWN_S)
    return 1


def _open_tracker(tracker: _Tracker, settings: Settings, config: RunConfig, resource: Any, replies: _Outbox) -> None:
    """Open one tracker (a slow or hung one delays no other), tell the training process how it
    went, and start the reader of its log."""
    from otel_tracking.delivery.registry import import_sdk, open_checked_tracker

    sink = tracker.sink
    try:
        with _IMPORTING:
            import_sdk(sink.name)
        parts = open_checked_tracker(sink.name, settings, config, in_bridge_process=True)
    except BaseException as error:  # the top of this thread: every error is the tracker's outcome
        kind = type(error)
        replies.tell(Failed(sink.name, kind.__name__, str(error), kind.__module__, kind.__qualname__))
        return
    if not sink.attach(parts):  # the run finished while this one was opening: end it, as failed
        if parts.finish is not None:
            with contextlib.suppress(Exception):
                parts.finish(1)
        return
    # The tracker's SDK is imported and its run is open: nearly everything on the heap now lives
    # as long as this process.  Frozen, it is no longer walked by every full collection, which
    # the objects of a burst of steps trigger (ClearML: about 0.15 s of a 200 x 200 burst).
    gc.freeze()
    if any(sink.exporters):  # (one that opened with nothing to write to leaves its log for replay)
        reader = LogReader(
            tracker.log, sink, settings.delivery, resource, follow=True, progressed=replies.progressed,
            landed=replies.landed, resume=sink.resume,
        )  # fmt: skip
        with tracker.lock:
            if not tracker.finishing:
                tracker.reader = reader
                reader.start()
    info = TrackerInfo(sink.metrics is not None, sink.spans is not None, sink.logs is not None, sink.where, sink.resume)
    replies.tell(Opened(sink.name, info))


def _serve_requests(
    inbox: Connection, trackers: dict[str, _Tracker], replies: _Outbox, watchdog: _Watchdog
) -> tuple[int, float] | None:
    """Answer flush requests; (exit code, stall bound) once told to finish, None once the
    training process is gone."""
    while True:
        try:
            if not inbox.poll(_WATCH_INTERVAL_S):
                if watchdog.parent_gone.is_set():  # gone without finishing (its pipe may live on in a fork)
                    return None
                continue
            message = pickle.loads(inbox.recv_bytes())
        except (OSError, EOFError):
            return None
        match message:
            case Flush():
                deadline = time.monotonic() + message.timeout_s
                replies.send(Flushed(_caught_up(trackers, deadline), message.request))
            case Finish():
                return message.exit_code, message.stall_s


def _caught_up(trackers: dict[str, _Tracker], deadline: float) -> bool:
    """Wait until each tracker's reader delivered its log up to where it ends now (or its tracker
    is failing, or did not open: the rest waits in the log, for replay); False if one was not
    there by ``deadline``, or is still opening (every tracker is waited for, none skipped)."""
    ok = True
    for tracker in trackers.values():
        if tracker.reader is None and tracker.opener is not None:  # opening: waited for, up to the deadline
            tracker.opener.join(max(0.0, deadline - time.monotonic()))
        reader = tracker.reader
        if reader is None:
            opening = tracker.opener is not None and tracker.opener.is_alive()
            ok = ok and not (opening and _size(tracker.log) > 0)
            continue
        path = _last_part(tracker.log)
        ok = reader.caught_up(path, _size(path), max(0.0, deadline - time.monotonic())) and ok
    return ok


def _finish(trackers: dict[str, _Tracker], exit_code: int, stall_s: float, wait_for_opens: bool = True) -> list[str]:
    """Deliver what is left in each log while its tracker makes progress, then end every
    backend's run; the trackers whose backend run nobody ended (they never opened)."""
    since = time.monotonic()
    if wait_for_opens:  # a tracker still opening is waited for up to the bound, as a stalled one would be
        for tracker in trackers.values():
            if tracker.opener is not None:
                tracker.opener.join(max(0.0, since + stall_s - time.monotonic()))
    for tracker in trackers.values():
        with tracker.lock:
            tracker.finishing = True
    readers = [tracker.reader for tracker in trackers.values() if tracker.reader is not None]
    drain_readers(readers, stall_s, since)
    unended = []
    for name, tracker in trackers.items():
        if tracker.reader is None:
            unended.append(name)
        tracker.sink.finish(exit_code, timeout_s=stall_s, since=since)
    return unended


def _last_part(path: Any) -> Any:
    """The part of a log the training process writes now (it wrote everything before a flush)."""
    while next_part(path).exists():
        path = next_part(path)
    return path


def _size(path: Any) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


class _Watchdog:
    """Ends the bridge process once the training process is gone, whatever the child is doing (a
    tracker's open stuck on a hung server, a backend that hangs while its run ends): it sets
    ``parent_gone``, on which the main loop takes the crash path, and exits the process once
    ``grace_s`` passed with no item done (the crash path delivering to a slow backend is waited
    for, as ``finish()`` waits for it).  Polling ``getppid()`` sees the death even when a forked
    process of the training job still holds the pipe open."""

    def __init__(self, parent: int, grace_s: float, progress: _Outbox) -> None:
        self.parent = parent
        self.grace_s = grace_s
        self.progress = progress
        self.parent_gone = threading.Event()
        threading.Thread(target=self._watch, name="otel-tracking-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(_WATCH_INTERVAL_S)
        self.parent_gone.set()
        gone_at = time.monotonic()
        while time.monotonic() < max(gone_at, self.progress.last_done) + self.grace_s:
            time.sleep(_WATCH_INTERVAL_S)
        _hard_exit(1)


class _Outbox:
    """The child's messages to the training process: outcomes and replies, and, every
    ``_PROGRESS_INTERVAL_S`` while a tracker takes something, a Progress (finish() waits while
    they come).  ``_send_lock`` orders the writes."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._send_lock = threading.Lock()
        self._progressed = False  # a tracker took something since the last Progress
        self.last_done = 0.0  # monotonic time a tracker last took something

    def progressed(self) -> None:
        self._progressed = True
        self.last_done = time.monotonic()

    def landed(self, records: int, items: int) -> None:
        self.progressed()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._connection.send_bytes(data)

    def tell(self, message: Any) -> None:
        """:meth:`send`, from a thread of its own: a training process already gone is no error."""
        with contextlib.suppress(OSError):
            self.send(message)

    def start(self) -> None:
        threading.Thread(target=self._loop, name="otel-tracking-progress", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(_PROGRESS_INTERVAL_S)
            if not self._progressed:
                continue
            self._progressed = False
            try:
                self.send(Progress())
            except OSError:
                return


def _exit_after(seconds: float) -> None:
    """A backend thread that never ends must not keep a finished bridge process alive."""
    timer = threading.Timer(seconds, _hard_exit, args=(0,))
    timer.daemon = True
    timer.start()


def _hard_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str]) -> int:
    inbox = Connection(int(argv[0]), writable=False)
    outbox = Connection(int(argv[1]), readable=False)
    return serve(inbox, outbox, parent=int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
