"""What travels between the training process and the bridge process, in one place.

The records themselves do not: the training process appends them to each tracker's log
(``delivery/spool.py``) and the child reads them from there (``delivery/reader.py``).  Two
pipes carry the rest, one pickled message a frame (``multiprocessing.connection.Connection``
framing; the training process writes its frames without blocking, :func:`write_frame`).  Every
message is one of the dataclasses below.

Training process -> bridge process (``process.py`` sends, ``child.py`` reads):

    Open(settings, config, names, argv)          the first message: open these trackers (config: a
                                                 run_config.RunConfig, redacted, with what trackers
                                                 use as is, e.g. wandb's proxy; argv scrubbed)
    Flush(timeout_s, request)                    answered by Flushed(ok, request) once each tracker
                                                 took its log up to where it ends now
    Finish(exit_code, stall_s)                   answered by Finished(counts, unended)

Bridge process -> training process:

    Opened(name, info)                           info: what the tracker takes, where, resume
    Failed(name, type_name, message, module, qualname)
    Progress()                                   a tracker took something (finish() waits while
                                                 these come)
    Flushed(ok, request), Finished({sink: counts}, [trackers whose backend run nobody ended])
"""

from __future__ import annotations

import os
import select
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Beyond the finish deadline: for the child to close its backends and answer, and for the
# training process to wait for that answer before it stops the child.
GRACE_S = 10.0


class Stuck(TimeoutError):
    """The reader did not take a message within its deadline.  ``torn``: part of it is in the pipe,
    so the stream can no longer be read (the reader must be stopped)."""

    def __init__(self, torn: bool) -> None:
        super().__init__("the bridge process is not reading its pipe")
        self.torn = torn


def write_frame(fd: int, data: bytes, deadline: float | None, cancelled: Callable[[], bool]) -> None:
    """Write one message to a non-blocking pipe, in ``Connection``'s framing (the reader uses
    ``recv_bytes``), waiting for room in it until ``deadline`` (monotonic; None: no deadline) or
    until ``cancelled()``.  A message of up to ``PIPE_BUF`` bytes goes in whole or not at all.
    Raises :class:`Stuck` when the reader does not make room in time, OSError when it is gone."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", n)
    view = memoryview(header + data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    written = 0
    while written < len(view):
        wait_s = _POLL_SLICE_S if deadline is None else min(_POLL_SLICE_S, deadline - time.monotonic())
        if wait_s <= 0 or cancelled():
            raise Stuck(torn=written > 0)
        events = poller.poll(wait_s * 1000)
        if not events:
            continue
        if events[0][1] & (select.POLLERR | select.POLLHUP):
            raise BrokenPipeError("the bridge process closed its pipe")
        try:
            written += os.write(fd, view[written:])
        except BlockingIOError:  # room for less than an atomic write: wait for more
            continue


_POLL_SLICE_S = 0.2  # how often a writer waiting for room looks whether it was cancelled


# --- training process -> bridge process -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    settings: Any  # settings.Settings
    config: Any  # run_config.RunConfig
    names: list[str]
    argv: list[str]


@dataclass(frozen=True, slots=True)
class Flush:
    timeout_s: float
    request: int


@dataclass(frozen=True, slots=True)
class Finish:
    exit_code: int
    stall_s: float  # a backend that delivers nothing for this long has the rest spooled


# --- bridge process -> training process -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrackerInfo:
    """What an opened tracker takes and where it writes (a RemoteSink's view of it)."""

    metrics: bool
    spans: bool
    logs: bool
    where: str | None
    resume: dict[str, Any] | None


# What the training process assumes of a tracker still opening: it may take everything.
OPENING = TrackerInfo(True, True, True, "opening in the otel-tracking bridge process", None)


@dataclass(frozen=True, slots=True)
class Opened:
    name: str
    info: TrackerInfo


@dataclass(frozen=True, slots=True)
class Failed:
    name: str
    type_name: str
    message: str
    module: str
    qualname: str


@dataclass(frozen=True, slots=True)
class Progress:
    pass


@dataclass(frozen=True, slots=True)
class Flushed:
    ok: bool
    request: int


@dataclass(frozen=True, slots=True)
class Finished:
    counts: dict[str, dict[str, int]]  # per sink, as SinkStats.as_dict (the training process reads
    # delivered and spooled from the logs; it takes the export attempts, failed and retried, from these)
    unended: list[str]  # trackers that never opened: replay ends their backend's run
