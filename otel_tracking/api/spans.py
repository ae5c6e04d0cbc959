"""``trace_state``: a training phase as a span.

    with trace_state("rollout", state_lane_id=rank, model="actor"):
        ...

    @trace_state("update")
    def update(...): ...          # sync or async functions

The span nests under whatever span is current (OTel context lives in contextvars, so each thread
and each asyncio task has its own nesting) and carries the lane as ``ml.lane`` and each label as
``ml.label.<name>``.  It is recorded by the most recent unfinished run of this process; in a
process without ``Tracking`` (a Ray worker, a rollout server) by the process's worker run
(``distributed/worker.py``: OTLP per the standard variables), unless the application installed a global
TracerProvider of its own, which then records it.

Outside a run on the driver: a span before ``Tracking()`` goes to the
process's worker run, as in any process without a ``Tracking`` (a process cannot know a
``Tracking`` will come), and ``Tracking()`` finishes that worker run when it starts; a span after
``finish()``, with no run open, is not recorded (one warning), until a new ``Tracking`` starts.

Where a span hangs when no span is current: on the driver, under the step's root span (one trace
per step, ``ml.step``: ``runtime/step_roots.py``); in a worker, under the trace it was handed
(``propagation.attach``, the Ray helpers, or ``TRACEPARENT`` in its environment).  The span's
``ml.step`` attribute is the step in progress: one more than the run's last logged step on the
driver (phases run before the ``log()`` that closes their step; none before the first ``log()``),
the step the caller's baggage names in a worker, or the ``step=`` label when one is given.
``weight_version=`` becomes ``ml.weight_version``; ``links=`` (carriers, contexts or spans) become
span links.  An exception inside the block marks the span as an error and propagates.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode

from otel_tracking.delivery.scrubbing import scrubbed_attributes
from otel_tracking.runtime.anatomy import Call, Phase, StepAnatomy
from otel_tracking.runtime.step_roots import StepRoot
from otel_tracking.runtime.thread_parents import in_pool_thread
from otel_tracking.signals.carrier import extract, has_span
from otel_tracking.signals.redact import scrub_text
from otel_tracking.signals.semconv import LABEL_PREFIX
from otel_tracking.signals.semconv import LANE as LANE_ATTRIBUTE
from otel_tracking.signals.semconv import STEP as STEP_ATTRIBUTE
from otel_tracking.signals.semconv import WEIGHT_VERSION as WEIGHT_VERSION_ATTRIBUTE
from otel_tracking.signals.values import to_step

F = TypeVar("F", bound=Callable[..., Any])


def _attribute_value(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        try:
            return _attribute_value(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


def state_attributes(state_lane_id: Any, labels: dict[str, Any]) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    if state_lane_id is not None:
        attributes[LANE_ATTRIBUTE] = _attribute_value(state_lane_id)
    for name, value in labels.items():
        attributes[LABEL_PREFIX + name] = _attribute_value(value)
    return attributes


class trace_state:
    """A training phase as a span: a context manager (``with``, ``async with``) or a decorator.

    The span nests under the span that is current; with none (the driver's loop), under the
    step's root span, so each step is one trace.  The trackers also get, once per step,
    ``timing_s/state/<state_name>``: the phase's wall time.  An exception inside the block
    marks the span as an error and propagates.  Costs a few microseconds a phase.

    Threads and tasks: an asyncio task copies its creator's context, so a phase it opens nests
    under the phase that created it.  A ``concurrent.futures.ThreadPoolExecutor`` thread (also
    ``loop.run_in_executor``'s) has no context of its own: a phase it opens with no span current
    nests under the phase open in the one other thread that is inside a phase (``pool.map(generate,
    ...)`` inside ``trace_state("rollout")``: each lane under ``rollout``).  When phases are open in
    several other threads it cannot tell which one handed the work out: the phase hangs under the
    step's root and one warning says so; submit ``contextvars.copy_context().run`` (or use
    ``asyncio.to_thread``) there.  A ``threading.Thread`` of your own is never nested this way.

    :param state_name: the phase's name, the span's name: ``"rollout"``, ``"update_actor"``.
        Must be a non-empty string.
    :param state_lane_id: who runs the phase (a rank, a replica, a worker name), recorded as
        ``ml.lane``; the timeline draws one row per lane and the step anatomy compares the lanes
        of a phase to name the straggler.  Default ``None``: no lane.
    :param labels: any other ``name=value``, recorded as the attribute ``ml.label.<name>``
        (strings, numbers, bools and lists of them as they are; other values as ``str()``).
        Three names are special: ``step=`` sets the span's ``ml.step`` (default: the step in
        progress), ``weight_version=`` sets ``ml.weight_version`` (which policy weights a rollout
        used), and ``links=`` takes a carrier dict, a span, a ``SpanContext`` or a ``Context``, or a
        list of them, recorded as span links (a rollout that serves another step than the one it
        runs in links to that step instead of hanging under it).

    Example:

    ```python
    from otel_tracking import trace_state

    with trace_state("rollout", state_lane_id=0, model="actor"):
        ...                                   # a span "rollout", ml.lane=0, ml.label.model="actor"

    @trace_state("update", weight_version=3)
    def update():                             # a fresh span for every call; async functions too
        ...
    ```
    """

    def __init__(self, state_name: str, state_lane_id: str | int | None = None, **labels: Any) -> None:
        if not isinstance(state_name, str) or not state_name:
            raise ValueError(f"trace_state needs a non-empty state name, got {state_name!r}")
        self.state_name = state_name
        """The span's name."""
        step = labels.pop("step", None)
        weight_version = labels.pop("weight_version", None)
        self.links = _links(labels.pop("links", None))
        """The span links ``links=`` asked for."""
        self.attributes = state_attributes(state_lane_id, labels)
        """The span's attributes: ``ml.lane``, ``ml.label.<name>``, ``ml.step``, ``ml.weight_version``."""
        if step is not None:
            self.attributes[STEP_ATTRIBUTE] = to_step(step)
        if weight_version is not None:
            self.attributes[WEIGHT_VERSION_ATTRIBUTE] = _attribute_value(weight_version)
        self._open: list[tuple[Span, object, Any, StepRoot | None, str | None, Any]] = []

    def _start(self) -> Span:
        ctx = otel_context.get_current()
        run = _late.current_run()
        if run is None and _late.refuse_span_after_finish(self.state_name):  # no run, and no stray worker run
            span: Span = trace.INVALID_SPAN
            self._open.append((span, otel_context.attach(trace.set_span_in_context(span, ctx)), None, None, None, None))
            return span
        if run is None:
            run = _late.worker_run(ctx)  # this process's worker run (built on first use)
        attributes = self.attributes
        root = None
        parents = None  # what the run's thread parents noted of this span
        handed_out_by = None  # a lane's phase: the step's anatomy compares the lanes of a phase
        if run is None:  # the application's own global TracerProvider (or the SDK is disabled)
            # Not a run's provider, so nothing scrubs on the way out (delivery/scrubbing.py): here.
            span = trace.get_tracer("otel_tracking").start_span(
                self.state_name, context=ctx, attributes=scrubbed_attributes(attributes) or attributes, links=self.links
            )
        else:
            thread = threading.get_ident()
            current = trace.get_current_span(ctx) if has_span(ctx) else None
            adopted = None
            if current is None and in_pool_thread():
                # a thread of a pool, handed work by a phase of another thread (runtime/thread_parents.py)
                adopted = run.thread_parents.parent_for(thread, self.state_name)
                if adopted is not None:
                    ctx = trace.set_span_in_context(adopted, ctx)
            if current is None and adopted is None:
                # the driver's step root, or the trace a worker was handed
                ctx = run.parent_context(ctx, attributes.get(STEP_ATTRIBUTE))
            elif LANE_ATTRIBUTE in attributes and run.anatomy is not None:
                handed_out_by = getattr(current or adopted, "name", None)
            if STEP_ATTRIBUTE not in attributes:
                step = _step_of(adopted) if adopted is not None else None
                step = run.step_in_progress(ctx) if step is None else step
                if step is not None:
                    attributes = {**attributes, STEP_ATTRIBUTE: step}
            span = run.tracer.start_span(self.state_name, context=ctx, attributes=attributes, links=self.links)
            # finish() ends what is still open, rather than losing it; the stall watcher looks at it
            run.open_spans[span] = thread
            parents = run.thread_parents.opened(span, thread, current, adopted is not None)
            root = run.step_roots.child_started(span) if run.driver else None
            # The run's identity travels in the baggage: propagate.inject() inside this span carries it.
            ctx = run.with_identity(attributes.get(STEP_ATTRIBUTE), ctx)
        token = otel_context.attach(trace.set_span_in_context(span, ctx))
        # One trace_state object may be entered again while open (recursion, decorator reuse):
        # keep a stack of what it opened.
        self._open.append((span, token, run, root, handed_out_by, parents))
        return span

    def _end(self, exc_type: Any, exc: Any, tb: Any) -> None:
        span, token, run, root, handed_out_by, parents = self._open.pop()
        try:
            if run is not None:
                run.open_spans.pop(span, None)
                if parents is not None:
                    run.thread_parents.closed(parents)
            if span.is_recording():  # not if the run's finish() ended it already
                if isinstance(exc, Exception):
                    # The message and traceback scrubbed: an error often quotes the URL it failed on
                    # (here too, not only on the way out, for an application's own provider).
                    message = scrub_text(str(exc))
                    span.record_exception(exc, attributes=_exception_attributes(exc, message))
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"))
                span.end()
                if run is not None:  # what the stall bound of this phase learns from
                    run.stalls.ended(self.state_name, (span.end_time - span.start_time) / 1e9)  # type: ignore[attr-defined]
                    if run.anatomy is not None:
                        self._tell_anatomy(run.anatomy, span, isinstance(exc, Exception), handed_out_by)
        finally:
            otel_context.detach(token)  # type: ignore[arg-type]
            if root is not None:  # the step's root ends after its last span (runtime/step_roots.py)
                run.step_roots.child_ended(root, time.time_ns())

    def _tell_anatomy(self, anatomy: StepAnatomy, span: Any, failed: bool, handed_out_by: str | None) -> None:
        trace_id, start_ns, end_ns = span.get_span_context().trace_id, span.start_time, span.end_time
        anatomy.phase_ended(trace_id, Phase(self.state_name, start_ns, end_ns, failed))
        if handed_out_by is not None:
            lane = self.attributes[LANE_ATTRIBUTE]
            lane = int(lane) if isinstance(lane, str) and lane.isdigit() else lane
            anatomy.call_ended(trace_id, Call(handed_out_by, lane, start_ns, end_ns))

    def __enter__(self) -> Span:
        return self._start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._end(exc_type, exc, tb)

    async def __aenter__(self) -> Span:
        return self._start()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._end(exc_type, exc, tb)

    def __call__(self, func: F) -> F:
        """As a decorator: a fresh span for every call, for plain and async functions."""
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with self._fresh():
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _fresh(self) -> trace_state:
        # Each call gets its own object: calls may overlap in threads and tasks.
        state = trace_state(self.state_name)
        state.attributes = self.attributes
        state.links = self.links
        return state


