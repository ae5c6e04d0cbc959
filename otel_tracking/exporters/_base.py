"""What every ML tracker shares: turning OTel data back into (step, key, value) records.

Trackers are OTel exporters whose every call is one attempt, done when it returns.  From the
otel-tracking facade they take a ``log()`` call as it is, a :class:`StepRecord` (``export_records``;
several at once, ``export_many``, for a tracker with a bulk path), never built into OTel metric
data; as plain metric exporters they work on any ``MetricsData``:

* one batch per ``log()`` call (``signals/steps.py``: what an older spool record decodes to), whose
  first metric is the step gauge ``train.step`` and whose other gauges are named exactly as the
  caller wrote the keys;
* from someone else's ``PeriodicExportingMetricReader``: then the step is the value of a
  ``train.step`` gauge if the app records one, else the number of exports so far.  A metric with
  several attribute sets becomes one key per set, ``name{k=v,...}``.  Histograms are skipped; sums
  and gauges are logged by value.

What waits, the retries of a failed export and what is kept for replay are the delivery layer's
(each tracker's log and its reader, ``delivery/reader.py``): an export makes one attempt and says
what did not land.
Within that attempt an exporter does what its tracker's API asks: MLflow's opens its run with
attempts of its own, sends a burst's points as several requests at once (a pool of lanes) and,
when the server refuses a batch as invalid, sends its items one by one so only the bad one is skipped.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    Sum,
)
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.compat.otel_sdk import LogRecordExporter, LogRecordExportResult
from otel_tracking.config import settings
from otel_tracking.exporters.timings import PhaseTiming, StepTimings
from otel_tracking.signals import semconv
from otel_tracking.signals.redact import scrubbed_logger
from otel_tracking.signals.semconv import STEP as STEP_ATTRIBUTE
from otel_tracking.signals.steps import OTHERS_ATTRIBUTE, STEP_METRIC, StepRecord
from otel_tracking.signals.values import decode_others

logger = scrubbed_logger()  # what it says is scrubbed (an endpoint or an error can quote credentials)


# Gauges only report what was set since the last collection under DELTA: in a plain SDK setup, a
# key logged every 10 steps must not reappear at every step.
def _delta_for_all() -> dict[type, AggregationTemporality]:
    from opentelemetry.sdk.metrics import (
        Counter,
        Histogram,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
        UpDownCounter,
    )

    from otel_tracking.compat.otel_sdk import sdk_gauge_class

    kinds = (
        Counter,
        UpDownCounter,
        Histogram,
        ObservableCounter,
        ObservableUpDownCounter,
        ObservableGauge,
        sdk_gauge_class(),
    )
    return dict.fromkeys(kinds, AggregationTemporality.DELTA)


@dataclass(frozen=True)
class TrackerContext:
    """What a tracker needs to open its backend's run.  ``config`` is already redacted; ``env`` is the
    environment mapping the run's settings were read from (trackers read their backend's own
    variables, e.g. WANDB_ENTITY, from it and from nowhere else)."""

    project: str
    experiment: str
    config: Any = None
    env: Mapping[str, str] = field(default_factory=dict)
    # Config values the tracker uses as they are (``run_config.RunConfig.inputs``: ``wandb_proxy``),
    # never to be recorded: ``config`` has them redacted.
    inputs: Mapping[str, str] = field(default_factory=dict)
    run_id: str | None = None
    # What to reattach to: from a spool header (replay), or from the previous attempt's record when a
    # resumed Tracking opens the tracker again (then ``continuing`` is True, even when the record has
    # nothing for this tracker: TensorBoard and the file sink need nothing but their directory).
    resume: Mapping[str, Any] | None = None
    attempt: int = 1  # ml.run.attempt of the run opening the tracker
    continuing: bool = False  # a restarted job continues its run: a live attempt, not a replay
    # When continuing: the step of the checkpoint it restarts from (config/resume.py); what the
    # killed job logged after it is superseded.  None: the step before the first one it logs.
    checkpoint_step: int | None = None
    # Opened in the bridge process, which the trackers share: its console is theirs (their own
    # messages), not the training script's.
    in_bridge_process: bool = False

    @classmethod
    def from_env(cls) -> TrackerContext:
        """For exporters built with no arguments by a plain OTel SDK setup."""
        project, experiment = settings.identity_from_env()
        return cls(project=project, experiment=experiment, env=os.environ)


@dataclass
class SinkParts:
    """One backend's exporters, sharing that backend's session, as ``open_tracker`` returns them."""

    metrics: MetricExporter | None = None
    spans: Any = None  # SpanExporter
    logs: Any = None  # LogRecordExporter
    finish: Callable[[int], None] | None = None  # ends the backend's run with the exit code
    where: str | None = None  # where the data went, for the end-of-run summary
    resume: dict[str, Any] | None = None  # what open_tracker needs (as context.resume) to reattach to this run
    # The backend did not answer at open (MLflow after its attempts): the run goes on without it,
    # and everything for it stays in its log for ``otel-tracking replay``, counted, never dropped unseen.
    unreachable: bool = False


def _series_key(name: str, attributes: Any) -> str:
    if not attributes:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(attributes.items())) + "}"


class StepMetricExporter(MetricExporter):
    """Base class of the ML trackers' metric exporters: subclasses implement :meth:`write`."""

    def __init__(self) -> None:
        super().__init__(preferred_temporality=_delta_for_all(), preferred_aggregation={})
        self._exports = itertools.count()

    def records(self, metrics_data: MetricsData) -> Iterator[StepRecord]:
        export_index = next(self._exports)
        for resource_metrics in metrics_data.resource_metrics:
            step: int | None = None
            record = StepRecord(step=0, scalars={})
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    data = metric.data
                    if not isinstance(data, (Gauge, Sum)):
                        continue
                    for point in data.data_points:
                        if step is None and metric.name == STEP_METRIC:
                            step = int(point.value)
                            record.time_unix_nano = point.time_unix_nano
                            others = point.attributes.get(OTHERS_ATTRIBUTE) if point.attributes else None
                            if others:
                                record.others = decode_others(str(others))
                            continue
                        record.scalars[_series_key(metric.name, point.attributes)] = point.value
                        record.time_unix_nano = record.time_unix_nano or point.time_unix_nano
            if step is None and not record.scalars:
                continue
            record.step = export_index if step is None else step
            yield record

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        return self.export_records(self.records(metrics_data))

    def export_records(self, records: Iterable[StepRecord]) -> MetricExportResult:
        """The records themselves: what ``export`` decodes from ``MetricsData``.  The facade hands
        its own step exporters the records of a ``log()`` call directly (``StepBatch.record``),
        skipping a ``MetricsData`` that would only be decoded back."""
        for record in records:
            self.write(record)
        return MetricExportResult.SUCCESS

    def write(self, record: StepRecord) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None


