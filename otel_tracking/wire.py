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

from collections.abc import Sequence
from typing import Any

from otel_tracking.codec import decode_logs, decode_spans, encode_logs, encode_spans
from otel_tracking.steps import StepBatch
from otel_tracking.values import decode_others, encode_others

ITEM_KINDS = ("metrics", "spans", "logs")
# Beyond the finish deadline: for the child to close its backends and answer, and for the
# training process to wait for that answer before it stops the child.
GRACE_S = 10.0


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
