"""otel-tracking: OpenTelemetry-native experiment tracking for ML training.

``from otel_tracking import Tracking`` is a drop-in for verl's tracking facade.  Names are
imported lazily, so ``import otel_tracking`` stays fast and imports no tracker SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from otel_tracking.signals.semconv import SCOPE_VERSION as __version__

_EXPORTS = {
    "Tracking": "otel_tracking.api.facade",
    "trace_state": "otel_tracking.api.spans",
    "RLInsightLogger": "otel_tracking.api.rl_insight",
    "ValidationGenerationsLogger": "otel_tracking.api.generations",
    "DapoFilteredRewardTableLogger": "otel_tracking.api.generations",
    "ConfigError": "otel_tracking.config.settings",
}

__all__ = [  # noqa: RUF022 - the lazy names, then the version
    "ConfigError",
    "DapoFilteredRewardTableLogger",
    "RLInsightLogger",
    "Tracking",
    "ValidationGenerationsLogger",
    "trace_state",
    "__version__",
]

if TYPE_CHECKING:
    from otel_tracking.api.facade import Tracking
    from otel_tracking.api.generations import DapoFilteredRewardTableLogger, ValidationGenerationsLogger
    from otel_tracking.api.rl_insight import RLInsightLogger
    from otel_tracking.api.spans import trace_state
    from otel_tracking.config.settings import ConfigError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_tracking' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The lazy names too: ``dir()``, completion and re-export shims see the public API."""
    return sorted({*globals(), *_EXPORTS})
