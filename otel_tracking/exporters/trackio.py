"""Trackio tracker: a local (or Space/server) Trackio run, as the reference opened and fed it.

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
* finished spans: ``{"timing_s/state/<name>": seconds}`` (and ``.../slowest`` for a phase several
  lanes ran) once per step at the spans' ``ml.step`` (``timings.StepTimings``);
* each row's time: when its ``log()`` ran (a timing's: its phase's end), not when Trackio's sender
  wrote it (see ``compat/trackio_internals.py``);
* validation generations: ``{"val/generations": [trackio.Trace, ...]}`` at the event's step, one
  trace per sample built exactly as the reference's ``log_generations_to_trackio`` did (Trackio
  keeps them in its ``traces`` table), and in the same row ``val/generations_table``, a
  ``trackio.Table`` with columns ``step, sample, input, output, score``: Trackio's Traces page has
  fixed columns and shows a trace's metadata (the score) only in its detail view, while its Media
  page shows a table's columns;
* the DAPO filtered-reward table: nothing (the reference's table logger is wandb-only).

The exporters call the session's ``Run`` object directly, not ``trackio.log``: Trackio finds its
current run through a context variable, which another thread (a sink's queue thread) does not
see.  ``finish`` ends the run and returns only when Trackio's sender thread has written everything
to its sqlite database.

Trackio reads ``TRACKIO_DIR`` once, when it is first imported: the tracker hands the context's value
to Trackio if Trackio is not imported yet, and warns (and reports the real directory) otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from otel_tracking.compat.trackio_internals import drain, probe, queue_row, stamp_last_row
from otel_tracking.exporters._base import (
    AlertLimit,
    Event,
    SinkParts,
    StepRecord,
    TrackerContext,
    TrackerSession,
    stall_summary,
    stall_title,
    tracker_exporters,
)
from otel_tracking.exporters.timings import PhaseTiming
from otel_tracking.signals.redact import scrubbed_logger
from otel_tracking.signals.semconv import GENERATIONS_EVENT, STALL_EVENT

logger = scrubbed_logger("otel_tracking.exporters.trackio")

GENERATIONS_KEY = "val/generations"
GENERATIONS_TABLE_SUFFIX = "_table"  # val/generations_table: the same samples with the score as a column
GENERATIONS_COLUMNS = ["step", "sample", "input", "output", "score"]
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


def generations_table(trackio: Any, samples: Sequence[Any], step: int) -> Any:
    """The samples as one ``trackio.Table`` (a row each), read as :func:`generation_traces` reads them."""
    rows = []
    for index, sample in enumerate(samples):
        if len(sample) >= 3:
            rows.append([step, index, str(sample[0]), str(sample[1]), sample[2]])
        else:
            rows.append([step, index, str(sample), "", None])
    return trackio.Table(columns=GENERATIONS_COLUMNS, data=rows)


class TrackioSession(TrackerSession):
    """One Trackio run, shared by a process's metric, span and log exporters."""

    def __init__(self, context: TrackerContext) -> None:
        self.trackio = _import_trackio(context.env)
        from trackio import context_vars, utils

        run = context_vars.current_run.get()
        if run is None:
            config = context.config if isinstance(context.config, dict) or context.config is None else None
            # A resumed run (or replay) continues the Trackio run of the same project and name.
            resume = "allow" if context.continuing or context.resume else "never"
            run = self.trackio.init(
                project=context.project, name=context.experiment, config=config, embed=False, resume=resume
            )
        self.run = run
        self._row_times, self._queue_rows = probe(run, logger)
        self.directory = str(utils.TRACKIO_DIR)
        place = getattr(self.run, "url", None) or self.directory
        self.where = f"trackio project {self.run.project!r}, run {self.run.name!r} in {place}"
        self.resume = {"project": str(self.run.project), "name": str(self.run.name)}
        self.closed = False
        self._lock = threading.Lock()
        self.alerts = AlertLimit()  # stall alerts reach a webhook: never a flood

    @classmethod
    def open(cls, context: TrackerContext) -> TrackioSession:
        """The run of exporters built with no arguments, which say where it is (``open_tracker``
        leaves that to the end-of-run summary)."""
        session = cls(context)
        print(f"Logging to {session.where}")
        return session

    def log(self, data: dict[str, Any], step: int, time_unix_nano: int = 0) -> None:
        """One Trackio row at ``step``, timed at ``time_unix_nano`` (when the data was logged) when
        given and this Trackio keeps row times (``compat/trackio_internals.py``), else when Trackio writes it."""
        if self.closed:
            raise RuntimeError(f"the trackio run {self.run.name!r} is finished")
        stamp = _row_stamp(time_unix_nano) if time_unix_nano and self._row_times else None
        if self._queue_rows and queue_row(self.run, data, step, stamp):
            return
        self.run.log(data, step=step)  # an empty dict still makes a row, as the reference's did
        if stamp:
            stamp_last_row(self.run, stamp)

    def write_step(self, record: StepRecord) -> bool:
        data: dict[str, Any] = dict(record.scalars)
        data.update(record.others)
        self.log(data, record.step, record.time_unix_nano)
        return True

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        self.log({key: seconds}, step)
        return True

    def write_timings(self, timings: Sequence[PhaseTiming]) -> bool:
        for timing in timings:  # each row at the end of its phase's last span
            self.log(timing.scalars(), timing.step, timing.last_end_ns)
        return True

    def write_event(self, event: Event) -> bool:
        """Validation generations as Trackio traces; a stall report as a Trackio alert (WARN: the
        dashboard shows it, a configured webhook posts it to Slack or Discord); other events have
        no Trackio form here."""
        if event.name == STALL_EVENT:
            step = self.last_step if event.step is None else event.step
            from trackio.alerts import AlertLevel

            with self._lock:
                if self.alerts.allow(str(event.attributes.get("ml.phase"))):  # else held back, counted
                    text = self.alerts.text(stall_summary(event))
                    self.run.alert(title=stall_title(event), text=text, level=AlertLevel.WARN, step=step)
            return True
        if event.name != GENERATIONS_EVENT:
            return True
        step = self.last_step if event.step is None else event.step
        samples = list(event.body.get("samples") or [])
        traces = generation_traces(self.trackio, samples)
        if traces:
            key = GENERATIONS_KEY if event.key is None else event.key
            table = generations_table(self.trackio, samples, step)
            self.log({key: traces, key + GENERATIONS_TABLE_SUFFIX: table}, step, event.time_unix_nano)
        return True

    def finish(self, exit_code: int = 0) -> None:  # Trackio has no run status to set
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
        drain(run, _DRAIN_TIMEOUT_S)


def _row_stamp(time_unix_nano: int) -> str:
    return datetime.fromtimestamp(time_unix_nano / 1e9, tz=timezone.utc).isoformat()


EXPORTERS = tracker_exporters("Trackio", TrackioSession, __name__)
TrackioMetricExporter, TrackioSpanExporter, TrackioLogExporter = EXPORTERS.metrics, EXPORTERS.spans, EXPORTERS.logs


def open_tracker(context: TrackerContext) -> SinkParts:
    return EXPORTERS.parts(TrackioSession(context))


__all__ = [
    "TrackioLogExporter",
    "TrackioMetricExporter",
    "TrackioSession",
    "TrackioSpanExporter",
    "generation_traces",
    "generations_table",
    "open_tracker",
]
