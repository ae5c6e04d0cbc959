"""Shared test setup: every test runs in its own directory with a clean environment, and the
reference module (verl's tracking.py, ``../shared/baseline/seed_tracking.py``) is importable for
differential tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
# The reference lives beside the repository (shared/baseline); OTEL_TRACKING_SHARED overrides.
SHARED = Path(os.environ.get("OTEL_TRACKING_SHARED", REPO.parent / "shared"))

_CLEARED_PREFIXES = (
    "OTEL_",
    "VERL_",
    "WANDB_",
    "MLFLOW_",
    "SWANLAB_",
    "CLEARML_",
    "TRACKIO_",
    "TENSORBOARD_",
    "VOLC_",
    "MLP_",
)


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh working directory and an environment without any tracker or OTel variables."""
    for name in list(os.environ):
        if name.startswith(_CLEARED_PREFIXES) or name == "RANK":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACKING_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    _finish_leftover_runs()


def _finish_leftover_runs() -> None:
    from otel_tracking.runtime import run as run_module

    while (leftover := run_module.current_run()) is not None:
        leftover.finish()
    run_module._driver_finished_pid = None  # each test is a process that has not had a Tracking yet
    run_module._said_not_recorded = False


@pytest.fixture(scope="session")
def seed(request: pytest.FixtureRequest) -> ModuleType:
    """The reference module: shared/baseline beside the repository, else verl's own tracking.py
    from PyPI (tests/reference.py); the terminal says which one the differential tests ran against."""
    from tests import reference

    module, which = reference.load(SHARED)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\ndifferential tests against the reference: {which}")
    return module


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trackio reads TRACKIO_DIR once, at its first import: every test of the session shares one."""
    return tmp_path_factory.mktemp("trackio")


@pytest.fixture(scope="session")
def clearml_config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ClearML may read its configuration once per process: keep the file for the whole session.
    path = tmp_path_factory.mktemp("clearml") / "clearml.conf"
    path.write_text("sdk {\n  development {\n    report_use_subprocess: false\n  }\n}\n")
    return path


class PlainSdk:
    """A plain OpenTelemetry SDK setup, as an application builds one without our facade: the given
    exporters behind the SDK's own PeriodicExportingMetricReader (flushed by hand at each step) and
    simple span and log processors."""

    def __init__(self, metrics: Any, spans: Any, logs: Any = None) -> None:
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        reader = PeriodicExportingMetricReader(metrics, export_interval_millis=3_600_000)
        self.meters = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        self.tracers = TracerProvider(shutdown_on_exit=False)
        self.tracers.add_span_processor(SimpleSpanProcessor(spans))
        self.loggers = None
        if logs is not None:
            self.loggers = LoggerProvider(shutdown_on_exit=False)
            self.loggers.add_log_record_processor(SimpleLogRecordProcessor(logs))
        self._meter = self.meters.get_meter("app")
        self._gauges: dict[str, Any] = {}

    def log_step(self, step: int, values: dict[str, float]) -> None:
        """The app's own gauges, with the step as the gauge ``train.step``; one collection."""
        for name, value in {"train.step": step, **values}.items():
            if name not in self._gauges:
                self._gauges[name] = self._meter.create_gauge(name)
            self._gauges[name].set(value)
        self.meters.force_flush()

    def span(self, name: str, **attributes: Any) -> None:
        with self.tracers.get_tracer("app").start_as_current_span(name, attributes=attributes):
            pass

    def emit(self, event_name: str, body: Any, attributes: dict[str, Any]) -> None:
        assert self.loggers is not None
        self.loggers.get_logger("app").emit(event_name=event_name, body=body, attributes=attributes)

    def shutdown(self) -> None:
        for provider in (self.meters, self.tracers, self.loggers):
            if provider is not None:
                provider.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# log() p99 beside a failing backend may be at most twice the healthy one, plus this much: on a
# loaded 2-core machine sub-millisecond p99s jitter by more than 2x, while the failure these tests
# catch (log() waiting on a backend that takes 0.5-1 s a request) adds hundreds of milliseconds.
P99_SLACK_S = 0.002


def p99_holds(failing: list[float], healthy: list[float]) -> bool:
    """Each side's best round: noise only ever adds latency."""
    return bool(failing) and min(failing) <= 2 * min(healthy) + P99_SLACK_S


# What a training script passes to log() as a value, edge cases first: NaN, infinities, ints
# beyond 64 bits, bools, and what is not a number (for the trackers' fast paths' fallbacks).
STEP_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.sampled_from(["a string", None]),
)
