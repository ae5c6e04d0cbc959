"""The variables that switch the verl instrumentation on and shape it.

They are read here rather than in ``otel_tracking.config.settings`` because this package may import only
the standard library until verl's modules load (``settings`` imports the OpenTelemetry SDK), and
the plugin runs in every process that imports verl, switched on or not.
"""

from __future__ import annotations

import os

SWITCH = "OTEL_TRACKING_VERL"
# simple_timer runs once per sample in the agent loops: spans for it only when asked.
SIMPLE_TIMER = "OTEL_TRACKING_VERL_SIMPLE_TIMER"
TRUE = ("1", "true", "yes", "on")


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


def disabled_by_otel() -> bool:
    """``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names ``verl`` (the OTel spec's switch)."""
    raw = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    return "verl" in {name.strip() for name in raw.split(",")}


def switched_on() -> bool:
    return _truthy(SWITCH) and not disabled_by_otel()


def simple_timer_spans() -> bool:
    return _truthy(SIMPLE_TIMER)


def plugins_load_us() -> bool:
    """Whether ``import verl`` (>= 0.9) loads our ``verl.plugins`` entry point in a worker."""
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    return policy == "auto" or "otel_tracking" in {name.strip() for name in policy.split(",")}


def in_ray_worker(argv0: str) -> bool:
    return os.path.basename(argv0) == "default_worker.py"
