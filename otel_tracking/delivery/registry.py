"""Backend names to sinks.

The facade's ``default_backend`` names (verl's ten) and the names in ``OTEL_*_EXPORTER`` both
resolve here.  Each ML bridge lives in ``otel_tracking.exporters.<module>`` and exposes
``open_bridge(BridgeContext) -> BridgeParts``; it is imported only when its backend is asked for,
so ``import otel_tracking`` never imports a tracker's SDK.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.config.otlp_failures import explain_failures
from otel_tracking.config.resume import checkpoint_step
from otel_tracking.config.settings import ConfigError, Settings, describe_otlp
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.exporters._base import BridgeParts
from otel_tracking.signals.redact import redact_config, scrub_text

SUPPORTED_BACKENDS: tuple[str, ...] = (
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "tensorboard",
    "console",
    "clearml",
    "trackio",
    "file",
    "rl_insight",
)

# Sinks that print or create files the moment they are built: a run builds them last, so that a
# Tracking() that fails leaves nothing written.
WRITTEN_AT_ONCE = ("file", "console")

# backend name -> module under otel_tracking.exporters
_BRIDGES = {
    "wandb": "wandb",
    "vemlp_wandb": "vemlp_wandb",
    "mlflow": "mlflow",
    "swanlab": "swanlab",
    "tensorboard": "tensorboard",
    "clearml": "clearml",
    "trackio": "trackio",
}
# backend name -> the top-level package of its SDK (the extra of the same name installs it)
_SDKS = {
    "wandb": "wandb",
    "vemlp_wandb": "volcengine_ml_platform",  # no extra of ours installs this one
    "mlflow": "mlflow",
    "swanlab": "swanlab",
    "tensorboard": "tensorboard",
    "clearml": "clearml",
    "trackio": "trackio",
}
logger = logging.getLogger("otel_tracking")
_GROUPS = {
    "metrics": "opentelemetry_metrics_exporter",
    "traces": "opentelemetry_traces_exporter",
    "logs": "opentelemetry_logs_exporter",
}


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
        parts = BridgeParts(
            metrics=FileMetricExporter(files) if metrics else None,
            spans=FileSpanExporter(files),
            logs=FileLogExporter(files),
            where=", ".join(where),
        )
        return Sink("file", parts, inline=True)
    if name == "console":
        from otel_tracking.exporters.console import ConsoleMetricExporter

        return Sink("console", BridgeParts(metrics=ConsoleMetricExporter(), where="stdout"), inline=True)
    return Sink(name, open_bridge(name, settings, config, resume), named_events_only=True)


def build_checked_sink(
    name: str, settings: Settings, config: RunConfig, resume: Any = None, signals: Iterable[str] | None = None
) -> Sink:
    """:func:`build_sink`, with the errors a user can act on said plainly."""
    with _plain_errors(name):
        return build_sink(name, settings, config, resume, signals)


@dataclass(frozen=True)
class RunConfig:
    """The run's config as the bridges get it, made once, where ``Tracking`` takes it: redacted
    (``recorded``: what trackers record, as params or the run's config), and the values a bridge
    uses as they are (``inputs``, taken before redaction: today ``trainer.wandb_proxy``, which
    wandb must reach with the credentials in its URL while the config it records says
    ``http://<redacted>@proxy:8080``), never logged or recorded; and the step of the checkpoint a
    verl job resumes from, as its config says (``resume.checkpoint_step``)."""

    recorded: Any = None
    inputs: Mapping[str, str] = field(default_factory=dict)
    checkpoint_step: int | None = None

    @classmethod
    def of(cls, config: Any) -> RunConfig:
        inputs: dict[str, str] = {}
        trainer = config.get("trainer") if isinstance(config, Mapping) or _mapping_like(config) else None
        if isinstance(trainer, Mapping) or _mapping_like(trainer):
            proxy = trainer.get("wandb_proxy")  # type: ignore[union-attr]
            if proxy:
                inputs["wandb_proxy"] = str(proxy)
        return cls(redact_config(config), inputs, checkpoint_step(config))


def restart_step(settings: Settings, config: RunConfig) -> int | None:
    """The checkpoint step a resumed job restarts from (config/resume.py): OTEL_TRACKING_RESUME_STEP,
    else what verl's config says; None: the step before the first one it logs."""
    return settings.resume_step if settings.resume_step is not None else config.checkpoint_step


def _mapping_like(value: Any) -> bool:
    # OmegaConf's DictConfig: get() and items(), no Mapping subclass.
    return hasattr(value, "get") and hasattr(value, "items") and not isinstance(value, (str, bytes))


def open_bridge(
    name: str, settings: Settings, config: RunConfig, resume: Any = None, in_bridge_process: bool = False
) -> BridgeParts:
    """Open one tracker's run (this may take long: imports, a server); its exporters."""
    if name not in _BRIDGES:
        raise ConfigError(f"{name!r} is not a backend; supported: {', '.join(SUPPORTED_BACKENDS)}")
    check_bridge(name, settings)
    from otel_tracking.exporters._base import BridgeContext

    continuing = resume is None and settings.resumed is not None
    if continuing:  # OTEL_TRACKING_RESUME found the previous attempt: reattach to its run of this tracker
        assert settings.resumed is not None
        resume = settings.resumed.backends.get(name)
    context = BridgeContext(
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
    parts: BridgeParts = _bridge_module(name).open_bridge(context)
    return parts


def open_checked_bridge(
    name: str, settings: Settings, config: RunConfig, in_bridge_process: bool = False
) -> BridgeParts:
    """:func:`open_bridge`, with the errors a user can act on said plainly."""
    with _plain_errors(name):
        return open_bridge(name, settings, config, in_bridge_process=in_bridge_process)


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


def check_bridge(name: str, settings: Settings) -> None:
    """What is wrong with a tracker's setup that needs no server to find, found in milliseconds and
    without importing its SDK: a missing package (one rule for every tracker: ``ConfigError``
    naming the extra to install) and the bridge's own ``check_environment`` (e.g. an MLflow
    tracking URI MLflow would refuse)."""
    package = _SDKS[name]
    if not _installed(package):
        if name == "vemlp_wandb":
            raise ConfigError(
                f"backend 'vemlp_wandb' needs Volcengine ML Platform's SDK, the {package!r} package, "
                "which is not installed in this environment"
            )
        raise ConfigError(f"backend {name!r} needs the {package!r} package: pip install 'otel-tracking[{name}]'")
    check = getattr(_bridge_module(name), "check_environment", None)
    if check is not None:
        check(settings.env)


def import_sdk(name: str) -> None:
    """Import the tracker's SDK package (what :func:`open_bridge` would import first anyway)."""
    with _plain_errors(name):
        importlib.import_module(_SDKS[name])


def _installed(package: str) -> bool:
    """Whether ``import package`` would find it; the package itself is not imported."""
    if package in sys.modules:  # imported already, or a stand-in (None: blocked)
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _bridge_module(name: str) -> Any:
    """The bridge's module: light, its SDK is imported only when a run is opened."""
    return importlib.import_module(f"otel_tracking.exporters.{_BRIDGES[name]}")


def is_bridge(name: str) -> bool:
    """An ML tracker's bridge (runs in the bridge process unless OTEL_TRACKING_BRIDGE_PROCESS=false)."""
    return name in _BRIDGES


_OTLP_SIGNALS = {"metrics": "METRICS", "traces": "TRACES", "logs": "LOGS"}


def otlp_endpoint(signal: str, protocol: str, env: Mapping[str, str]) -> tuple[str, bool]:
    """The URL the SDK's exporter for ``signal`` sends to, by the standard variables' rules, and
    whether a variable set it (False: the SDK's default)."""
    own = env.get(f"OTEL_EXPORTER_OTLP_{_OTLP_SIGNALS[signal]}_ENDPOINT")
    if own:
        return own, True
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if protocol == "grpc":
        return base or "http://localhost:4317", bool(base)
    root = base or "http://localhost:4318"
    return f"{root if root.endswith('/') else root + '/'}v1/{signal}", bool(base)


def build_otlp_sinks(settings: Settings, remembered: Mapping[str, str] | None = None) -> dict[str, Sink]:
    """OTLP exporters for the signals the settings turn on; they read endpoint, headers and TLS
    from the standard OTEL_EXPORTER_OTLP_* variables themselves.  ``remembered`` (replay: signal
    -> the endpoint a spool header names) is used for a signal whose endpoint no variable sets."""
    otlp = settings.otlp
    if not otlp.any:
        return {}
    from otel_tracking.config.otel_compat import one_try_per_export, otlp_log_exporter_class

    OTLPLogExporter = otlp_log_exporter_class(otlp.protocol)
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]

    if otlp.protocol != "grpc":
        # requests imports netrc on a session's first request, on our worker thread: a fork() in
        # the middle of that import leaves the module's import lock held in the child, whose own
        # exports then hang on it forever.  Import it now, before any worker runs.
        import netrc  # noqa: F401

    where = describe_otlp(settings)
    _warn_if_unreachable(otlp.endpoint)
    # Over HTTP, a CA file from OTEL_EXPORTER_OTLP_CERTIFICATE must win over REQUESTS_CA_BUNDLE,
    # which requests would otherwise let override the exporter's own setting.
    args: dict[str, Any] = {"session": _certificate_session()} if otlp.certificate and otlp.protocol != "grpc" else {}
    exporters = {"metrics": OTLPMetricExporter, "traces": OTLPSpanExporter, "logs": OTLPLogExporter}
    sinks: dict[str, Sink] = {}
    for signal in (s for s in ("metrics", "traces", "logs") if getattr(otlp, s)):
        endpoint, from_env = otlp_endpoint(signal, otlp.protocol, os.environ)
        signal_args, signal_where = args, where
        if not from_env and remembered and remembered.get(signal):
            endpoint = remembered[signal]
            signal_args = {**args, "endpoint": endpoint}
            signal_where = f"OTLP {otlp.protocol} -> {endpoint} (the run's endpoint, kept in its spool)"
        parts = BridgeParts(
            **{_SINK_ARGUMENT[signal]: explain_failures(one_try_per_export(exporters[signal](**signal_args)))},
            where=signal_where,
            # In the spool header: replay sends to the same endpoint unless a variable says
            # otherwise (not one with credentials in it: those stay off the disk).
            resume={"endpoint": endpoint if scrub_text(endpoint) == endpoint else None, "protocol": otlp.protocol},
        )
        sinks[signal] = Sink(f"otlp-{signal}", parts)
    return sinks


_SINK_ARGUMENT = {"metrics": "metrics", "traces": "spans", "logs": "logs"}


def _certificate_session() -> Any:
    import requests

    class CertificateSession(requests.Session):
        def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any, cert: Any) -> Any:
            merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
            # The exporter's CA file (OTEL_EXPORTER_OTLP_CERTIFICATE): the session's `verify` since the
            # SDK's HTTP transport (1.45), the request's own `verify` argument before it.
            merged["verify"] = self.verify if verify is None else verify
            return merged

    return CertificateSession()


def _warn_if_unreachable(endpoint: str | None) -> None:
    """One clear line at construction when nothing listens at the OTLP endpoint (a 0.2 s TCP
    connect).  Not an error: the collector may come up later, and until then the data waits."""
    import socket
    from urllib.parse import urlsplit

    if not endpoint:
        return
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 4318)
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=0.2):
            return
    except OSError as error:
        logger.warning(
            "otel-tracking: the OTLP endpoint %s is not reachable now (%s); telemetry for it is retried and "
            "spooled until it is (see `otel-tracking replay`)",
            endpoint,
            error.strerror or type(error).__name__,
        )


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
            if is_bridge(name):
                check_bridge(name, settings)
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
        sink.exporters = sink.exporters.only({_SINK_ARGUMENT[signal] for signal in signals})
        return sink
    exporters = {signal: _load_entry_point(signal, name)() for signal in signals}
    parts = BridgeParts(
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
