"""A verl worker's role (``ml.role``): actor, rollout, ref, critic or reward.

verl names roles in its worker classes (``ActorRolloutRefWorker``, ``CriticWorker``) and in the
``role`` attribute some workers carry (``actor_rollout``, ``ref``).  The worker side
(``dispatch.py``: the role a worker's spans carry) and the driver side (``returns.py``: the role
of a worker-group call in the step's anatomy) read it the same way, here.
"""

from __future__ import annotations

from typing import Any

_ROLES = ("critic", "reward", "actor", "ref", "rollout")


def role_of(worker: Any) -> str:
    """actor, rollout, ref, critic or reward, from the worker's ``role`` or its class name."""
    named = getattr(worker, "role", None)
    return role_from_name(named if isinstance(named, str) and named else type(worker).__name__)


def role_from_name(raw: str) -> str:
    """The first of critic, reward, actor, ref, rollout that ``raw`` (a role or class name) holds."""
    lower = raw.lower()
    for role in _ROLES:
        if role in lower:
            return role
    return raw
