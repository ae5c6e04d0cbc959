"""Our backend names to sinks: the trackers, and the file and console sinks.

The facade's ``default_backend`` names (verl's ten) resolve here, and so do those names when an
``OTEL_*_EXPORTER`` variable names one (``env_sinks.py``); the OTLP sinks are ``otlp_sinks.py``'s.
Each tracker lives in ``otel_tracking.exporters.<module>`` and exposes
``open_tracker(TrackerContext) -> SinkParts``; it is imported only when its backend is asked for,
so ``import otel_tracking`` never imports a tracker's SDK.  :func:`check_tracker` finds what is
wrong (a missing package, a bad setting) before anything opens.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from otel_tracking.config.run_config import RunConfig, restart_step
from otel_tracking.config.settings import ConfigError, Settings
from otel_tracking.config.trackers import SUPPORTED_BACKENDS, TRACKERS
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.exporters._base import SinkParts

# Sinks that print or create files the moment they are built: a run builds them last, so that a
# Tracking() that fails leaves nothing written.
WRITTEN_AT_ONCE = ("file", "console")

logger = logging.getLogger("otel_tracking")

# a signal -> the SinkParts field of its exporter
SIGNAL_PART = {"metrics": "metrics", "traces": "spans", "logs": "logs"}


def build_sink(
    name: str, settings: Settings, config: RunConfig, resume: Any = None, signals: Iterable[str] | None = None
) -> Sink:
    """The sink for one of our backend names (not ``rl_insight``, which is the OTLP path);
    ``signals``: the ones it is built for (default: all three)."""
    if name == "file":
        from otel_tracking.exporters.file import FileLogExporter, FileMetricExporter, FileSink, FileSpanExporter

        assert settings.file_path is not None
        wanted = {"metrics", "traces", "logs"} if signals is None else set(signals)
        metrics = "metrics" in wanted
        # A resumed run appends, after a line saying where the new attempt starts (exporters/file.py).
        files = FileSink(
            settings.file_path,
            attempt=settings.attempt if settings.resumed is not None else None,
            run_id=settings.run_id,
            checkpoint_step=restart_step(settings, config) if settings.resumed is not None else None,
        )
        files.open(metrics=metrics)  # fail now on an unwritable directory, as the reference did
        shown = files.path if metrics else files.events_path
        print(f"Creating file logger at {shown.resolve()}")
        where = [f"{files.path.resolve()} (metrics)"] if metrics else []
        if wanted & {"traces", "logs"}:
            where.append(f"{files.events_path.resolve()} (spans, events)")
        parts = SinkParts(
            metrics=FileMetricExporter(files) if metrics else None,
            spans=FileSpanExporter(files),
            logs=FileLogExporter(files),
            where=", ".join(where),
        )
        return Sink("file", parts, inline=True)
    if name == "console":
        from otel_tracking.exporters.console import ConsoleMetricExporter

        return Sink("console", SinkParts(metrics=ConsoleMetricExporter(), where="stdout"), inline=True)
    return Sink(name, open_tracker(name, settings, config, resume), named_events_only=True)


def build_checked_sink(
    name: str, settings: Settings, config: RunConfig, resume: Any = None, signals: Iterable[str] | None = None
) -> Sink:
    """:func:`build_sink`, with the errors a user can act on said plainly."""
    with _plain_errors(name):
        return build_sink(name, settings, config, resume, signals)


def open_tracker(
    name: str, settings: Settings, config: RunConfig, resume: Any = None, in_bridge_process: bool = False
) -> SinkParts:
    """Open one tracker's run (this may take long: imports, a server); its exporters."""
    if name not in TRACKERS:
        raise ConfigError(f"{name!r} is not a backend; supported: {', '.join(SUPPORTED_BACKENDS)}")
    check_tracker(name, settings)
    from otel_tracking.exporters._base import TrackerContext

    continuing = resume is None and settings.resumed is not None
    if continuing:  # OTEL_TRACKING_RESUME found the previous attempt: reattach to its run of this tracker
        assert settings.resumed is not None
        resume = settings.resumed.backends.get(name)
    context = TrackerContext(
        project=settings.project,
        experiment=settings.experiment,
        config=config.recorded,
        inputs=dict(config.inputs),
        env=settings.env,
        run_id=settings.run_id,
        resume=resume,
        attempt=settings.attempt,
        continuing=continuing,
        checkpoint_step=restart_step(settings, config) if continuing else None,
        in_bridge_process=in_bridge_process,
    )
    parts: SinkParts = _tracker_module(name).open_tracker(context)
    return parts


def open_checked_tracker(
    name: str, settings: Settings, config: RunConfig, in_bridge_process: bool = False
) -> SinkParts:
    """:func:`open_tracker`, with the errors a user can act on said plainly."""
    with _plain_errors(name):
        return open_tracker(name, settings, config, in_bridge_process=in_bridge_process)


@contextlib.contextmanager
def _plain_errors(name: str) -> Iterator[None]:
    try:
        yield
    except ModuleNotFoundError as error:
        raise ConfigError(
            f"backend {name!r} needs the {error.name!r} package: pip install 'otel-tracking[{name}]'"
        ) from error
    except OSError as error:
        raise ConfigError(f"backend {name!r} cannot write where it should: {error}") from error


def check_tracker(name: str, settings: Settings) -> None:
    """What is wrong with a tracker's setup that needs no server to find, found in milliseconds and
    without importing its SDK: a missing package (one rule for every tracker: ``ConfigError``
    naming the extra to install) and the tracker's own ``check_environment`` (e.g. an MLflow
    tracking URI MLflow would refuse)."""
    package = TRACKERS[name].sdk
    if not _installed(package):
        if name == "vemlp_wandb":
            raise ConfigError(
                f"backend 'vemlp_wandb' needs Volcengine ML Platform's SDK, the {package!r} package, "
                "which is not installed in this environment"
            )
        raise ConfigError(f"backend {name!r} needs the {package!r} package: pip install 'otel-tracking[{name}]'")
    check = getattr(_tracker_module(name), "check_environment", None)
    if check is not None:
        check(settings.env)


def import_sdk(name: str) -> None:
    """Import the tracker's SDK package (what :func:`open_tracker` would import first anyway)."""
    with _plain_errors(name):
        importlib.import_module(TRACKERS[name].sdk)


def _installed(package: str) -> bool:
    """Whether ``import package`` would find it; the package itself is not imported."""
    if package in sys.modules:  # imported already, or a stand-in (None: blocked)
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _tracker_module(name: str) -> Any:
    """The tracker's module: light, its SDK is imported only when a run is opened."""
    return importlib.import_module(f"otel_tracking.exporters.{TRACKERS[name].module}")


def is_tracker(name: str) -> bool:
    """An ML tracker (runs in the bridge process unless OTEL_TRACKING_BRIDGE_PROCESS=false)."""
    return name in TRACKERS
