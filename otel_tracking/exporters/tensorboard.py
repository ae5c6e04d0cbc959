"""TensorBoard tracker: event files written with TensorBoard's own writer and protos; torch is not needed.

What lands where (the reference wrote the same through ``torch.utils.tensorboard.SummaryWriter``):

* directory: ``TENSORBOARD_DIR``, else ``tensorboard_log/<project>/<experiment>``; opening prints
  ``Saving tensorboard log to {dir}.`` as the reference did;
* each number of a ``log()`` call: a ``simple_value`` scalar (float32, as ``add_scalar`` stores it)
  under the key exactly as written, at the call's step; NaN and +/-inf are stored as they are;
  bools become 1.0/0.0.  All keys of one call share one event (the reference wrote one event per
  key; TensorBoard reads back the same tag/step/value either way);
* non-number values: skipped.  The reference passed them to ``add_scalar``, which raised on the
  first one and lost the rest of that step (a documented fix);
* finished spans: the scalars ``timing_s/state/<name>`` (and ``.../slowest`` for a phase run by
  several lanes) once per step, at the spans' ``ml.step`` (``timings.StepTimings``);
* validation generations: the reference's markdown text at the event's step, as
  ``SummaryWriter.add_text`` stores it: tag ``val/generations/text_summary``, a one-element
  ``DT_STRING`` tensor with plugin ``text`` (TensorBoard's Text tab shows it); the reference wrote
  it through a second writer into the same directory, we write it into the run's one event file;
* the DAPO filtered-reward table: nothing (the reference's table logger is wandb-only);
* config/params: nothing (the reference's TensorBoard adapter logged none).

A resumed run (``OTEL_TRACKING_RESUME``) writes a new event file into the same directory and, before
its first step, the ``SessionLog.START`` event that ``SummaryWriter(purge_step=s)`` writes, at
``s = c + 1`` (``c``: the checkpoint step it restarts from, ``config/resume.py``; without one, its
first step): TensorBoard's readers then drop what the earlier attempt wrote at steps ``>= s``
(``EventAccumulator``'s ``purge_orphaned_data``, on by default), so each (tag, step) after the
checkpoint shows the resumed job's value, and the checkpoint's own step keeps the killed job's.

The file is written with TensorBoard's own ``EventFileWriter`` (TensorBoard's record framing, its
file naming, and the class wandb's ``sync_tensorboard`` hooks, as the reference's SummaryWriter
used it), flushed after every write, so each export is in the file when it returns.  The writer's
background thread is TensorBoard's, not ours.  Neither torch nor TensorFlow is imported; as with
the reference's SummaryWriter, TensorBoard's file layer uses TensorFlow's ``gfile`` when
TensorFlow happens to be installed and its own stub otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from otel_tracking.compat.tensorboard_internals import checksums_in_c
from otel_tracking.config import paths
from otel_tracking.exporters._base import (
    Event,
    SinkParts,
    StepRecord,
    TrackerContext,
    TrackerSession,
    stall_markdown,
    tracker_exporters,
)
from otel_tracking.exporters.timings import PhaseTiming
from otel_tracking.signals.semconv import GENERATIONS_EVENT, STALL_EVENT

GENERATIONS_KEY = "val/generations"
# SummaryWriter.add_text(tag, ...) stores the text under "<tag>/text_summary".
TEXT_SUFFIX = "/text_summary"


def generations_text(samples: Sequence[Any], step: int) -> str:
    """The reference's markdown for one call of ``ValidationGenerationsLogger.log``."""
    parts = [f"**Generation Results - Step {step}**\n\n"]
    for i, sample in enumerate(samples):
        parts.append(f"### Sample {i + 1}\n")
        if len(sample) >= 3:
            parts.append(f"**Input:** {sample[0]}\n\n")
            parts.append(f"**Output:** {sample[1]}\n\n")
            parts.append(f"**Score:** {sample[2]}\n\n")
        else:
            parts.append(f"**Data:** {sample}\n\n")
        parts.append("---\n\n")
    return "".join(parts)


