"""What travels between the training process and the bridge process, in one place.

Two pipes, one pickled tuple a message (``multiprocessing.connection.Connection`` framing).

Training process -> bridge process (``bridge_process.py`` sends, ``bridge_child.py`` reads):

    ("open", settings, config, inputs, names, argv)
                                                the first message: open these bridges (config
                                                redacted; inputs: what bridges use as is, e.g.
                                                wandb's proxy; argv scrubbed)
    ("metrics", seq, names, step, scalars, others, time_ns)
    ("spans", seq, names, [span as codec.encode_spans])
    ("logs", seq, names, [log record as codec.encode_logs])
    ("flush", timeout_s, request)               answered by ("flushed", ok, request)
    ("finish", exit_code, timeout_s)            answered by ("finished", {sink: counts})

Bridge process -> training process:

    ("opened", name, info)                      info: metrics/spans/logs present, where, resume
    ("failed", name, type_name, message, module, qualname)
    ("acks", [(seq, name), ...])                these items are delivered or spooled, for that sink
    ("flushed", ok, request), ("finished", {sink: counts})

An item (a log() call, a batch of spans or log records) goes out once, with the names of every
sink it is for; ``seq`` numbers it for the acknowledgements.  Spans and log records use the
spool's encoding (``codec.py``); a step goes as its parts, its non-number values as JSON.
"""

from __future__ import annotations

import os
import select
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from otel_tracking.codec import decode_logs, decode_spans, encode_logs, encode_spans
from otel_tracking.steps import StepBatch
from otel_tracking.values import decode_others, encode_others

ITEM_KINDS = ("metrics", "spans", "logs")
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


def encode_item(kind: str, seq: int, names: Sequence[str], payload: Any) -> tuple[Any, ...]:
    """One item as a message: a ``StepBatch`` for metrics, SDK spans or log records otherwise."""
    if kind == "metrics":
        others = encode_others(payload.others) if payload.others else None
        return ("metrics", seq, tuple(names), payload.step, dict(payload.scalars), others, payload.time_ns)
    if kind == "spans":
        return ("spans", seq, tuple(names), encode_spans(payload))
    return ("logs", seq, tuple(names), encode_logs(payload))


def decode_item(message: tuple[Any, ...], resource: Any) -> tuple[str, int, Sequence[str], Any]:
    """(kind, seq, names, payload) of an item message; steps get the child's ``resource``."""
    kind, seq, names = message[0], message[1], message[2]
    if kind == "metrics":
        step, scalars, others, time_ns = message[3:]
        return kind, seq, names, StepBatch(resource, step, scalars, decode_others(others) if others else {}, time_ns)
    return kind, seq, names, decode_spans(message[3]) if kind == "spans" else decode_logs(message[3])
