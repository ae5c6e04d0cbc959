"""``ray.init`` (verl's or the user's) gets the run's ``runtime_env`` merged in.

Every Ray worker then exports with no configuration of its own: the OTel and otel-tracking
settings of this process, the run identity (when a run exists already), the switch
(``OTEL_TRACKING_VERL=1``, so that ``import verl`` in each worker instruments it), and, where
verl's plugins will not load us (verl < 0.9, or ``VERL_USE_EXTERNAL_PLUGINS`` leaving us out),
``worker_process_setup_hook``.  What the caller's ``runtime_env`` says wins; credentials
(``OTEL_EXPORTER_OTLP_*HEADERS``) stay out, as with ``otel_tracking.distributed.ray_tracing.runtime_env``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from otel_tracking.verl import switch
from otel_tracking.verl.guard import cannot_patch, quietly

SETUP_HOOK = "otel_tracking.verl.worker_setup"
_PATCHED = "__otel_tracking_patched__"


def patch(ray: ModuleType) -> None:
    ray_init = getattr(ray, "init", None)
    if not callable(ray_init):
        cannot_patch(ray.__name__, ["init"])
        return
    if getattr(ray_init, _PATCHED, False):
        return

    @functools.wraps(ray_init)
    def init(*args: Any, **kwargs: Any) -> Any:
        merged = quietly("merging the runtime_env of ray.init", merged_runtime_env, kwargs.get("runtime_env"))
        if merged is not None:
            kwargs["runtime_env"] = merged
        return ray_init(*args, **kwargs)

    setattr(init, _PATCHED, True)
    ray.verl_init = ray_init  # type: ignore[attr-defined]
    ray.init = init  # type: ignore[attr-defined]


def merged_runtime_env(base: Any) -> dict[str, Any]:
    from otel_tracking.distributed.ray_tracing import runtime_env

    merged = runtime_env(dict(base) if base else None)
    env_vars = merged["env_vars"]
    env_vars.setdefault(switch.SWITCH, "1")
    if "worker_process_setup_hook" not in merged and not _plugins_reach_workers():
        merged["worker_process_setup_hook"] = SETUP_HOOK
    return merged


def _plugins_reach_workers() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        has_plugins = Version(version("verl")) >= Version("0.9.0")
    except PackageNotFoundError:
        has_plugins = False
    return has_plugins and switch.plugins_load_us()
