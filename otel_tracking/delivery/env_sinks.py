"""Sinks named by ``OTEL_METRICS_EXPORTER``, ``OTEL_TRACES_EXPORTER`` and ``OTEL_LOGS_EXPORTER``.

A name there that is one of our backends joins the run for the signals it is named for (unless
``default_backend`` has it already); any other non-OTLP name is an OpenTelemetry exporter entry
point (``opentelemetry_<signal>_exporter``), a periodic metric sink unless it takes whole steps.
:func:`check_env_sinks` finds a bad name before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from otel_tracking.config.run_config import RunConfig
from otel_tracking.config.settings import ConfigError, Settings
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.registry import (
    SIGNAL_PART,
    SUPPORTED_BACKENDS,
    WRITTEN_AT_ONCE,
    build_checked_sink,
    check_tracker,
    is_tracker,
)
from otel_tracking.exporters._base import SinkParts

_GROUPS = {
    "metrics": "opentelemetry_metrics_exporter",
    "traces": "opentelemetry_traces_exporter",
    "logs": "opentelemetry_logs_exporter",
}


def _env_sink_names(settings: Settings, taken: Iterable[str]) -> dict[str, set[str]]:
    """The non-OTLP names in OTEL_*_EXPORTER that the facade does not have already: name -> signals."""
    wanted: dict[str, set[str]] = {}
    for signal, names in (
        ("metrics", settings.extra_metric_exporters),
        ("traces", settings.extra_span_exporters),
        ("logs", settings.extra_log_exporters),
    ):
        for name in names:
            wanted.setdefault(name, set()).add(signal)
    for name in set(taken):
        wanted.pop(name, None)
    return wanted


def check_env_sinks(settings: Settings, taken: Iterable[str]) -> None:
    """Raise the ``ConfigError`` that :func:`build_env_sinks` would, before anything is built: a
    name that is neither one of our backends nor an installed entry point, a tracker's setup."""
    for name, signals in _env_sink_names(settings, taken).items():
        if name in SUPPORTED_BACKENDS and name != "rl_insight":
            if is_tracker(name):
                check_tracker(name, settings)
            continue
        for signal in signals:
            _load_entry_point(signal, name)


def build_env_sinks(settings: Settings, config: RunConfig, taken: Iterable[str]) -> tuple[list[Sink], list[Sink]]:
    """Sinks for the non-OTLP names in OTEL_*_EXPORTER: (per-step sinks, periodic metric sinks).

    One of our backend names joins the run for the signals it is named for (unless the facade
    already has it); any other name is looked up as an OpenTelemetry exporter entry point.  When
    one fails to build, those built before it are finished: nothing is left open.
    """
    step_sinks: list[Sink] = []
    periodic: list[Sink] = []
    try:
        wanted = _env_sink_names(settings, taken)
        for name in sorted(wanted, key=lambda n: n in WRITTEN_AT_ONCE):  # they last: nothing after can fail
            sink = _env_sink(name, wanted[name], settings, config)
            if name not in SUPPORTED_BACKENDS and sink.metrics is not None and not _is_step_exporter(sink.metrics):
                periodic.append(sink)
            else:
                step_sinks.append(sink)
    except BaseException:
        for sink in [*step_sinks, *periodic]:
            sink.finish(1)
        raise
    return step_sinks, periodic


def _is_step_exporter(exporter: Any) -> bool:
    from otel_tracking.exporters._base import StepMetricExporter

    return isinstance(exporter, StepMetricExporter)


def _env_sink(name: str, signals: set[str], settings: Settings, config: RunConfig) -> Sink:
    if name in SUPPORTED_BACKENDS and name != "rl_insight":
        sink = build_checked_sink(name, settings, config, signals=signals)
        sink.exporters = sink.exporters.only({SIGNAL_PART[signal] for signal in signals})
        return sink
    exporters = {signal: _load_entry_point(signal, name)() for signal in signals}
    parts = SinkParts(
        metrics=exporters.get("metrics"),
        spans=exporters.get("traces"),
        logs=exporters.get("logs"),
        where=f"OpenTelemetry exporter {name!r}",
    )
    return Sink(name, parts)


def _load_entry_point(signal: str, name: str) -> Any:
    from importlib.metadata import entry_points

    group = _GROUPS[signal]
    found = list(entry_points(group=group, name=name))
    if not found:
        available = sorted({ep.name for ep in entry_points(group=group)})
        raise ConfigError(
            f"OTEL_{signal.upper()}_EXPORTER names {name!r}, which is neither one of our backends "
            f"({', '.join(b for b in SUPPORTED_BACKENDS if b != 'rl_insight')}) nor an installed "
            f"{group} entry point ({', '.join(available)})"
        )
    return found[0].load()
