"""Ray's private names, named here and nowhere else.

What the drain (``drain.py``), the verl switch (``verl/hops.py``) and the stall report
(``verl/waiting.py``) need has no public API in Ray: whether this process is the driver, an actor
handle's id and its methods' signatures, the one method every ``.remote()`` on an actor handle goes
through, and the GCS's actor table.  :data:`PRIVATE_NAMES` lists each with what does without it.
:func:`probe` checks them once per process against the installed Ray and logs at debug which path
runs, and warns once when a name moved (a newer Ray): the fallback then runs, never an error.
``tests/test_ray_internals.py`` is the contract with the Ray we pin for tests; it fails when a name
moves there.  Nothing here imports Ray before Ray is used.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("otel_tracking.ray")

# Each private name, and what runs without it.
PRIVATE_NAMES = {
    "ray._private.worker.global_worker.mode": "no process counts as the driver: nothing is covered, and each "
    "instrumented call waits at its end until its spans left",
    "ray.actor.ActorHandle._actor_method_call": "calls to agent-loop and rollout-server actors carry no trace "
    "context, and no actor is asked to deliver before the driver ends it",
    "ray.actor.ActorHandle._actor_id": "actors are not told apart: none is remembered, so none is drained",
    "ray.actor.ActorHandle._ray_method_signatures": "no caller adds the trace context to an actor call",
    "ray._private.state.state.actor_table": "a stall report names a waiting rank's actor without its node and pid, "
    "and cannot tell a rank that has not started from one stuck in the call",
}

ACTOR_METHOD_CALL = "_actor_method_call"  # verl/hops.py wraps it on ray.actor.ActorHandle

_lock = threading.Lock()
_probed: dict[str, bool] | None = None


def probe() -> dict[str, bool]:
    """Which of :data:`PRIVATE_NAMES` the installed Ray has; logged once per process."""
    global _probed
    with _lock:
        if _probed is None:
            _probed = {name: _present(name) for name in PRIVATE_NAMES}
            for name, found in _probed.items():
                if found:
                    logger.debug("otel-tracking: Ray's %s is used", name)
                else:
                    logger.warning("otel-tracking: Ray's %s is not in this Ray: %s", name, PRIVATE_NAMES[name])
        return dict(_probed)


def _present(name: str) -> bool:
    try:
        import ray.actor
        from ray._private import state, worker
    except Exception:  # Ray missing, or moved as a whole
        return False
    handle = ray.actor.ActorHandle
    if name == "ray._private.worker.global_worker.mode":
        return hasattr(getattr(worker, "global_worker", None), "mode") and hasattr(ray, "SCRIPT_MODE")
    if name == "ray._private.state.state.actor_table":
        return callable(getattr(getattr(state, "state", None), "actor_table", None))
    if name == "ray.actor.ActorHandle._actor_method_call":
        return callable(getattr(handle, ACTOR_METHOD_CALL, None))
    if name == "ray.actor.ActorHandle._actor_id":
        return isinstance(getattr(handle, "_actor_id", None), property)
    # An instance attribute: ActorHandle.__init__ sets it.
    return "_ray_method_signatures" in getattr(getattr(handle.__init__, "__code__", None), "co_names", ())


def is_driver() -> bool:
    """Whether this process ran ``ray.init`` (Ray's script mode), not a worker Ray started."""
    import ray

    if not probe()["ray._private.worker.global_worker.mode"]:
        return False
    return bool(ray.is_initialized() and ray._private.worker.global_worker.mode == ray.SCRIPT_MODE)


def actor_id(handle: Any) -> str | None:
    """An actor handle's id, hex; None for anything else or without the name."""
    hex_id = getattr(getattr(handle, "_actor_id", None), "hex", None)
    return str(hex_id()) if callable(hex_id) else None


def method_parameters(handle: Any, method_name: str) -> tuple[Any, ...]:
    """The parameters of an actor method as Ray recorded them where the actor class was made."""
    return tuple((getattr(handle, "_ray_method_signatures", None) or {}).get(method_name) or ())


def job_actor_table() -> dict[str, dict[str, Any]]:
    """The GCS's records of this job's actors (one query), by actor id, hex; empty when they
    cannot be read.  The GCS may not answer at all: callers on a thread that must not hang ask
    from another (``runtime/stalls.py``)."""
    if not probe()["ray._private.state.state.actor_table"]:
        return {}
    try:
        import ray
        from ray._private import state

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        table = state.state.actor_table(None, job_id=job)
        return {str(hex_id): dict(entry) for hex_id, entry in (table or {}).items()}
    except Exception:  # the GCS gone, or another Ray's records
        logger.debug("otel-tracking: reading Ray's actor table failed", exc_info=True)
        return {}


__all__ = [
    "ACTOR_METHOD_CALL",
    "PRIVATE_NAMES",
    "actor_id",
    "is_driver",
    "job_actor_table",
    "method_parameters",
    "probe",
]
