"""Telemetry of a process that has no ``Tracking``: Ray workers, rollout servers, subprocesses.

Only the driver talks to ML trackers; every other process of a job speaks OTLP.  The first
``trace_state`` (or ``RLInsightLogger`` call) in a process without a ``Tracking`` builds one
*worker run* for the process, from the standard variables:

* exporters: OTLP per ``OTEL_EXPORTER_OTLP_*`` / ``OTEL_TRACES_EXPORTER`` (and any of our sinks or
  entry points named there), behind the same queue, retry and spool as the driver's sinks: spans
  leave together every ``WORKER_EXPORT_INTERVAL_S`` (``COVERED_EXPORT_INTERVAL_S`` once a caller
  covers the process, :func:`export_less_often`), and the run is flushed at normal interpreter exit;
* identity: ``ml.project``, ``ml.experiment``, ``ml.run.id`` from the caller's baggage (what
  :func:`otel_tracking.distributed.propagation.inject` and the Ray helpers carry), else the run a forked child
  inherited, else the environment;
  ``ml.rank`` (:func:`configure_worker`, else ``RANK``..., else the ``rank`` attribute of the Ray
  actor a ``traced`` method runs on), ``ml.role`` (:func:`configure_worker`, else
  ``OTEL_TRACKING_ROLE``, else the actor's class name), ``host.name`` and ``process.pid``;
* with no exporter configured, spans are not dropped: they are spooled under the run's spool
  directory, one warning says where, and ``otel-tracking replay`` sends them later.

An application that installed its own global ``TracerProvider`` keeps it: ``trace_state`` then
records into that provider instead.  ``OTEL_SDK_DISABLED=true`` turns the worker run off.

A Ray worker is not given an exit: when its driver calls ``ray.shutdown()`` (or exits, or calls
``ray.kill``), Ray's C++ core worker ends the process with ``_exit`` a few milliseconds after the
driver let go, and no Python code (exit hook, finalizer, signal handler) is sure to run.  So either
the caller asks for the spans before it ends the worker (:mod:`otel_tracking.distributed.drain`),
or the call's spans leave before the call returns: :func:`deliver_pending`, which the ``traced``
wrappers call at the end of every call nobody covers, waits until the worker run holds nothing
(delivered, or spooled).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.config.settings import Settings
from otel_tracking.distributed.environment import (
    COVERED_EXPORT_INTERVAL_S,
    WORKER_EXPORT_INTERVAL_S,
    build_worker_settings,
)
from otel_tracking.runtime.run import Run, current_run, inherited_identity
from otel_tracking.signals.carrier import identity_from

logger = logging.getLogger("otel_tracking")

_lock = threading.Lock()
_defaults: dict[str, Any] = {}  # role / rank given by configure_worker (or a Ray actor's class name)
_actor: object | None = None  # the first traced Ray actor of this process (its ``rank``)
_disabled_pid: int | None = None  # OTEL_SDK_DISABLED in this process: no worker run, no retries
_less_often_pid: int | None = None  # covered (drain.py): this process's worker run exports less often

# How long the end of a traced call waits for its spans to leave.  Against a healthy endpoint that
# is one round trip; a failing one spools within its retries (~1 s); only a hung endpoint reaches
# this bound, and then calls do not wait for STALL_PAUSE_S, or until the queue is seen empty.
RETURN_TIMEOUT_S = 5.0
STALL_PAUSE_S = 60.0
_stalled_until = 0.0  # monotonic time before which calls do not wait (a wait timed out)
_warned_stall = False


def configure_worker(*, role: str | None = None, rank: int | None = None) -> None:
    """Say what this process is (``ml.role``, ``ml.rank``) before its first span; a worker run
    already built keeps what it had."""
    if role is not None:
        _defaults["role"] = str(role)
    if rank is not None:
        _defaults["rank"] = int(rank)


def default_role(role: str) -> None:
    """A role to use when none was configured (the Ray helpers pass the actor's class name)."""
    _defaults.setdefault("fallback_role", role)


def default_role_of(worker: object, role_of: Callable[[object], str]) -> None:
    """``default_role(role_of(worker))``, worked out only while no role is known (the first wins)."""
    if "fallback_role" not in _defaults:
        _defaults.setdefault("fallback_role", role_of(worker))


def actor_defaults(actor: object) -> None:
    """What a Ray actor says about itself when nothing was configured: ``ml.role`` its class name,
    ``ml.rank`` its ``rank`` attribute (an int), read when the worker run is built (the first span,
    which may come in ``__init__`` after ``self.rank = ...``).  The first actor of a process wins."""
    global _actor
    default_role(type(actor).__name__)
    if _actor is None:
        _actor = actor  # an actor lives as long as its process


def _actor_rank(actor: object) -> int | None:
    try:
        rank = getattr(actor, "rank", None)
    except Exception:  # a property that cannot answer yet
        return None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def worker_settings(
    ctx: Context | None = None, project: str | None = None, experiment: str | None = None, force_otlp: bool = False
) -> Settings:
    """The settings of this process's worker run: identity from ``ctx``'s baggage, else the run a
    forked child inherited, else the environment; spooled data under a directory of its own (many
    workers share one run id)."""
    identity = identity_from(ctx) or inherited_identity()
    settings = build_worker_settings(identity, project, experiment, force_otlp=force_otlp)
    role = _defaults.get("role") or settings.role or _defaults.get("fallback_role")
    rank = _defaults.get("rank", settings.rank)
    if rank is None and _actor is not None:
        rank = _actor_rank(_actor)
    own = f"{role or 'worker'}-{settings.host}-{os.getpid()}"
    return dataclasses.replace(settings, role=role, rank=rank, spool_dir=settings.spool_dir / own)


def worker_run(ctx: Context | None = None) -> Run | None:
    """This process's worker run, built on first use; None when the application has its own global
    TracerProvider, or the SDK is disabled."""
    run = current_run()
    if run is not None:
        return run
    if _disabled_pid == os.getpid() or _app_has_provider():
        return None
    with _lock:
        run = current_run()
        if run is None:
            run = _build(ctx)
    return run


def _app_has_provider() -> bool:
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def _build(ctx: Context | None) -> Run | None:
    global _disabled_pid
    from otel_tracking.config.run_config import RunConfig
    from otel_tracking.delivery.env_sinks import build_env_sinks
    from otel_tracking.delivery.otlp_sinks import build_otlp_sinks

    settings = worker_settings(ctx)
    if settings.sdk_disabled:
        _disabled_pid = os.getpid()
        return None
    otlp = build_otlp_sinks(settings)
    step_sinks, periodic = build_env_sinks(settings, RunConfig(), taken=())
    if "traces" not in otlp and not any(sink.spans is not None for sink in step_sinks):
        otlp["traces"] = _spool_only_traces(settings)
    run = Run(settings, step_sinks, otlp_sinks=otlp, periodic_sinks=periodic, driver=False)
    run.process_worker = True  # a Tracking started later in this process ends it (run.py)
    if _less_often_pid == os.getpid():  # covered before its first span (drain.py)
        export_less_often(run)
    # A multiprocessing child started by fork() ends with os._exit(): no exit hook runs there, but
    # multiprocessing's own finalizers do.
    multiprocessing.util.Finalize(None, _finish, args=(weakref.ref(run),), exitpriority=100)
    return run


def export_less_often(run: Run | None = None) -> None:
    """This process is covered (its caller asks for its spans before Ray ends it): its worker run's
    spans and log records leave every :data:`COVERED_EXPORT_INTERVAL_S` instead of every
    :data:`WORKER_EXPORT_INTERVAL_S`; a drain, a flush and the run's end still send them at once.
    ``OTEL_BSP_SCHEDULE_DELAY``, when set, stays as it is.  A worker run built later in this
    process does it too (``drain.py`` calls this once, when the process becomes covered)."""
    global _less_often_pid
    _less_often_pid = os.getpid()
    run = current_run() if run is None else run
    if run is None or not run.process_worker or "OTEL_BSP_SCHEDULE_DELAY" in os.environ:
        return
    for sink in run.all_sinks:
        if sink.queue is not None and sink.queue.policy.export_interval_s == WORKER_EXPORT_INTERVAL_S:
            sink.queue.hold_for(COVERED_EXPORT_INTERVAL_S)


def _finish(ref: weakref.ref[Run]) -> None:
    run = ref()
    if run is not None and run.pid == os.getpid():
        run.finish()


def deliver_pending(timeout_s: float | None = None) -> bool:
    """Wait until this process's worker run holds no span or record: each delivered, or spooled
    after its attempts.  At the end of a Ray call that nobody covers (the ``traced`` wrappers call
    it, through ``drain.at_call_end``), so that what the call recorded has left before its caller
    can end the process.  Nothing to wait for on the
    driver (``finish()`` flushes its run) or before the first span.  ``timeout_s`` bounds the wait
    (:data:`RETURN_TIMEOUT_S` unless given); after one that timed out (a hung endpoint; one
    warning per process) calls do not wait for :data:`STALL_PAUSE_S`, or until the queue is seen
    empty.  True when nothing is held any more."""
    global _stalled_until, _warned_stall
    run = current_run()
    if run is None or run.driver:
        return True
    if run.flush(0.0):  # nothing held: no thread is woken, no request is made
        _stalled_until = 0.0
        return True
    if time.monotonic() < _stalled_until:
        return False
    timeout_s = RETURN_TIMEOUT_S if timeout_s is None else timeout_s
    delivered = run.flush(timeout_s)
    if not delivered:
        _stalled_until = time.monotonic() + STALL_PAUSE_S
        log = logger.debug if _warned_stall else logger.warning
        _warned_stall = True
        log(
            "otel-tracking: the spans of this process (pid %d) did not leave within %g s of the end of a call; "
            "calls do not wait for them for the next %g s (a process ended meanwhile loses what is still queued)",
            os.getpid(),
            timeout_s,
            STALL_PAUSE_S,
        )
    return delivered


async def deliver_pending_async(timeout_s: float | None = None) -> bool:
    """:func:`deliver_pending` for a coroutine: the wait runs in a thread, the event loop goes on."""
    import asyncio

    run = current_run()
    if run is None or run.driver or run.flush(0.0):
        return True
    return await asyncio.get_running_loop().run_in_executor(None, deliver_pending, timeout_s)


class _NoExporter(SpanExporter):
    """Stands where the OTLP span exporter would, when none is configured: the one failure it
    reports (the sink's single warning) says where the spans are kept instead."""

    def __init__(self, where: str) -> None:
        self.where = where

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise RuntimeError(
            f"no trace exporter is configured in this process (pid {os.getpid()}): set OTEL_EXPORTER_OTLP_ENDPOINT "
            f"(otel_tracking.ray_tracing.runtime_env passes the driver's); its spans are kept in {self.where}; "
            "send them with `otel-tracking replay`"
        )

    def shutdown(self) -> None:
        return None


def _spool_only_traces(settings: Settings) -> Any:
    from otel_tracking.delivery.pipeline import Sink
    from otel_tracking.exporters._base import SinkParts

    where = str(settings.spool_dir / "otlp-traces.jsonl")
    # One attempt, then degraded for good: every span goes straight to the spool, no retries.
    policy = dataclasses.replace(settings.delivery, max_attempts=1, probe_interval_s=math.inf)
    return Sink("otlp-traces", SinkParts(spans=_NoExporter(where), where=f"spooled: {where}"), policy=policy)


__all__ = [
    "configure_worker",
    "deliver_pending",
    "deliver_pending_async",
    "export_less_often",
    "worker_run",
    "worker_settings",
]
