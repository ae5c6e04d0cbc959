"""A run: the OTel wiring and lifecycle behind one ``Tracking`` object.

It owns the run's Resource, its sinks (the ML backends, each log() call handed to them once, as
one ``StepBatch``), the OTLP path (periodic gauges, batch-exported spans and logs), a
TracerProvider and LoggerProvider of its own (built here, per process, never installed globally),
and the shutdown order:

1. end the OTLP periodic metric export (one last export of the final values);
2. flush and shut down the span and log providers (pending spans and records reach every sink);
3. deliver what each sink's log or queue still holds while its backend makes progress (what a
   backend that delivered nothing for ``OTEL_TRACKING_FINISH_TIMEOUT`` still holds is spooled,
   never lost);
4. finish each sink: shut down its exporters, end the backend's run with the exit code.

``finish()`` is idempotent.  A run that was not finished is finished at interpreter exit, and on
SIGTERM (``lifecycle.py``); the step roots of the driver are ``step_roots.py``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, Tracer, get_current_span, set_span_in_context

from otel_tracking.compat.otel_sdk import LoggerProvider, SeverityNumber, enabled_despite_sdk_disabled
from otel_tracking.config.resource import build_resource
from otel_tracking.config.resume import RunRecord, record_name
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.pipeline import (
    Sink,
    SinkLogProcessor,
    SinkSpanProcessor,
    export_to,
    finish_sinks,
    flush_sinks,
    periodic_export,
)
from otel_tracking.delivery.scrubbing import ScrubbingLogProcessor, ScrubbingSpanProcessor
from otel_tracking.delivery.spool import sink_spool
from otel_tracking.runtime import lifecycle, stalls
from otel_tracking.runtime.anatomy import Anatomy, StepAnatomy, StepTrace
from otel_tracking.runtime.anatomy import gauges as anatomy_gauges
from otel_tracking.runtime.anatomy import measured as anatomy_measured
from otel_tracking.runtime.held_spans import HeldSpans
from otel_tracking.runtime.stall_report import Stall, stall_line, starting_line
from otel_tracking.runtime.stalls import StallWatch
from otel_tracking.runtime.step_roots import StepRoots
from otel_tracking.runtime.thread_parents import ThreadParents
from otel_tracking.signals import semconv
from otel_tracking.signals.carrier import extract_env, has_span, step_from, with_identity
from otel_tracking.signals.ids import ID_GENERATOR
from otel_tracking.signals.redact import scrub_strings, scrub_value
from otel_tracking.signals.semconv import ENDED_BY
from otel_tracking.signals.steps import LatestValues, StepBatch, labelled_gauge
from otel_tracking.signals.values import checked_others, split_values, step_as_logged, to_step

logger = logging.getLogger("otel_tracking")

# The sinks whose lines are verl's format, one per log() call (scripts parse them): the step's
# anatomy is not a line there (the file sink has it in its events file, as an ml.step.anatomy record).
VERL_LINES = ("file", "console")


# Unfinished runs, oldest first; a run leaves at finish().  Held strongly: a Tracking dropped
# without finish() keeps its run until the exit hook finishes it (no work in GC finalizers).
_active_runs: list[Run] = []
_active_lock = threading.Lock()


def current_run() -> Run | None:
    """The most recently started run of this process that is not finished."""
    with _active_lock:
        for run in reversed(_active_runs):
            if not run.finished and run.pid == os.getpid():
                return run
    return None


_driver_finished_pid: int | None = None  # this process's Tracking run finished (spans.py's rule)
_said_not_recorded = False  # since that finish()


def refuse_span_after_finish(name: str) -> bool:
    """Whether a span starting now is refused: a ``Tracking`` run of this process has finished and
    no run is open, so it belongs to no run (``spans.py``).  The first refused span after each
    ``finish()`` says so in one warning."""
    global _said_not_recorded
    if _driver_finished_pid != os.getpid() or current_run() is not None:
        return False
    if not _said_not_recorded:
        _said_not_recorded = True
        logger.warning(
            "otel-tracking: trace_state(%r) after this process's Tracking run finished is not recorded, nor are "
            "later ones until a new Tracking starts (a span belongs to a run)",
            name,
        )
    return True


STRAY_FINISH_S = 5.0  # at most this long, a new Tracking() waits for the worker run it replaces


def _end_stray_worker_runs() -> None:
    """A ``Tracking`` starts in a process that built a worker run before it (a ``trace_state``
    before ``Tracking()``): that run is finished now, its spans delivered or spooled as a worker
    run's are, so that one run is open and every later span is the driver's."""
    pid = os.getpid()
    with _active_lock:
        strays = [r for r in _active_runs if r.process_worker and r.pid == pid and not r.finished]
    for stray in strays:
        timeout_s = min(STRAY_FINISH_S, stray.settings.finish_timeout_s)
        stray.settings = dataclasses.replace(stray.settings, finish_timeout_s=timeout_s)
        stray.finish()


def inherited_identity() -> dict[str, str]:
    """The identity of the newest unfinished run this process inherited through ``fork()`` (a
    DataLoader worker, a forked helper): its spans belong to that run."""
    with _active_lock:
        for run in reversed(_active_runs):
            if not run.finished and run.pid != os.getpid():
                return dict(run.identity)
    return {}


def start_record(settings: Settings, sinks: Sequence[Sink]) -> RunRecord:
    """The reattach record of this attempt (``resume.py``), written now and whenever a tracker
    opens: a job killed at any point after ``Tracking()`` leaves one that a restart can use."""
    previous = settings.resumed.backends if settings.resumed is not None else None
    record = RunRecord(
        settings.spool_dir / record_name(settings.rank),
        settings.project,
        settings.experiment,
        settings.run_id,
        settings.attempt,
        settings.rank,
        previous,
    )
    if settings.spool_writable is not False and not record.write():  # (unwritable: said already)
        logger.warning(
            "otel-tracking: cannot write %s; a restarted job will not be able to resume this run", record.path
        )
    for sink in sinks:
        record.set_backend(sink.name, sink.resume)
        sink.on_resume = record.set_backend
    return record


class Run:
    def __init__(
        self,
        settings: Settings,
        sinks: Sequence[Sink],
        otlp_sinks: Mapping[str, Sink] | None = None,
        periodic_sinks: Sequence[Sink] = (),
        driver: bool = True,
    ) -> None:
        """``sinks`` get every log() call; ``otlp_sinks`` ("metrics"/"traces"/"logs") and
        ``periodic_sinks`` are observability exporters: spans and log records as they end, gauges
        as a periodic export of the latest values.  A ``driver`` run (the one ``Tracking`` builds)
        roots each step's trace in a step span; a worker run (see ``distributed/worker.py``) continues the
        traces handed to it and leaves the process's signal handlers alone."""
        self.settings = settings
        self.driver = driver
        self.process_worker = False  # the run distributed/worker.py builds for a process without Tracking
        self.identity = {
            semconv.PROJECT: settings.project,
            semconv.EXPERIMENT: settings.experiment,
            semconv.RUN_ID: settings.run_id,
        }
        if settings.attempt > 1:  # workers' resources say the attempt too (a fresh run's baggage is unchanged)
            self.identity[semconv.RUN_ATTEMPT] = str(settings.attempt)
        self.pid = os.getpid()
        self.resource = build_resource(settings)
        self.sinks = list(sinks)
        self.finished = False
        # Called once with the counts when the run has finished, by finish() or the exit hook
        # (the facade prints its summary there).
        self.on_finished: Callable[[dict[str, dict[str, int]]], None] | None = None
        self.last_step: int | None = None
        self._finish_lock = threading.Lock()
        self._env_context = None if driver else extract_env(settings.env)
        # trace_state spans not ended yet, each with the thread that opened it (dict set and pop:
        # atomic); watched for stalls (stalls.py)
        self.open_spans: dict[Span, int] = {}
        # which phase a pool thread's phase hangs under (thread_parents.py)
        self.thread_parents = ThreadParents()
        after = settings.stall_after_s
        self.stalls = StallWatch(after, settings.stall_floor_s, self._report_stall, self._say_starting)
        # A worker's parent_context() depends on nothing but the context it is given (contexts are
        # immutable): the last (given, result) pair is kept, so that a worker's spans, which start
        # from the same context over and over, do not rebuild the same baggage every time.
        self._worker_parent: tuple[Context, Context] | None = None
        self._identity_context: tuple[Context, int | None, Context] | None = None
        otlp_sinks = dict(otlp_sinks or {})
        self.periodic_sinks = list(periodic_sinks)  # the OTEL_*_EXPORTER sinks that take gauges each interval
        self.observability_sinks = [*otlp_sinks.values(), *periodic_sinks]
        for sink in self.all_sinks:
            sink.start(sink_spool(sink, settings, self.pid), sink.policy or settings.delivery)
        self.record: RunRecord | None = None
        if driver:  # what a restarted job needs to continue this run (OTEL_TRACKING_RESUME)
            self.record = start_record(settings, self.sinks)

        metric_sinks = [s for s in (otlp_sinks.get("metrics"), *periodic_sinks) if s is not None]
        self._latest = LatestValues() if metric_sinks else None
        interval_s = settings.otlp.metric_interval_s
        self._periodic = [periodic_export(sink, self._snapshot, interval_s) for sink in metric_sinks]

        self.tracer_provider = TracerProvider(resource=self.resource, shutdown_on_exit=False, id_generator=ID_GENERATOR)
        to_sinks, logs_to_sinks = SinkSpanProcessor(self.all_sinks), SinkLogProcessor(self.all_sinks)
        # the driver holds the spans (and records) of a step that may be the previous one logged
        # again (held_spans.py)
        held = HeldSpans(to_sinks, logs_to_sinks) if driver else None
        self.tracer_provider.add_span_processor(ScrubbingSpanProcessor(held or to_sinks))
        self.logger_provider = LoggerProvider(resource=self.resource, shutdown_on_exit=False)
        self.logger_provider.add_log_record_processor(ScrubbingLogProcessor(held.logs if held else logs_to_sinks))
        # OTEL_SDK_DISABLED turns off OTLP and the OTEL_*_EXPORTER sinks (settings.py decides); the
        # backends named in default_backend still get spans and events, so these providers must
        # not hand out no-op tracers and loggers as the SDK's would under that variable.
        for provider in (self.tracer_provider, self.logger_provider):
            enabled_despite_sdk_disabled(provider)
        self.tracer: Tracer = self.tracer_provider.get_tracer(semconv.SCOPE_NAME, semconv.SCOPE_VERSION)
        self.started_ns = time.time_ns()  # when the run began: its first step root starts here
        # Where each step went (anatomy.py): told of the driver's phases and calls, measured as each
        # step's root ends
        measures = driver and anatomy_measured(settings.anatomy)
        self.anatomy = StepAnatomy(settings.anatomy_buckets) if measures else None
        self._latest_anatomy: Anatomy | None = None
        # The roots that ended, by step, until the step is over (the next log() at another step,
        # flush, finish): a step logged again after a phase of its own has two
        self._ended_roots: dict[int, list[StepTrace]] = {}
        self._ended_lock = threading.Lock()
        on_ended = self._root_ended if self.anatomy is not None else None
        self.step_roots = StepRoots(self.tracer, started_ns=self.started_ns, on_ended=on_ended, held=held)
        self.event_logger = self.logger_provider.get_logger(semconv.SCOPE_NAME, semconv.SCOPE_VERSION)

        if driver:
            _end_stray_worker_runs()
        with _active_lock:
            _active_runs.append(self)
        if after != 0:
            stalls.watch(self, self._check_stalls)
        lifecycle.finish_at_exit(_finish_open_runs)
        if driver:
            lifecycle.finish_on_sigterm(_finish_open_runs, _flush_open_runs)

    @property
    def all_sinks(self) -> list[Sink]:
        return [*self.sinks, *self.observability_sinks]

    def _snapshot(self) -> Any:
        if self._latest is None or self.pid != os.getpid():  # the reader's thread restarts in a forked child
            return None
        return self._latest.snapshot(self.resource, self._phase_gauges())

    def _phase_gauges(self) -> list[Any]:
        """The last step's anatomy, and for alerting rules: each open phase's age and stall bound
        (``ml_phase_open_seconds > ml_phase_stall_bound_seconds`` in Prometheus; ``stalls.py``)."""
        anatomy = self._latest_anatomy
        found = [] if anatomy is None else anatomy_gauges(anatomy, time.time_ns())
        return found + self._stall_gauges()

    def _stall_gauges(self) -> list[Any]:
        if self.settings.stall_after_s == 0:
            return []
        now_ns = time.time_ns()
        phases = self.stalls.open_phases(self.open_spans, now_ns)
        if not phases:
            return []
        # the open spans' own names, not yet scrubbed as their spans will be on the way out
        ages: dict[str, float] = {}
        bounds: dict[str, float] = {}
        for name, (open_s, bound) in phases.items():
            label = scrub_value(name)
            ages[label], bounds[label] = max(open_s, ages.get(label, 0.0)), bound
        age_about = "how long the phase's oldest open span has been open"
        return [
            labelled_gauge("ml.phase.open", "s", age_about, semconv.PHASE, ages, now_ns),
            labelled_gauge("ml.phase.stall_bound", "s", "how long it may stay open", semconv.PHASE, bounds, now_ns),
        ]

    # --- where spans hang ------------------------------------------------------------------------

    def step_in_progress(self, ctx: Context | None = None) -> int | None:
        """The step a span starting now belongs to: on the driver, one more than the last logged step
        (phases run before the log() that closes their step; None before the first log(): the step's
        root says it once logged); in a worker, the step the caller's baggage names."""
        if self.driver:
            return None if self.last_step is None else self.last_step + 1
        return step_from(ctx)

    def parent_context(self, ctx: Context, said_step: int | None = None) -> Context:
        """The context for a span that starts outside any other span (``ctx`` has none), with this
        run's identity in its baggage: on the driver, under the step's root (``step_roots.py``;
        ``said_step`` is the span's own ``step=``); in a worker, the trace its environment names
        (TRACEPARENT)."""
        if not self.driver:
            cached = self._worker_parent
            if cached is not None and cached[0] is ctx:
                return cached[1]
            given = ctx
            if self._env_context is not None and not has_span(ctx):
                ctx = self._env_context
            ctx = with_identity(self.identity, self.step_in_progress(ctx), ctx)
            self._worker_parent = (given, ctx)  # holds ``given``: its id cannot be reused meanwhile
            return ctx
        ctx = self.step_roots.context_for(ctx, self.step_in_progress(), said_step)
        return with_identity(self.identity, self.step_in_progress(ctx), ctx)

    def context_to_carry(self, ctx: Context) -> Context:
        """``ctx`` for a carrier to another process: on the driver, a step's trace it names keeps
        its id from now on, and one already merged into a step's trace names that trace
        (``step_roots.py``)."""
        if not self.driver:
            return ctx
        span_context = get_current_span(ctx).get_span_context()
        moved = self.step_roots.carrier_taken(span_context.trace_id)
        if moved is None:
            return ctx
        flags, state = span_context.trace_flags, span_context.trace_state
        moved_context = SpanContext(moved, span_context.span_id, False, trace_flags=flags, trace_state=state)
        return set_span_in_context(NonRecordingSpan(moved_context), ctx)

    def with_identity(self, step: int | None, ctx: Context) -> Context:
        """``ctx`` with this run's identity and ``step`` as baggage (``signals/carrier.py``): made once
        per context and step, as every span of a phase (a worker's call) starts in the same one."""
        cached = self._identity_context
        if cached is not None and cached[0] is ctx and cached[1] == step:
            return cached[2]
        out = with_identity(self.identity, step, ctx)
        self._identity_context = (ctx, step, out)  # holds ``ctx``: its id cannot be reused meanwhile
        return out

    # --- the hot path ----------------------------------------------------------------------------

    def log(self, data: Mapping[str, Any], step: Any, backends: Sequence[str] | None = None) -> None:
        # Every value is checked against what the sinks can write before anything is recorded;
        # bad input gets its error even after finish().
        given_step, step = step, to_step(step)
        scalars, others, as_logged = split_values(data)
        others_json = None
        if others:  # strings, however nested, scanned for credentials (numbers never are)
            try:
                others = scrub_strings(others)
            except RecursionError:  # a value that contains itself: the check below names its key
                checked_others(others)
                raise
            others_json = checked_others(others)
        if self.finished:
            self._warn_logged_after_finish(step)
            return
        if self.pid != os.getpid():  # a forked child must not re-export its parent's run
            _warn_forked_once()
            return
        now = time.time_ns()
        if self.driver:
            # The step before ends here, and its anatomy goes out before this step's values: a
            # tracker that keeps steps monotonic (wandb) takes it at its own step.
            self.step_roots.step_logged(step, now)
            if self.anatomy is not None:
                self._measure_steps(but=step)
        targets = self.sinks if backends is None else [s for s in self.sinks if s.name in backends]
        if targets:
            # One compact StepBatch for every sink: step exporters take its record directly, any
            # other metric exporter gets the MetricsData built from it (in its queue thread, if queued).
            order = tuple(data) if scalars and others else None  # the file sink writes the caller's order
            batch = StepBatch(
                self.resource, step, scalars, others, now, order, others_json, as_logged, step_as_logged(given_step)
            )
            export_to(targets, "metrics", batch)
        if self._latest is not None:
            self._latest.update(step, scalars, now)
        self.last_step = step

    _said_logged_after_finish = False

    def _warn_logged_after_finish(self, step: int) -> None:
        """A ``log()`` after the run ended is not recorded, and says so once (a thread that still
        trains after ``finish()``, or after the exit hook ended the run)."""
        if not self._said_logged_after_finish:
            self._said_logged_after_finish = True
            logger.warning(
                "otel-tracking: log() at step %s after run %s finished is not recorded, nor is any later one",
                step,
                self.settings.run_id,
            )

    def observe(self, data: Mapping[str, Any], step: Any) -> None:
        """Numbers for the observability path only (OTLP gauges), as ``RLInsightLogger.log`` sends
        them.  The training loop's step is the driver's: ``last_step`` (what the next phase is
        stamped with), the step's root span and the ``train.step`` gauge stay as ``log()`` left
        them.  A run of its own (no ``Tracking``) has no other step: there ``train.step`` follows."""
        step = to_step(step)
        scalars, _, _ = split_values(data)
        if self.finished or self.pid != os.getpid() or self._latest is None:
            return
        self._latest.update(None if self.driver else step, scalars, time.time_ns())

    def emit_event(self, event_name: str, body: Any, attributes: Mapping[str, Any] | None = None) -> None:
        if self.finished or self.pid != os.getpid():
            return
        # Scrubbed on the way out (delivery/scrubbing.py): generations are model text, yet an
        # agent's prompt can carry a tool's key.
        self.event_logger.emit(event_name=event_name, body=body, attributes=attributes or {}, timestamp=time.time_ns())

    # --- step anatomy ----------------------------------------------------------------------------

    def _root_ended(self, step: int | None, trace: StepTrace) -> None:
        """A step's root ended (step_roots.py): kept until its step is over (``_measure_steps``)."""
        if self.anatomy is None:
            return
        if step is None:  # never logged: no step to show it at
            self.anatomy.step_ended(None, [trace])
            return
        with self._ended_lock:
            self._ended_roots.setdefault(step, []).append(trace)

    def _measure_steps(self, but: int | None = None) -> None:
        """The anatomy of each step over (every step whose root ended, but ``but``, the step being
        logged) goes to the sinks at its step: to the trackers as values of that step, and to the
        file sink's events file (its metrics file and the console keep verl's one line per log())."""
        if self.anatomy is None or self.pid != os.getpid():
            return
        late = self.step_roots.unended_before(but) if but is not None else []
        with self._ended_lock:
            due = {step: traces for step, traces in self._ended_roots.items() if step != but}
            for step in due:
                del self._ended_roots[step]
        for step, trace in late:
            due.setdefault(step, []).append(trace)
        for step, traces in due.items():
            try:
                anatomy = self.anatomy.step_ended(step, traces)
            except Exception:  # the numbers are an extra: never the training loop's problem
                logger.exception("otel-tracking: measuring step %s's anatomy failed", step)
                continue
            if anatomy is not None:
                self._send_anatomy(anatomy, max(t.end_ns for t in traces))

    def _send_anatomy(self, anatomy: Anatomy, time_ns: int) -> None:
        self._latest_anatomy = anatomy
        values = anatomy.metrics()
        trackers = [sink for sink in self.sinks if sink.name not in VERL_LINES]
        export_to(trackers, "metrics", StepBatch(self.resource, anatomy.step, values, {}, time_ns))
        # (finish() measures the last steps before it shuts the log provider down)
        self.event_logger.emit(
            event_name=semconv.ANATOMY_EVENT, body=values, attributes={semconv.STEP: anatomy.step}, timestamp=time_ns
        )

    # --- stalls ----------------------------------------------------------------------------------

    def _check_stalls(self) -> float:
        """From the watcher thread (stalls.py): report the phases open past their bound."""
        if not self.finished and self.pid == os.getpid():
            self.stalls.check(self.open_spans)
        return self.stalls.smallest_bound_s()

    def _report_stall(self, stall: Stall) -> None:
        if self.finished or self.pid != os.getpid():
            return
        if self.driver:  # what ended of a stuck step reaches the trace UI now, not at its log()
            self.step_roots.stop_holding()
        self.event_logger.emit(
            event_name=semconv.STALL_EVENT,
            body=stall.stacks,
            attributes=stall.attributes(),
            severity_number=SeverityNumber.WARN,
            severity_text="WARN",
            context=set_span_in_context(stall.span),
            timestamp=time.time_ns(),
        )
        print(f"otel-tracking: {stall_line(stall, self.resource.attributes)}", file=sys.stderr, flush=True)

    def _say_starting(self, stall: Stall) -> None:
        """A phase that waits for ranks to start is not stuck: a line on stderr, no record, no alert."""
        if not self.finished and self.pid == os.getpid():
            print(f"otel-tracking: {starting_line(stall, self.resource.attributes)}", file=sys.stderr, flush=True)

    # --- the end ---------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0) -> dict[str, dict[str, int]]:
        """Flush everything in order and end every backend's run; returns per-sink counts.  A
        SIGTERM meanwhile (a scheduler's preemption while a slow backend drains) spools what is
        left at once, prints the summary, then raises ``SystemExit(143)`` (``lifecycle.py``)."""
        with lifecycle.finishing():
            stats = self._finish(exit_code)
        if lifecycle.sigterm_during_finish() and threading.current_thread() is threading.main_thread():
            raise SystemExit(128 + signal.SIGTERM)
        return stats

    def _finish(self, exit_code: int) -> dict[str, dict[str, int]]:
        with self._finish_lock:
            if self.finished:
                return self.stats()
            self.finished = True
        with _active_lock:
            if self in _active_runs:
                _active_runs.remove(self)
        stalls.unwatch(self)
        if self.pid != os.getpid():
            return self.stats()
        if self.driver:
            global _driver_finished_pid, _said_not_recorded
            _driver_finished_pid, _said_not_recorded = self.pid, False
        for periodic in self._periodic:
            periodic.shutdown(timeout_millis=10_000)
        # Spans still open (``with trace_state("fit"): ... finish()``) end here, saying so, rather
        # than after their sinks are gone; the step's root span last, after its children.
        for span in list(self.open_spans):
            span.set_attribute(ENDED_BY, "finish")
            span.end()
        self.open_spans.clear()
        self.step_roots.end_all(time.time_ns(), **{ENDED_BY: "finish"})
        self._measure_steps()
        for provider in (self.tracer_provider, self.logger_provider):
            try:
                provider.force_flush()
                provider.shutdown()
            except Exception:
                logger.exception("otel-tracking: flushing %s failed", type(provider).__name__)
        finish_sinks(self.all_sinks, exit_code, self.settings.finish_timeout_s)
        if self.record is not None:
            for sink in self.sinks:  # a tracker that opened late said how to reattach by now
                self.record.set_backend(sink.name, sink.resume)
            self.record.finished(exit_code)
        stats = self.stats()
        if self.on_finished is not None:
            try:
                self.on_finished(stats)
            except Exception:  # (a closed stderr at exit) the run is finished all the same
                logger.exception("otel-tracking: reporting the end of the run failed")
        return stats

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every sink's worker handled what was submitted so far (delivered, or spooled
        after its attempts); False if the timeout passed first."""
        deadline = time.monotonic() + timeout_s
        if self.driver and not self.finished:
            self.step_roots.retire_closed()  # a logged step's root goes out now (step_roots.py)
            self._measure_steps()  # and its anatomy
        self.tracer_provider.force_flush()
        self.logger_provider.force_flush()
        return flush_sinks(self.all_sinks, deadline)

    def stats(self) -> dict[str, dict[str, int]]:
        return {sink.name: sink.stats.as_dict() for sink in self.all_sinks}


_warned_fork = False


def _warn_forked_once() -> None:
    global _warned_fork
    if not _warned_fork:
        _warned_fork = True
        logger.warning(
            "otel-tracking: log() on a run inherited through fork() is ignored (the parent process owns "
            "that run and its exporters); create a Tracking in the child process instead"
        )


def _flush_open_runs(timeout_s: float) -> None:
    """Flush this process's open runs (SIGTERM that the application handles: its data made safe)."""
    deadline = time.monotonic() + timeout_s
    with _active_lock:
        runs = [run for run in _active_runs if not run.finished and run.pid == os.getpid()]
    for run in runs:
        try:
            run.flush(max(0.0, deadline - time.monotonic()))
        except Exception:
            logger.exception("otel-tracking: flushing the run on SIGTERM failed")


def _finish_open_runs(exit_code: int | None = None, max_timeout_s: float | None = None) -> None:
    """Finish this process's open runs, newest first (each leaves the list as it finishes)."""
    if exit_code is None:
        exit_code = lifecycle.exit_code_now()
    while (run := current_run()) is not None:
        if max_timeout_s is not None:
            timeout_s = min(max_timeout_s, run.settings.finish_timeout_s)
            run.settings = dataclasses.replace(run.settings, finish_timeout_s=timeout_s)
        run.finish(exit_code=exit_code)
