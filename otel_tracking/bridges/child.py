"""The bridge process itself: ``python -m otel_tracking.bridges.child <inbox fd> <outbox fd> <parent pid>``.

It opens each tracker on a thread of its own (a slow or hung open delays no other) and
reports each outcome; it hands every item it gets to ordinary :class:`Sink` objects (queue,
retry, spool, as in one process), acknowledging each once that sink delivered or spooled it; it
answers ``flush`` and ``finish``; and it ends on its own, as a crash, once the training process
is gone (a watchdog makes sure of that whatever the trackers are doing).  The training process's
side is ``process.py``; the messages are listed in ``wire.py``.
"""

from __future__ import annotations

import contextlib
import gc
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
    Acks,
    Failed,
    Finish,
    Finished,
    Flush,
    Flushed,
    Item,
    Open,
    Opened,
    Progress,
    TrackerInfo,
    decode_item,
)
from otel_tracking.config.run_config import RunConfig
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.pipeline import Sink, finish_sinks, flush_sinks

_ACK_INTERVAL_S = 0.05
_TEARDOWN_S = 60.0  # after it finished every backend, the child exits within this, hung SDK threads or not
_CRASH_TEARDOWN_S = 5.0  # the same after the training process died: nobody waits for a clean exit
_WATCH_INTERVAL_S = 0.2  # how often the child looks whether the training process is still there
_NICE = 10  # the child yields the CPU to the training loop
# One tracker SDK import at a time: two threads importing packages that import each other can
# fail ("partially initialized module").  The opens themselves (a server, maybe hung) overlap.
_IMPORTING = threading.Lock()


def serve(inbox: Connection, outbox: Connection, parent: int) -> int:
    """The bridge process: open the trackers (each on its own thread), feed them until told to
    finish (or the training process is gone), acknowledging every item once each sink is done
    with it, then finish them and report the counts."""
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
    # Each sink's queue exists before its tracker opens: what arrives meanwhile waits there.
    sinks = {name: Sink(name, named_events_only=True) for name in names}
    for sink in sinks.values():
        sink.start(
            sink_spool(sink, settings, parent),
            settings.delivery,
            done=replies.acknowledge,
            held=True,
            progressed=replies.progressed,
        )
    replies.start()
    for sink in sinks.values():
        opener = threading.Thread(
            target=_open_tracker,
            args=(sink, settings, config, replies),
            name=f"otel-tracking-open-{sink.name}",
        )
        opener.daemon = True  # an open stuck on a hung server must not keep the process alive
        opener.start()
    finish = _feed(inbox, sinks, build_resource(settings), replies, watchdog)
    if finish is not None:  # the training process asked: every backend is finished
        exit_code, timeout_s = finish
        finish_sinks(list(sinks.values()), exit_code, timeout_s)
        replies.send(Finished({name: sink.stats.as_dict() for name, sink in sinks.items()}))
        _exit_after(_TEARDOWN_S)
        return 0
    # The training process ended without finishing the run: deliver what it handed over, as a
    # crash.  Nobody waits for a tracker still opening: what waits for it is spooled.
    for sink in sinks.values():
        sink.give_up()
    finish_sinks(list(sinks.values()), 1, settings.finish_timeout_s)
    _exit_after(_CRASH_TEARDOWN_S)
    return 1


def _open_tracker(sink: Sink, settings: Settings, config: RunConfig, replies: _Outbox) -> None:
    """Open one tracker (a slow or hung one delays no other) and tell the training process how
    it went; its held items are then delivered in order, or spooled if it failed."""
    from otel_tracking.delivery.registry import import_sdk, open_checked_tracker

    try:
        with _IMPORTING:
            import_sdk(sink.name)
        parts = open_checked_tracker(sink.name, settings, config, in_bridge_process=True)
    except BaseException as error:  # the top of this thread: every error is the tracker's outcome
        sink.give_up()
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
    info = TrackerInfo(sink.metrics is not None, sink.spans is not None, sink.logs is not None, sink.where, sink.resume)
    replies.tell(Opened(sink.name, info))


def _feed(
    inbox: Connection, sinks: dict[str, Sink], resource: Any, replies: _Outbox, watchdog: _Watchdog
) -> tuple[int, float] | None:
    """Hand each item to its sinks' queues, answer flush requests; (exit code, timeout) once told
    to finish, None once the training process is gone."""
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
            case Item():
                payload = decode_item(message, resource)
                for name in message.names:  # the training process already chose the sinks (and events)
                    queue = sinks[name].queue
                    assert queue is not None
                    queue.submit(message.kind, payload, token=(message.seq, name))
            case Flush():
                deadline = time.monotonic() + message.timeout_s
                replies.send(Flushed(flush_sinks(list(sinks.values()), deadline), message.request))
            case Finish():
                return message.exit_code, message.stall_s


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
    """The child's answers to the training process: replies, and the acknowledgements the sinks'
    queues report (or, while a group of items is under way, that a backend took part of it), sent
    together every ``_ACK_INTERVAL_S`` by one small thread.

    Two locks: ``_lock`` guards the pending acknowledgements for an instant, so a sink's queue
    thread that reports one (under its own queue's lock) never waits on the pipe; ``_send_lock`` orders
    the writes, and acknowledgements are taken only under it, so a reply never overtakes those
    reported before it."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._acks: list[tuple[int, str, str]] = []
        self._progressed = False  # a backend took part of a group since the last message
        self.last_done = 0.0  # monotonic time a sink last reached the end of an item, or of part of one

    def acknowledge(self, token: tuple[int, str], outcome: str) -> None:
        with self._lock:
            self._acks.append((*token, outcome))
            self.last_done = time.monotonic()

    def progressed(self) -> None:
        with self._lock:
            self._progressed = True
            self.last_done = time.monotonic()

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._send_acks()  # acknowledgements first: a reply never overtakes them
            self._connection.send_bytes(data)

    def tell(self, message: Any) -> None:
        """:meth:`send`, from a thread of its own: a training process already gone is no error."""
        with contextlib.suppress(OSError):
            self.send(message)

    def _send_acks(self) -> None:
        """(Under the send lock.)  Acknowledgements say progress too: Progress only when there are none."""
        with self._lock:
            acks, self._acks = self._acks, []
            progressed, self._progressed = self._progressed, False
        if acks:
            self._connection.send_bytes(pickle.dumps(Acks(acks), protocol=pickle.HIGHEST_PROTOCOL))
        elif progressed:
            self._connection.send_bytes(pickle.dumps(Progress(), protocol=pickle.HIGHEST_PROTOCOL))

    def start(self) -> None:
        threading.Thread(target=self._loop, name="otel-tracking-acks", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(_ACK_INTERVAL_S)
            try:
                with self._send_lock:
                    self._send_acks()
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