class _Late:
    """The run modules, imported on a span's first use rather than with ``otel_tracking`` (whose
    import stays fast) and then kept, instead of imported again at every span."""

    def __getattr__(self, name: str) -> Any:
        from otel_tracking.distributed.worker import worker_run
        from otel_tracking.runtime.run import current_run, refuse_span_after_finish

        self.worker_run, self.current_run, self.refuse_span_after_finish = (
            worker_run,
            current_run,
            refuse_span_after_finish,
        )
        return object.__getattribute__(self, name)


_late: Any = _Late()


def _step_of(span: Any) -> int | None:
    """The ``ml.step`` a span was started with (a phase of another thread adopting this one)."""
    step = (getattr(span, "attributes", None) or {}).get(STEP_ATTRIBUTE)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _exception_attributes(exc: BaseException, message: str) -> dict[str, str]:
    """The message and stacktrace ``record_exception`` would record, scrubbed; given as attributes
    they take the place of the SDK's own."""
    stacktrace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "exception.message": message,
        "exception.stacktrace": scrub_text(stacktrace),
    }


def _links(targets: Any) -> list[Link]:
    """Span links from what ``links=`` was given: carriers (dicts), Contexts, spans or
    SpanContexts, one or a list.  A rollout that serves a step other than the one it runs in
    (fully asynchronous training) links to that step instead of hanging under it."""
    if targets is None:
        return []
    if not isinstance(targets, (list, tuple)):
        targets = [targets]
    links = []
    for target in targets:
        if isinstance(target, SpanContext):
            span_context = target
        elif isinstance(target, Span):
            span_context = target.get_span_context()
        elif isinstance(target, dict):
            span_context = trace.get_current_span(extract(target)).get_span_context()
        else:  # a Context
            span_context = trace.get_current_span(target).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context))
    return links
