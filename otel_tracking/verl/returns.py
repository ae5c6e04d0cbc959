"""When each rank's result of a worker-group call was ready: the calls of the step's anatomy.

``dispatch.py`` tells :func:`sent` of each call verl's ``RayWorkerGroup`` sends under a driver
phase.  One daemon thread (``otel-tracking-returns``, alive while calls are out) waits on their
``ObjectRef`` s with ``ray.wait(fetch_local=False)``, which asks the object store and fetches
nothing, and stamps each as it becomes ready.  A rank's call then lasts from its dispatch to its
result, both on the driver's clock, so ranks on other hosts compare without clock skew; it
includes Ray's transport, milliseconds beside a training phase.  When the step's root ends,
``runtime/anatomy.py`` takes the step's calls (:func:`calls_of`); a call not seen ready by then
ends where the phase that sent it ended (the driver had its result by then).

The role of a call is the method's (``update_actor``: actor, ``compute_ref_log_prob``: ref,
``generate_sequences``: rollout, ``compute_values``: critic, ``compute_rm_score``: reward), else
the worker class's, as ``roles.role_of`` names a worker's.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from otel_tracking.compat import verl_internals
from otel_tracking.runtime.anatomy import Call, add_call_source
from otel_tracking.verl.roles import role_from_name

_POLL_S = 0.05  # a call sent while the thread waits joins the wait this much later, at most
# The first keyword found in a method's name says its role (ref before log_prob: compute_ref_log_prob).
_METHOD_ROLES = (
    ("critic", "critic"),
    ("values", "critic"),
    ("rm_score", "reward"),
    ("reward", "reward"),
    ("ref", "ref"),
    ("generate", "rollout"),
    ("rollout", "rollout"),
    ("actor", "actor"),
    ("log_prob", "actor"),
)


@dataclass
class _Sent:
    trace_id: int
    span: Any  # the driver span it was sent under (its end: the fallback end)
    role: str
    rank: int
    ranks: int
    start_ns: int


_cond = threading.Condition()
_pending: dict[Any, _Sent] = {}  # ObjectRef -> the call, not seen ready yet
_done: dict[int, list[Call]] = {}  # trace id -> the step's calls seen ready
_thread: threading.Thread | None = None


def sent(group: Any, worker: Any, method_name: str, ref: Any) -> None:
    """A worker-group call just sent to ``worker``, its result ``ref``; recorded under a driver
    run that measures its steps' anatomy."""
    import ray
    from opentelemetry import trace

    from otel_tracking.runtime.run import current_run

    span = trace.get_current_span()
    run = current_run()
    if run is None or run.anatomy is None or not span.is_recording() or not isinstance(ref, ray.ObjectRef):
        return
    rank, size = verl_internals.rank_in_group(group, worker)
    call = _Sent(span.get_span_context().trace_id, span, _role(group, method_name), rank, size, time.time_ns())
    global _thread
    with _cond:
        _pending[ref] = call
        if _thread is None:
            add_call_source(calls_of)
            _thread = threading.Thread(target=_watch, name="otel-tracking-returns", daemon=True)
            _thread.start()
        _cond.notify()


def calls_of(trace_id: int) -> list[Call]:
    """The step's calls, forgotten here; those not seen ready end with the phase that sent them."""
    now = time.time_ns()
    with _cond:
        found = _done.pop(trace_id, [])
        for ref in [r for r, s in _pending.items() if s.trace_id == trace_id]:
            call = _pending.pop(ref)
            found.append(_ended(call, getattr(call.span, "end_time", None) or now))
    return found


def _ended(call: _Sent, end_ns: int) -> Call:
    return Call(call.span.name, call.rank, call.start_ns, end_ns, call.role, call.ranks)


def _watch() -> None:
    import ray

    while True:
        with _cond:
            while not _pending:
                _cond.wait()
            refs = list(_pending)
        try:
            ready, _ = ray.wait(refs, num_returns=1, timeout=_POLL_S, fetch_local=False)
            if ready:  # and every other one ready by now
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        except Exception:  # Ray shut down: nothing more will be ready
            with _cond:
                _pending.clear()
            continue
        now = time.time_ns()
        with _cond:
            for ref in ready:
                call = _pending.pop(ref, None)
                if call is not None:
                    _done.setdefault(call.trace_id, []).append(_ended(call, now))


def _role(group: Any, method_name: str) -> str:
    lower = method_name.lower()
    for keyword, role in _METHOD_ROLES:
        if keyword in lower:
            return role
    cls = getattr(getattr(group, "ray_cls_with_init", None), "cls", None)
    cls = getattr(cls, "__ray_actor_class__", cls)
    return role_from_name(getattr(group, "sub_cls_name", None) or getattr(cls, "__name__", "") or "worker")


def _forget_in_child() -> None:
    global _thread, _cond
    _thread, _cond = None, threading.Condition()
    _pending.clear()
    _done.clear()


os.register_at_fork(after_in_child=_forget_in_child)