# --- the shape every ML tracker shares ---------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """A log record as trackers read it (see ``otel_tracking.api.generations`` for the event shapes)."""

    name: str
    step: int | None
    key: str | None
    body: Mapping[str, Any]
    attributes: Mapping[str, Any]
    time_unix_nano: int = 0
    text: str | None = None  # a body that is text (a stall report's stacks)

    @classmethod
    def from_log(cls, item: Any) -> Event:
        record = item.log_record
        attributes = dict(record.attributes or {})
        raw = attributes.get(STEP_ATTRIBUTE)
        step = int(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else None
        key = attributes.get(semconv.EVENT_KEY)
        body = record.body if isinstance(record.body, Mapping) else {}
        time_ns = record.timestamp or record.observed_timestamp or 0
        text = record.body if isinstance(record.body, str) else None
        name = record.event_name or ""
        return cls(name, step, str(key) if key is not None else None, body, attributes, time_ns, text)


def stall_summary(event: Event) -> str:
    """One line of a stall report (``ml.stall``, runtime/stalls.py): what, how long, where."""
    a = event.attributes
    said = (
        f"phase {a.get('ml.phase')} at step {a.get('ml.step', '?')} open {a.get('ml.stall.open_s')} s "
        f"(bound {a.get('ml.stall.bound_s')} s, report {a.get('ml.stall.report')}), in {a.get('ml.stall.frame')}"
    )
    spans = a.get("ml.stall.spans")
    if isinstance(spans, int) and spans > 1:
        said += f"; {spans} spans of it stuck"
    waiting = a.get("ml.stall.waiting_ranks")
    if waiting:
        count = a.get("ml.stall.waiting_count", len(waiting))
        more = f" ({count} in all)" if isinstance(count, int) and count > len(waiting) else ""
        said += f"; waiting for rank(s) {', '.join(map(str, waiting))}{more}"
    return said


def stall_markdown(event: Event) -> str:
    """A stall report as markdown: the summary, then every thread's stack as code."""
    stacks = "\n".join("    " + line for line in (event.text or "").splitlines())
    return f"**stall**: {stall_summary(event)}\n\n{stacks}"


def stall_title(event: Event) -> str:
    """An alert's title: ``stall: <phase> at step <N>`` (the phase scrubbed on its way out)."""
    a = event.attributes
    return f"stall: {a.get('ml.phase')} at step {a.get('ml.step', '?')}"


class AlertLimit:
    """How often a tracker may alert (its alerts reach Slack, email, a webhook): at most one alert
    per phase every ``per_phase_s``, and ``burst`` alerts in any ``window_s`` in all.  What it
    holds back is counted, and said by the next alert that goes out."""

    def __init__(self, per_phase_s: float = 600.0, burst: int = 10, window_s: float = 3600.0) -> None:
        self.per_phase_s = per_phase_s
        self.burst = burst
        self.window_s = window_s
        self.held_back = 0
        self._last: dict[str, float] = {}  # phase -> when its last alert went out (monotonic)
        self._sent: list[float] = []  # when the alerts of the last window went out

    def allow(self, phase: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self._sent = [t for t in self._sent if now - t < self.window_s]
        last = self._last.get(phase)
        if (last is not None and now - last < self.per_phase_s) or len(self._sent) >= self.burst:
            self.held_back += 1
            return False
        self._last[phase] = now
        self._sent.append(now)
        return True

    def text(self, text: str) -> str:
        """An alert's text, saying how many were held back before it (and counting afresh)."""
        if self.held_back:
            text += f" ({self.held_back} more stall alert(s) held back before this one: see the run's stall reports)"
            self.held_back = 0
        return text


class TrackerSession(ABC):
    """One backend run, shared by a tracker's metric, span and log exporters.

    Subclasses open the run (:meth:`open`) and implement the writes.  A write returns True when the
    backend took the data, or refused it for good (counted and warned about by the session: a retry
    could not change it); False when the backend failed and a retry or the spool may help.  One
    attempt per call: the retries, the pauses and what waits are the delivery layer's (a tracker's
    log and its reader).  Within the call a session may use threads of its own to send what the
    backend's API takes in parallel (MLflow's lanes), and must have them done when it returns.
    """

    last_step: int = 0  # the latest step written; spans without ``ml.step`` land there
    where: str = ""  # for the end-of-run summary
    resume: dict[str, Any] | None = None  # what ``open`` needs (as ``context.resume``) to reattach

    @classmethod
    @abstractmethod
    def open(cls, context: TrackerContext) -> TrackerSession: ...

    @abstractmethod
    def write_step(self, record: StepRecord) -> bool: ...

    def write_steps(
        self, records: Sequence[StepRecord], progress: Callable[[], None] = lambda: None
    ) -> list[StepRecord | None]:
        """Several steps, in order: for each, None when it landed, else what of it did not (the
        record itself when nothing did).  A backend with a bulk path (MLflow's ``log_batch`` of up
        to 1,000 metrics) packs them into few requests; by default one ``write_step`` each, and
        after a failure the rest wait (step order).  ``progress()`` says that part of them landed
        (a request, a step): the delivery layer's stall detector counts it as a delivery."""
        rests: list[StepRecord | None] = []
        for index, record in enumerate(records):
            if not self.write_step(record):
                return rests + list(records[index:])
            rests.append(None)
            progress()
        return rests

    @abstractmethod
    def write_timing(self, step: int, key: str, seconds: float) -> bool: ...

    def write_spans(self, spans: Sequence[Any]) -> bool:
        """The phase timings of the steps these spans close (see :class:`StepTimings`)."""
        return self.write_timings(self.step_timings.add(spans, self.last_step))

    def write_timings(self, timings: Sequence[PhaseTiming]) -> bool:
        """Each timing's scalars at its step; what the backend did not take is held again, to go
        with the next close or flush (a retried span export closes it again)."""
        failed = []
        for timing in timings:
            ok = True
            for key, seconds in timing.scalars().items():
                ok = self.write_timing(timing.step, key, seconds) and ok
            if not ok:
                failed.append(timing)
        self.step_timings.hold(failed)
        return not failed

    def flush_timings(self) -> bool:
        """Write every timing still held (the span exporter's flush and shutdown)."""
        return self.write_timings(self.step_timings.drain(self.last_step))

    @property
    def step_timings(self) -> StepTimings:
        # Made on first use: sessions do not call a base __init__.
        timings = self.__dict__.get("_step_timings")
        return timings if timings is not None else self.__dict__.setdefault("_step_timings", StepTimings())

    def write_event(self, event: Event) -> bool:
        return True  # by default a backend has no place for events

    @abstractmethod
    def finish(self, exit_code: int = 0) -> None: ...


class HighestStep:
    """For a session whose backend keeps each series in step order (ClearML, SwanLab): spans and
    generations without a step land at the highest step written so far, not at the latest."""

    _high_step = 0

    @property
    def last_step(self) -> int:
        return self._high_step

    @last_step.setter
    def last_step(self, step: int) -> None:
        self._high_step = max(self._high_step, step)


_E = TypeVar("_E", bound="_UsesSession")


class _SharedSessions:
    """Exporters built with no arguments (a plain OTel SDK setup builds each one separately) share
    one session per tracker and process, opened from the environment on first use and finished
    when the last of them shuts down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[type[TrackerSession], tuple[TrackerSession, int, int]] = {}  # session, users, pid

    def acquire(self, kind: type[TrackerSession]) -> TrackerSession:
        with self._lock:
            session, users, pid = self._open.get(kind, (None, 0, 0))
            # A forked child, or exporters built after the shared session was finished, open anew.
            if session is None or pid != os.getpid() or getattr(session, "finished", False):
                session, users, pid = kind.open(TrackerContext.from_env()), 0, os.getpid()
            self._open[kind] = (session, users + 1, pid)
            return session

    def release(self, kind: type[TrackerSession]) -> None:
        with self._lock:
            session, users, pid = self._open[kind]
            if users > 1:
                self._open[kind] = (session, users - 1, pid)
                return
            del self._open[kind]
        session.finish(0)


_shared = _SharedSessions()


class _UsesSession:
    """The session an exporter writes to: handed in by ``open_tracker``, or the shared one."""

    session_class: type[TrackerSession]

    def _use(self, session: TrackerSession | None) -> None:
        self._shared = session is None
        self.session = _shared.acquire(self.session_class) if session is None else session
        self._released = False

    def _release(self) -> None:
        if self._shared and not self._released:
            self._released = True
            _shared.release(self.session_class)

    def _guarded(self, what: str, write: Callable[[], bool]) -> bool:
        try:
            return write()
        except Exception as error:
            self._failed(what, error)
            return False

    def _failed(self, what: str, error: BaseException) -> None:
        # The first failure says why, once per exporter (in the bridge process too: its stderr
        # is the training process's); later ones are counted by the sink and logged at DEBUG.
        first = not getattr(self, "_said_why", False)
        self._said_why = True
        message = f"{type(error).__name__}: {error}"  # scrubbed by the logger
        if first:
            logger.warning("otel-tracking: %s: %s export failed: %s", type(self).__name__, what, message)
        logger.debug(
            "%s: %s export failed", type(self).__name__, what, exc_info=(type(error), error, error.__traceback__)
        )


class TrackerMetricExporter(_UsesSession, StepMetricExporter):
    def __init__(self, session: TrackerSession | None = None) -> None:
        StepMetricExporter.__init__(self)
        self._use(session)

    def export_records(self, records: Iterable[StepRecord]) -> MetricExportResult:
        ok = True
        for record in records:
            ok = self._guarded("metrics", lambda r=record: self.session.write_step(r)) and ok  # type: ignore[misc]
            self.session.last_step = record.step
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def export_many(
        self, records: Sequence[StepRecord], progress: Callable[[], None] = lambda: None
    ) -> list[StepRecord | None]:
        """Several log() calls at once (``TrackerSession.write_steps``): for each, None when it
        landed, else what of it did not, for the delivery layer to retry or spool (only that)."""
        try:
            rests = self.session.write_steps(records, progress)
        except Exception as error:
            self._failed("metrics", error)
            rests = list(records)
        for record in records:
            self.session.last_step = record.step
        return rests

    def write(self, record: StepRecord) -> None:
        if not self.session.write_step(record):
            raise RuntimeError(f"{type(self).__name__}: the backend did not take step {record.step}")

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._release()


class TrackerSpanExporter(_UsesSession, SpanExporter):
    def __init__(self, session: TrackerSession | None = None) -> None:
        self._use(session)

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        ok = self._guarded("spans", lambda: self.session.write_spans(spans))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """The timings of steps not closed yet (the last step's, when no root span closes it)."""
        return self._guarded("spans", self.session.flush_timings)

    def shutdown(self) -> None:
        self.force_flush()
        self._release()


class TrackerLogExporter(_UsesSession, LogRecordExporter):
    def __init__(self, session: TrackerSession | None = None) -> None:
        self._use(session)

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        ok = True
        for item in batch:
            event = Event.from_log(item)
            ok = self._guarded("logs", lambda e=event: self.session.write_event(e)) and ok  # type: ignore[misc]
        return LogRecordExportResult.SUCCESS if ok else LogRecordExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._release()


@dataclass(frozen=True)
class TrackerExporters:
    """A tracker's three OTel exporter classes, made by :func:`tracker_exporters`: what a plain SDK
    setup builds by name (the entry points), and what :meth:`parts` puts on one open session."""

    metrics: type[TrackerMetricExporter]
    spans: type[TrackerSpanExporter]
    logs: type[TrackerLogExporter]

    def parts(self, session: TrackerSession) -> SinkParts:
        """What a tracker's ``open_tracker`` returns: the three exporters on one session, and its end."""
        return SinkParts(
            metrics=self.metrics(session),
            spans=self.spans(session),
            logs=self.logs(session),
            finish=session.finish,
            where=session.where,
            resume=session.resume,
        )


def tracker_exporters(backend: str, shared: type[TrackerSession], module: str) -> TrackerExporters:
    """``<backend>MetricExporter``, ``...SpanExporter`` and ``...LogExporter``, defined as if written
    in ``module`` (their names and module are what entry points, warnings and pickles see).  Built
    with no arguments, they write to the process's ``shared`` session (:class:`_SharedSessions`)."""

    def make(base: type[_E], kind: str) -> type[_E]:
        name = f"{backend}{kind}Exporter"
        made: type[_E] = type(name, (base,), {"session_class": shared, "__module__": module, "__qualname__": name})
        return made

    return TrackerExporters(
        metrics=make(TrackerMetricExporter, "Metric"),
        spans=make(TrackerSpanExporter, "Span"),
        logs=make(TrackerLogExporter, "Log"),
    )


def sample_parts(sample: Any) -> list[Any]:
    """(input, output, score) of one validation sample: missing parts are None, extra parts dropped."""
    parts = list(sample) if isinstance(sample, (list, tuple)) else [sample]
    return [*parts, None, None, None][:3]


def hex_id(value: int | None, width: int) -> str | None:
    return None if value is None else format(value, f"0{width}x")


__all__: Sequence[str] = [
    "Event",
    "HighestStep",
    "SinkParts",
    "StepMetricExporter",
    "StepRecord",
    "TrackerContext",
    "TrackerExporters",
    "TrackerLogExporter",
    "TrackerMetricExporter",
    "TrackerSession",
    "TrackerSpanExporter",
    "hex_id",
    "sample_parts",
    "tracker_exporters",
]