class TensorboardSession(TrackerSession):
    """One event file in one directory, shared by a run's metric, span and log exporters."""

    def __init__(
        self, directory: Path | str, purge_at_first_step: bool = False, checkpoint_step: int | None = None
    ) -> None:
        """``purge_at_first_step``: a resumed run; its first step written purges, on read, what
        earlier attempts wrote after ``checkpoint_step`` (else from that first step on)."""
        self.directory = Path(directory)
        self._purge_pending = purge_at_first_step
        self._checkpoint_step = checkpoint_step
        self.where = f"{self.directory.resolve()} (TensorBoard event file)"
        self.closed = False
        self._writer: Any = None  # tensorboard's EventFileWriter
        self._lock = threading.Lock()

    @classmethod
    def open(cls, context: TrackerContext) -> TensorboardSession:
        """The session; its event file is created by the first write (or :meth:`create_file`)."""
        directory = paths.tensorboard_dir(context.project, context.experiment, context.env)
        if context.in_bridge_process:
            checksums_in_c()
        return cls(directory, purge_at_first_step=context.continuing, checkpoint_step=context.checkpoint_step)

    def create_file(self) -> None:
        with self._lock:
            self._open()

    def _open(self) -> Any:
        if self.closed:
            raise RuntimeError(f"the TensorBoard session in {self.directory} is closed")
        if self._writer is None:
            # Looked up at open time, not imported by name: wandb's sync_tensorboard (used by the
            # vemlp_wandb backend, as in the reference) hooks this class to find the log directory.
            from tensorboard.summary.writer import event_file_writer

            self._writer = event_file_writer.EventFileWriter(str(self.directory))
        return self._writer

    def write_steps(
        self, records: Sequence[StepRecord], progress: Callable[[], None] = lambda: None
    ) -> list[StepRecord | None]:
        """Several steps, one event each, and one flush for them all (a flush a step was most of
        the time of a burst)."""
        for record in records:
            values = [scalar_value(key, value) for key, value in record.scalars.items()]
            self._purge_once(record)
            self.write(record.step, values, record.time_unix_nano / 1e9 if record.time_unix_nano else None, flush=False)
        with self._lock:
            self._open().flush()
        return [None] * len(records)

    def write(self, step: int, values: list[Any], wall_time: float | None = None, flush: bool = True) -> None:
        """One event holding ``values`` (``Summary.Value`` protos) at ``step``, flushed unless told not to."""
        if not values:
            return
        from tensorboard.compat.proto import event_pb2, summary_pb2

        event = event_pb2.Event(
            wall_time=wall_time or time.time(), step=step, summary=summary_pb2.Summary(value=values)
        )
        with self._lock:
            writer = self._open()
            writer.add_event(event)
            if flush:
                writer.flush()

    def _purge_once(self, record: StepRecord) -> None:
        """Before the first step of a resumed attempt (see the module's notes)."""
        if self._purge_pending:
            self._purge_pending = False
            purge = record.step if self._checkpoint_step is None else self._checkpoint_step + 1
            self.purge_from(purge, record.time_unix_nano / 1e9 if record.time_unix_nano else None)

    def purge_from(self, step: int, wall_time: float | None = None) -> None:
        """What ``SummaryWriter(purge_step=step)`` writes: readers drop earlier events at steps >= ``step``."""
        from tensorboard.compat.proto import event_pb2

        event = event_pb2.Event(
            wall_time=wall_time or time.time(),
            step=step,
            session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
        )
        with self._lock:
            writer = self._open()
            writer.add_event(event)
            writer.flush()

    def write_step(self, record: StepRecord) -> bool:
        # Numbers only: TensorBoard scalars have no place for strings, lists or None.
        values = [scalar_value(key, value) for key, value in record.scalars.items()]
        self._purge_once(record)
        self.write(record.step, values, record.time_unix_nano / 1e9 if record.time_unix_nano else None)
        return True

    def write_timing(self, step: int, key: str, seconds: float, wall_time: float | None = None) -> bool:
        self.write(step, [scalar_value(key, seconds)], wall_time)
        return True

    def write_timings(self, timings: Sequence[PhaseTiming]) -> bool:
        for timing in timings:  # each at the end of its phase's last span
            values = [scalar_value(key, seconds) for key, seconds in timing.scalars().items()]
            self.write(timing.step, values, timing.last_end_ns / 1e9)
        return True

    def write_event(self, event: Event) -> bool:
        """Validation generations and stall reports as TensorBoard text; other events have no
        TensorBoard form."""
        if event.name == STALL_EVENT:
            step = self.last_step if event.step is None else event.step
            phase = str(event.attributes.get("ml.phase", "?"))
            wall_time = event.time_unix_nano / 1e9 if event.time_unix_nano else None
            self.write(step, [text_value(f"ml.stall/{phase}", stall_markdown(event))], wall_time)
            return True
        if event.name != GENERATIONS_EVENT:
            return True
        step = self.last_step if event.step is None else event.step
        key = GENERATIONS_KEY if event.key is None else event.key
        samples = list(event.body.get("samples") or [])
        wall_time = event.time_unix_nano / 1e9 if event.time_unix_nano else None
        self.write(step, [text_value(key, generations_text(samples, step))], wall_time)
        return True

    def finish(self, exit_code: int = 0) -> None:
        with self._lock:
            self.closed = True
            if self._writer is not None:
                self._writer.close()
            self._writer = None


def scalar_value(tag: str, value: float) -> Any:
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary.Value(tag=tag, simple_value=float(value))


def text_value(tag: str, text: str) -> Any:
    """What ``SummaryWriter.add_text(tag, text)`` stores."""
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.text import plugin_data_pb2

    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="text", content=plugin_data_pb2.TextPluginData(version=0).SerializeToString()
        )
    )
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        string_val=[text.encode("utf-8")],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
    )
    return summary_pb2.Summary.Value(tag=tag + TEXT_SUFFIX, metadata=metadata, tensor=tensor)


EXPORTERS = tracker_exporters("Tensorboard", TensorboardSession, __name__)
(TensorboardMetricExporter, TensorboardSpanExporter, TensorboardLogExporter) = (
    EXPORTERS.metrics,
    EXPORTERS.spans,
    EXPORTERS.logs,
)


def open_tracker(context: TrackerContext) -> SinkParts:
    session = TensorboardSession.open(context)
    session.create_file()  # create the directory and the event file now, as SummaryWriter did
    print(f"Saving tensorboard log to {session.directory}.")
    return EXPORTERS.parts(session)


__all__ = [
    "TensorboardLogExporter",
    "TensorboardMetricExporter",
    "TensorboardSession",
    "TensorboardSpanExporter",
    "generations_text",
    "open_tracker",
]
