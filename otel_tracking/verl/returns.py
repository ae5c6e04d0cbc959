"""When each rank's result of a worker-group call was ready: the calls of the step's anatomy.

``dispatch.py`` tells :func:`sent` of each call verl's ``RayWorkerGroup`` sends under a driver
phase.  One daemon thread (``otel-tracking-returns``, alive while calls are out) waits on their
``ObjectRef`` s with ``ray.wait(fetch_local=False)``, which asks the object store and fetches
nothing, stamps each as it becomes ready and hands it to the run's step anatomy at once (which
sums it there, off the training loop).  A rank's call then lasts from its dispatch to its result,
both on the driver's clock, so ranks on other hosts compare without clock skew; it includes Ray's
transport, milliseconds beside a training phase.  When the step's root ends,
``runtime/anatomy.py`` asks for the step's calls still out (:func:`calls_of`): they end where the
phase that sent them ended (the driver had their results by then).

``ray.wait`` costs per ref handed in, and takes every outstanding ref each time.  So that its cost
per result does not grow with the number of ranks, each wait returns once a sixteenth of the
outstanding calls are ready (then every other one ready by then is taken too), or after 50 µs per
outstanding call, at least 50 ms (a call sent meanwhile joins the next wait): a burst of N results
costs about 32 refs each, results that trickle in at most 2 refs per 50 µs of waiting (about 1% of
a core at most, whatever N), and a result is stamped as soon as a sixteenth of those out are
ready, at most 50 ms after it was (51 ms with 1,024 out); the last sixteen, the stragglers, each
as it comes.  Ray's completion callbacks (``ObjectRef.future()``) would stamp each at once, but
they fetch and deserialize every result in this process, a second time beside verl's own
``ray.get``.

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
from otel_tracking.runtime.anatomy import Call, StepAnatomy, add_call_source
from otel_tracking.verl.roles import role_from_name

# Each ray.wait returns once this share of the outstanding calls is ready, or after so long per
# outstanding call (at least _MIN_WAIT_S; a call sent meanwhile joins the next wait)
_BATCH = 16
_WAIT_PER_CALL_S = 50e-6
_MIN_WAIT_S = 0.05
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
    anatomy: StepAnatomy  # the run's, told when the call ends


_cond = threading.Condition()
_pending: dict[Any, _Sent] = {}  # ObjectRef -> the call, not seen ready yet
_by_trace: dict[int, set[Any]] = {}  # trace id -> its refs in _pending
_telling: dict[int, int] = {}  # trace id -> calls seen ready, being told to the anatomy now
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
    trace_id = span.get_span_context().trace_id
    call = _Sent(trace_id, span, _role(group, method_name), rank, size, time.time_ns(), run.anatomy)
    global _thread
    with _cond:
        _pending[ref] = call
        _by_trace.setdefault(trace_id, set()).add(ref)
        if _thread is None:
            add_call_source(calls_of)
            _thread = threading.Thread(target=_watch, name="otel-tracking-returns", daemon=True)
            _thread.start()
        _cond.notify()


def calls_of(trace_id: int) -> list[Call]:
    """The step's calls not seen ready, forgotten here: they end with the phase that sent them.
    Those seen ready were told to the anatomy already (any being told now, before this returns)."""
    now = time.time_ns()
    with _cond:
        _cond.wait_for(lambda: not _telling.get(trace_id))
        found = []
        for ref in _by_trace.pop(trace_id, ()):
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
            ready = _ready_among(ray, refs)
        except Exception:  # Ray shut down: nothing more will be ready
            with _cond:
                _pending.clear()
                _by_trace.clear()
            continue
        if not ready:
            continue
        now = time.time_ns()
        seen = []
        with _cond:
            for ref in ready:
                call = _pending.pop(ref, None)
                if call is not None:
                    _by_trace[call.trace_id].discard(ref)
                    _telling[call.trace_id] = _telling.get(call.trace_id, 0) + 1
                    seen.append(call)
        try:  # outside the lock: dispatch (sent) does not wait for this
            for call in seen:
                call.anatomy.call_ended(call.trace_id, _ended(call, now))
        finally:
            with _cond:
                for call in seen:
                    _telling[call.trace_id] -= 1
                    if not _telling[call.trace_id]:
                        del _telling[call.trace_id]
                _cond.notify_all()


def _ready_among(ray: Any, refs: list[Any]) -> list[Any]:
    """The refs ready now, waiting until a sixteenth of them are, or 50 µs per ref (at least 50 ms)."""
    enough = -(-len(refs) // _BATCH)
    timeout_s = max(_MIN_WAIT_S, _WAIT_PER_CALL_S * len(refs))
    ready, rest = ray.wait(refs, num_returns=enough, timeout=timeout_s, fetch_local=False)
    if ready and rest:  # and every other one ready by now, in the same pass
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=False)
        ready += more
    return list(ready)


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
    _by_trace.clear()
    _telling.clear()


os.register_at_fork(after_in_child=_forget_in_child)
