"""Trackio bridge: a local (or Space/server) Trackio run, as the reference opened and fed it.

What lands where:

* the run: ``trackio.init(project=<project>, name=<experiment>, config=<config>, embed=False)``,
  unless a Trackio run is already current in this context, which is then reused (as the reference
  did); the config is the run's config (secrets already redacted);
* each ``log()`` call: one ``run.log(data, step=step)`` with the numbers exactly as written (NaN and
  +/-inf included: Trackio stores them as ``"NaN"``/``"Infinity"``/``"-Infinity"`` and its readers
  turn them back into floats) and the non-number values as the file sink keeps them (strings,
  ``None``, lists and dicts are stored as JSON by Trackio, as when the reference passed them); key
  names are untouched, so Trackio's own renaming of reserved keys (``step`` -> ``__step``) applies
  as it did for the reference;
* each finished span: ``{"timing_s/state/<name>": seconds}`` at the span's ``ml.step``;
* validation generations: ``{"val/generations": [trackio.Trace, ...]}`` at the event's step, one
  trace per sample built exactly as the reference's ``log_generations_to_trackio`` did (Trackio
  keeps them in its ``traces`` table);
* the DAPO filtered-reward table: nothing (the reference's table logger is wandb-only).

The exporters call the session's ``Run`` object directly, not ``trackio.log``: Trackio finds its
current run through a context variable, which another thread (a delivery layer's worker) does not
see.  ``finish`` ends the run and returns only when Trackio's sender thread has written everything
to its sqlite database.

Trackio reads ``TRACKIO_DIR`` once, when it is first imported: the bridge hands the context's value
to Trackio if Trackio is not imported yet, and warns (and reports the real directory) otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.exporters._base import BridgeContext, BridgeParts, StepMetricExporter, StepRecord, span_timing
from otel_tracking.generations import GENERATIONS_EVENT, KEY_ATTRIBUTE, STEP_ATTRIBUTE

logger = logging.getLogger("otel_tracking.exporters.trackio")

GENERATIONS_KEY = "val/generations"
# How long finish() waits, beyond Trackio's own 30 s, for its sender thread before writing inline.
_DRAIN_TIMEOUT_S = 60.0


def _import_trackio(env: Mapping[str, str]) -> Any:
    wanted = env.get("TRACKIO_DIR")
    if "trackio" not in sys.modules and wanted and os.environ.get("TRACKIO_DIR") != wanted:
        # Trackio reads its directory from the process environment at import, and only then.
        os.environ["TRACKIO_DIR"] = wanted
    import trackio
    from trackio import utils

    if wanted and os.path.abspath(wanted) != os.path.abspath(str(utils.TRACKIO_DIR)):
        logger.warning(
            "trackio was imported with TRACKIO_DIR=%s before this run asked for %s; it keeps writing to %s",
            utils.TRACKIO_DIR,
            wanted,
            utils.TRACKIO_DIR,
        )
    return trackio


def generation_traces(trackio: Any, samples: Sequence[Any]) -> list[Any]:
    """The reference's ``log_generations_to_trackio`` traces, one per sample."""
    traces = []
    for index, sample in enumerate(samples):
        if len(sample) >= 3:
            input_text, output_text, score = sample[0], sample[1], sample[2]
        else:
            input_text, output_text, score = sample, "", None
        traces.append(
            trackio.Trace(
                messages=[
                    {"role": "user", "content": str(input_text)},
                    {"role": "assistant", "content": str(output_text)},
                ],
                metadata={"source": "validation_generations", "sample_index": index, "score": score},
            )
        )
    return traces


