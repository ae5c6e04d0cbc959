"""Whom a stuck driver phase waits for: the worker-group calls dispatched under it.

``dispatch.py`` tells :func:`remember` of each call verl's ``RayWorkerGroup`` sends (the rank, the
actor handle and the call's ``ObjectRef``), under the driver span current when it was sent.  When
that span stalls (``runtime/stalls.py``), :func:`waiting_for` says which ranks' calls have
returned and which have not (``ml.stall.waiting_ranks``, ``ml.stall.done_ranks``), with each
waiting rank's actor id, node and pid.  None of it calls into a worker: ``ray.wait`` with no
timeout asks the object store, and the actor table is the GCS's, so a single-threaded actor stuck
in the call cannot hold the answer up.

The ``ObjectRef`` s are held only while their span is open (dropped at the next worker-group call
or stall report after it ended), so nothing keeps a result in the object store for long.
"""

from __future__ import annotations

import threading
from typing import Any

from otel_tracking.compat import verl_internals

_lock = threading.Lock()
# span id -> (the span, [(rank, actor handle, ObjectRef), ...]) of the driver spans still open
_calls: dict[int, tuple[Any, list[tuple[int, Any, Any]]]] = {}


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
    with _lock:
        entry = _calls.get(key)
        if entry is None:
            _calls[key] = entry = (span, [])
        entry[1].append((rank, worker, ref))


def forget_ended() -> None:
    with _lock:
        for key in [k for k, (span, _) in _calls.items() if not span.is_recording()]:
            del _calls[key]


def waiting_for(span: Any) -> tuple[dict[str, Any], list[str]] | None:
    """For a stuck span: (attributes, lines of text) naming the ranks it waits for, or None when
    it sent no worker-group call."""
    forget_ended()
    with _lock:
        entry = _calls.get(span.get_span_context().span_id)
        calls = list(entry[1]) if entry is not None else []
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
    lines = [f"Waiting for rank(s) {sorted(pending)}; returned: {sorted(done)}"]
    for rank, worker in sorted(pending.items()):
        lines.append(f"  rank {rank}: {_where(worker)}")
    return {"ml.stall.waiting_ranks": sorted(pending), "ml.stall.done_ranks": sorted(done)}, lines


def _where(worker: Any) -> str:
    """The actor's id, node and pid, from the GCS's actor table (not from the actor)."""
    from otel_tracking.compat.ray_internals import actor_id, actor_table_entry

    hex_id = actor_id(worker)
    if hex_id is None:
        return "actor ?"
    info = actor_table_entry(hex_id)
    address = info.get("Address") or {}
    return (
        f"actor {hex_id} ({info.get('State', '?')}), node {address.get('NodeID', '?')} "
        f"({address.get('IPAddress', '?')}), pid {info.get('Pid', '?')}"
    )
