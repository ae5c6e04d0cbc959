"""Volcengine ML Platform's wandb (``vemlp_wandb``) tracker.

As the reference did::

    volcengine_ml_platform.init(ak=$VOLC_ACCESS_KEY_ID, sk=$VOLC_SECRET_ACCESS_KEY, region=$MLP_TRACKING_REGION)
    volcengine_ml_platform.wandb.init(project=project, name=experiment, config=config, sync_tensorboard=True)

then everything goes through the wandb tracker's code with ``volcengine_ml_platform.wandb`` as the
wandb module: the same stored keys, steps, values, timing scalars and ``val/generations`` table.
The DAPO filtered-reward table stays wandb-only, as in the reference.  The access keys go to the
platform's ``init`` only, never into the run's config (which is redacted anyway).

``volcengine_ml_platform`` is imported only when this backend is opened; ``open_tracker`` also takes
the platform module as an argument (``platform_module``), for tests and for wrapping.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from otel_tracking.config.settings import ConfigError
from otel_tracking.exporters._base import (
    SinkParts,
    TrackerContext,
    tracker_exporters,
)
from otel_tracking.exporters.wandb import WandbSession, resume_kwargs
from otel_tracking.signals.semconv import GENERATIONS_EVENT

PLATFORM_PACKAGE = "volcengine_ml_platform"
BACKEND = "vemlp_wandb"
_ENV = {"ak": "VOLC_ACCESS_KEY_ID", "sk": "VOLC_SECRET_ACCESS_KEY", "region": "MLP_TRACKING_REGION"}


def import_platform() -> Any:
    try:
        return importlib.import_module(PLATFORM_PACKAGE)
    except ModuleNotFoundError as error:
        if error.name != PLATFORM_PACKAGE and not (error.name or "").startswith(PLATFORM_PACKAGE + "."):
            raise
        raise ConfigError(
            f"backend 'vemlp_wandb' needs Volcengine ML Platform's SDK, the {PLATFORM_PACKAGE!r} package, "
            "which is not installed in this environment"
        ) from error


def platform_wandb(platform: Any) -> Any:
    """``from volcengine_ml_platform import wandb``: the attribute, else the submodule."""
    module = getattr(platform, "wandb", None)
    if module is not None:
        return module
    name = getattr(platform, "__name__", PLATFORM_PACKAGE)
    try:
        return importlib.import_module(f"{name}.wandb")
    except ModuleNotFoundError as error:
        raise ConfigError(f"backend 'vemlp_wandb': {name!r} has no 'wandb' module") from error


def check_environment(env: Mapping[str, str]) -> None:
    """The access keys and region the platform's ``init`` needs: ``ConfigError`` naming what is missing."""
    missing = [name for name in _ENV.values() if not env.get(name)]
    if missing:
        raise ConfigError(f"backend 'vemlp_wandb' needs the environment variable(s) {', '.join(missing)}")


class VemlpWandbSession(WandbSession):
    """A wandb session on the platform's wandb module."""

    events = (GENERATIONS_EVENT,)  # the reference's DAPO reward table is wandb-only

    @classmethod
    def open(cls, context: TrackerContext, platform_module: Any = None) -> WandbSession:
        platform = import_platform() if platform_module is None else platform_module
        check_environment(context.env)
        platform.init(**{arg: context.env[name] for arg, name in _ENV.items()})
        kwargs: dict[str, Any] = {
            "project": context.project,
            "name": context.experiment,
            "config": context.config,
            "sync_tensorboard": True,
        }
        return cls.start(
            platform_wandb(platform),
            backend=BACKEND,
            monotonic_steps=False,  # the platform's wandb decides (with sync_tensorboard, wandb ignores steps)
            **{**kwargs, **resume_kwargs(context)},
        )


EXPORTERS = tracker_exporters("VemlpWandb", VemlpWandbSession, __name__)
(VemlpWandbMetricExporter, VemlpWandbSpanExporter, VemlpWandbLogExporter) = (
    EXPORTERS.metrics,
    EXPORTERS.spans,
    EXPORTERS.logs,
)


def open_tracker(context: TrackerContext, platform_module: Any = None) -> SinkParts:
    session = VemlpWandbSession.open(context, platform_module)
    return EXPORTERS.parts(session)


__all__ = [
    "VemlpWandbLogExporter",
    "VemlpWandbMetricExporter",
    "VemlpWandbSession",
    "VemlpWandbSpanExporter",
    "open_tracker",
]