class TrackioSession:
    """One Trackio run, shared by a process's metric, span and log exporters."""

    def __init__(self, context: BridgeContext) -> None:
        self.trackio = _import_trackio(context.env)
        from trackio import context_vars, utils

        run = context_vars.current_run.get()
        if run is None:
            config = context.config if isinstance(context.config, dict) or context.config is None else None
            run = self.trackio.init(project=context.project, name=context.experiment, config=config, embed=False)
        self.run = run
        self.directory = str(utils.TRACKIO_DIR)
        self.last_step = 0  # the step of the latest log() call: spans without ml.step land there
        self.closed = False
        self.users = 0
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        place = getattr(self.run, "url", None) or self.directory
        return f"trackio project {self.run.project!r}, run {self.run.name!r} in {place}"

    def log(self, data: dict[str, Any], step: int) -> None:
        if self.closed:
            raise RuntimeError(f"the trackio run {self.run.name!r} is finished")
        self.run.log(data, step=step)  # an empty dict still makes a row, as the reference's did

    def finish(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        from trackio import context_vars

        run = self.run
        try:
            run.finish()
        finally:
            if context_vars.current_run.get() is run:
                context_vars.current_run.set(None)
        _drain(run)


def _drain(run: Any) -> None:
    """Trackio's finish() waits 30 s for its sender thread and then gives up, leaving queued rows
    unwritten; wait longer, then write what is left from this thread."""
    thread = getattr(run, "_local_sender_thread", None)
    if isinstance(thread, threading.Thread) and thread.is_alive():
        thread.join(_DRAIN_TIMEOUT_S)
    pending = getattr(run, "_queued_logs", None)
    flush_inline = getattr(run, "_flush_queues_inline", None)
    if pending and callable(flush_inline) and not (isinstance(thread, threading.Thread) and thread.is_alive()):
        flush_inline()


# --- one process-wide session for exporters built with no arguments (plain OTel SDK setups) ------

_shared_lock = threading.Lock()
_shared: TrackioSession | None = None


def _acquire_shared() -> TrackioSession:
    global _shared
    with _shared_lock:
        if _shared is None or _shared.closed:
            _shared = TrackioSession(BridgeContext.from_env())
            print(f"Logging to {_shared.where}")
        _shared.users += 1
        return _shared


def _release_shared(session: TrackioSession) -> None:
    with _shared_lock:
        session.users -= 1
        if session.users > 0:
            return
    session.finish()


class _Uses:
    def __init__(self, session: TrackioSession | None) -> None:
        self.owned = session is None
        self.session = _acquire_shared() if session is None else session
        self._released = False

    def release(self) -> None:
        if self.owned and not self._released:
            self._released = True
            _release_shared(self.session)


class TrackioMetricExporter(StepMetricExporter):
    def __init__(self, session: TrackioSession | None = None) -> None:
        super().__init__()
        self._uses = _Uses(session)
        self.session = self._uses.session

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            for record in self.records(metrics_data):
                self.write(record)
        except Exception as error:
            logger.debug("trackio: metrics export failed: %s", error)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def write(self, record: StepRecord) -> None:
        data: dict[str, Any] = dict(record.scalars)
        data.update(record.others)
        self.session.log(data, record.step)
        self.session.last_step = record.step

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._uses.release()


class TrackioSpanExporter(SpanExporter):
    def __init__(self, session: TrackioSession | None = None) -> None:
        self._uses = _Uses(session)
        self.session = self._uses.session

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            for span in spans:
                step, key, seconds = span_timing(span, self.session.last_step)
                self.session.log({key: seconds}, step)
        except Exception as error:
            logger.debug("trackio: span export failed: %s", error)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._uses.release()


class TrackioLogExporter(LogRecordExporter):
    """Validation generations as Trackio traces; other log records have no Trackio form here."""

    def __init__(self, session: TrackioSession | None = None) -> None:
        self._uses = _Uses(session)
        self.session = self._uses.session

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        try:
            for item in batch:
                record = item.log_record
                if record.event_name != GENERATIONS_EVENT:
                    continue
                attributes = record.attributes or {}
                raw = attributes.get(STEP_ATTRIBUTE)
                step = int(raw) if isinstance(raw, (int, float)) else self.session.last_step
                key = str(attributes.get(KEY_ATTRIBUTE, GENERATIONS_KEY))
                body = record.body if isinstance(record.body, dict) else {}
                traces = generation_traces(self.session.trackio, list(body.get("samples") or []))
                if traces:
                    self.session.log({key: traces}, step)
        except Exception as error:
            logger.debug("trackio: log export failed: %s", error)
            return LogRecordExportResult.FAILURE
        return LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._uses.release()


def open_bridge(context: BridgeContext) -> BridgeParts:
    session = TrackioSession(context)

    def finish(exit_code: int) -> None:
        session.finish()  # Trackio has no run status to set

    return BridgeParts(
        metrics=TrackioMetricExporter(session),
        spans=TrackioSpanExporter(session),
        logs=TrackioLogExporter(session),
        finish=finish,
        where=session.where,
    )


__all__ = [
    "TrackioLogExporter",
    "TrackioMetricExporter",
    "TrackioSession",
    "TrackioSpanExporter",
    "generation_traces",
    "open_bridge",
]
