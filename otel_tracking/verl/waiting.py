"""Whom a stuck driver phase waits for: the worker-group calls dispatched under it.

``dispatch.py`` tells :func:`remember` of each call verl's ``RayWorkerGroup`` sends (the rank, the
actor handle and the call's ``ObjectRef``), under the driver span current when it was sent and the
open spans around it (``update_actor`` inside ``step``).  When one of those spans stalls
(``runtime/stalls.py``), :func:`waiting_for` says which ranks' calls have returned and which have
not (``ml.stall.waiting_ranks``, ``ml.stall.done_ranks``), with each waiting rank's actor id, node
and pid, and which of the waiting ranks have not started: their actor is still being created (its
process starting, its imports, its ``__init__``), so it has not begun the call.  A phase held up
by ranks that have not started is not stuck (``stalls.py`` says so, and reports no stall).

None of it calls into a worker: ``ray.wait`` with no timeout asks the object store, and the actor
table is the GCS's (one query for the job's actors), so a single-threaded actor stuck in the call
cannot hold the answer up.  A GCS that does not answer could; ``stalls.py`` asks on a thread of its
own with a deadline (``stall_report.py``), never on its watcher thread.

The ``ObjectRef`` s are held only while their span is open (dropped at the next worker-group call
or stall report after it ended), so nothing keeps a result in the object store for long.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.compat import verl_internals
from otel_tracking.runtime.stall_report import MAX_LISTED, Waiting

# Actor states (Ray's ActorTableData.ActorState) of an actor whose creation has not finished: its
# process is starting, importing, or running __init__; no call sent to it has begun.
NOT_STARTED = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION"})


@dataclass
class _Sent:
    span: Any  # the driver span the calls were sent under
    around: frozenset[int]  # the span ids of the open spans around it (its parent, theirs, ...)
    calls: list[tuple[int, Any, Any]] = field(default_factory=list)  # (rank, actor handle, ObjectRef)


_lock = threading.Lock()
_sent: dict[int, _Sent] = {}  # span id -> the calls sent under that driver span, while it is open


def remember(group: Any, worker: Any, ref: Any) -> None:
    """A worker-group call just sent to ``worker`` (one of ``group``'s), its result ``ref``."""
    import ray
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording() or not isinstance(ref, ray.ObjectRef):
        return
    forget_ended()
    rank, _ = verl_internals.rank_in_group(group, worker)
    key = span.get_span_context().span_id
    around = None if key in _sent else _around(span)  # once per driver span
    with _lock:
        entry = _sent.get(key) or _sent.setdefault(key, _Sent(span, around or frozenset()))
        entry.calls.append((rank, worker, ref))


def _around(span: Any) -> frozenset[int]:
    """The ids of the open spans ``span`` sits in (its parent, the parent's parent, ...), as far as
    the current run holds them open: a stall of ``step`` waits for what ``update_actor`` sent."""
    from otel_tracking.runtime.run import current_run

    run = current_run()
    if run is None:
        return frozenset()
    by_id = {s.get_span_context().span_id: s for s in list(run.open_spans)}
    found: set[int] = set()
    parent = getattr(span, "parent", None)
    while parent is not None and parent.span_id not in found:
        found.add(parent.span_id)
        parent = getattr(by_id.get(parent.span_id), "parent", None)
    return frozenset(found)


def forget_ended() -> None:
    with _lock:
        for key in [k for k, entry in _sent.items() if not entry.span.is_recording()]:
            del _sent[key]


def waiting_for(span: Any) -> Waiting | None:
    """For a stuck span: the ranks it waits for (through the calls sent under it or under the
    open spans inside it), those that returned, and those that have not started; None when it
    sent no worker-group call."""
    forget_ended()
    key = span.get_span_context().span_id
    with _lock:
        calls = [c for k, entry in _sent.items() if k == key or key in entry.around for c in entry.calls]
    if not calls:
        return None
    import ray

    refs = [ref for _, _, ref in calls]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    ready_set = set(ready)
    pending: dict[int, Any] = {}
    done: set[int] = set()
    for rank, worker, ref in calls:
        if ref in ready_set:
            done.add(rank)
        else:
            pending[rank] = worker
    done -= set(pending)
    table = _actor_table()
    starting: list[int] = []
    lines: list[str] = []
    for rank, worker in sorted(pending.items()):
        entry = table.get(_actor_id(worker) or "", {})
        if entry.get("State") in NOT_STARTED:
            starting.append(rank)
        if len(lines) < MAX_LISTED:
            lines.append(f"  rank {rank}: {_where(worker, entry)}")
    waiting = tuple(sorted(pending))
    return Waiting(waiting=waiting, done=tuple(sorted(done)), starting=tuple(starting), lines=tuple(lines))


def _actor_id(worker: Any) -> str | None:
    from otel_tracking.compat.ray_internals import actor_id

    return actor_id(worker)


def _actor_table() -> dict[str, dict[str, Any]]:
    from otel_tracking.compat.ray_internals import job_actor_table

    return job_actor_table()


def _where(worker: Any, info: dict[str, Any]) -> str:
    """The actor's id, state, node and pid, from the GCS's actor table (not from the actor)."""
    hex_id = _actor_id(worker)
    if hex_id is None:
        return "actor ?"
    address = info.get("Address") or {}
    return (
        f"actor {hex_id} ({info.get('State', '?')}), node {address.get('NodeID', '?')} "
        f"({address.get('IPAddress', '?')}), pid {info.get('Pid', '?')}"
    )


def _forget_in_child() -> None:
    """A forked child: the parent's calls are not its own, and the lock may have been held."""
    global _lock
    _lock = threading.Lock()
    _sent.clear()


os.register_at_fork(after_in_child=_forget_in_child)
