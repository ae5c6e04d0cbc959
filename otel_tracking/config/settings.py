"""The runtime's variables (``OTEL_*``, ``OTEL_TRACKING_*``) are read here, but for those that say
where files go (``paths.py``) and the set a driver hands its workers
(``distributed/environment.py``); docs/architecture/design-notes.md says which other module reads which
variable (each tracker its backend's, replay its destinations, the CLI its own, the verl switch, the
stack's cache).

The facade builds one :class:`Settings` per run from explicit arguments plus the environment; the
exporters, which must also work when a plain OpenTelemetry SDK constructs them with no arguments,
call the small ``*_from_env`` helpers below.  Malformed values raise :class:`ConfigError` with the
variable's name, at construction time, rather than a traceback from deep inside a backend later.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.util.re import parse_env_headers

from otel_tracking.config import paths
from otel_tracking.config.policy import Policy
from otel_tracking.config.resume import NEVER, Resumed, is_run_id, looks_like_a_mode, parse_mode
from otel_tracking.config.traces_link import check_traces_url
from otel_tracking.signals import semconv
from otel_tracking.signals.redact import redact_header_values, scrub_text

# The OTel exporter names we understand in OTEL_*_EXPORTER besides our own backends.
OTLP_NAMES = ("otlp", "otlp_proto_http", "otlp_proto_grpc")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


class ConfigError(ValueError):
    """A configuration value (an argument or an environment variable) that cannot be used; raised
    by ``Tracking()`` before anything is opened or written, its message naming the value and what
    is accepted.  A ``ValueError``, so code that catches those catches it too.

    Example:

    ```python
    import os
    from otel_tracking import ConfigError, Tracking

    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/json"
    try:
        Tracking(project_name="p", experiment_name="e")
    except ConfigError as error:
        print(error)  # OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported; use 'grpc' or 'http/protobuf'
    ```
    """


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _bool(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use true or false")


def _names(env: Mapping[str, str], name: str) -> tuple[str, ...] | None:
    """A comma-separated exporter list; None when unset, () for "none"."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    if "none" in names:
        if len(names) > 1:
            raise ConfigError(f"{name}={raw!r}: 'none' cannot be combined with other exporters")
        return ()
    return names


def parse_key_value_list(raw: str, variable: str) -> dict[str, str]:
    """Parse the W3C-baggage-like ``k1=v1,k2=v2`` format of OTEL_RESOURCE_ATTRIBUTES and headers."""
    from urllib.parse import unquote

    result: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            # Never echo the item itself: headers carry credentials.
            raise ConfigError(f"{variable} has an entry without 'key=value' (entry {len(result) + 1})")
        result[unquote(key.strip())] = unquote(value.strip())
    return result


@dataclass(frozen=True)
class OtlpSettings:
    """Which signals go to an OTLP endpoint, and how.  The OTLP exporter classes read the standard
    endpoint/header/TLS variables themselves; we only decide whether to build them and check that
    the values parse, so that a typo fails at construction."""

    traces: bool = False
    metrics: bool = False
    logs: bool = False
    protocol: str = "http/protobuf"
    metric_interval_s: float = 60.0
    endpoint: str | None = None
    header_names: tuple[str, ...] = ()
    certificate: bool = False  # OTEL_EXPORTER_OTLP_(<SIGNAL>_)CERTIFICATE is set

    @property
    def any(self) -> bool:
        return self.traces or self.metrics or self.logs


@dataclass(frozen=True)
class Settings:
    project: str
    experiment: str
    backends: tuple[str, ...]
    service_name: str
    resource_attributes: dict[str, str]
    run_id: str
    rank: int | None
    host: str
    otlp: OtlpSettings
    # Extra exporters named in OTEL_*_EXPORTER that are neither OTLP nor one of our backends;
    # they are loaded from entry points by the run.
    extra_metric_exporters: tuple[str, ...] = ()
    extra_span_exporters: tuple[str, ...] = ()
    extra_log_exporters: tuple[str, ...] = ()
    sdk_disabled: bool = False
    delivery: Policy = field(default_factory=Policy)
    finish_timeout_s: float = 30.0
    start_timeout_s: float = 5.0  # how long Tracking() waits for the bridge process to open the trackers
    bridge_process: bool = True  # the ML trackers run in a child process (bridges/process.py)
    spool_dir: Path = Path("spool")
    spool_writable: bool | None = None  # None: not checked yet (spool.check_spool_dir)
    spool_max_bytes: int = 1 << 30  # OTEL_TRACKING_SPOOL_MAX_MB: a tracker's log on disk, at most (spool.py)
    file_path: Path | None = None
    tensorboard_dir: Path | None = None
    role: str | None = None  # ml.role: what this process does in the job (driver, actor, rollout, ...)
    resume: str = NEVER  # OTEL_TRACKING_RESUME: never, auto or a run id (resume.py)
    attempt: int = 1  # ml.run.attempt: 1 for a new run, one more for each resume
    resumed: Resumed | None = None  # the previous attempt's record, when resuming found one
    resume_step: int | None = None  # OTEL_TRACKING_RESUME_STEP: the checkpoint a resumed job restarts from
    # OTEL_TRACKING_STALL_AFTER: one stall bound for every phase (None: learned; 0: no reports) and
    # OTEL_TRACKING_STALL_FLOOR: the least a learned bound is (runtime/stalls.py)
    stall_after_s: float | None = None
    stall_floor_s: float = 300.0
    traces_url: str | None = None  # OTEL_TRACKING_TRACES_URL: a trace UI the summary links to (traces_link.py)
    # OTEL_TRACKING_ANATOMY: each step's anatomy/* numbers (runtime/anatomy.py; None: when verl's
    # phases are instrumented), with the phase buckets OTEL_TRACKING_ANATOMY_BUCKETS adds
    anatomy: bool | None = None
    anatomy_buckets: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)


def build_settings(
    project: str,
    experiment: str,
    backends: tuple[str, ...],
    env: Mapping[str, str] | None = None,
    force_otlp: bool = False,
    resume: str | None = None,
    run_id: str | None = None,
) -> Settings:
    """Combine the facade's arguments with the environment.

    ``run_id`` (workers, replay: the id the caller's baggage or a spool header names) takes the
    place of OTEL_TRACKING_RUN_ID, which must otherwise be a usable run id when it is set.

    ``resume`` (else OTEL_TRACKING_RESUME, default ``never``): ``auto`` or a run id looks up the
    previous attempt's reattach record (``resume.py``); found, the run id is the record's and the
    attempt one more than its.

    ``backends`` are the facade's ``default_backend`` names (already validated).  OTLP is on for a
    signal when OTEL_<SIGNAL>_EXPORTER names ``otlp``, or, when that variable is unset, when an
    OTLP endpoint is configured (or ``force_otlp``: the ``rl_insight`` backend).  Names in
    OTEL_<SIGNAL>_EXPORTER that are our backends join the run as extra sinks for that signal.
    """
    e = _env(env)
    sdk_disabled = e.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"  # the SDK's rule: only "true"

    protocol = e.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf").strip() or "http/protobuf"
    if protocol not in ("grpc", "http/protobuf"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use 'grpc' or 'http/protobuf'")
    endpoint = e.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if endpoint is not None:
        _check_endpoint(endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT")
    header_names: list[str] = []
    for variable in ("OTEL_EXPORTER_OTLP_HEADERS", *(f"OTEL_EXPORTER_OTLP_{s}_HEADERS" for s in _SIGNALS)):
        if variable in e:
            parse_key_value_list(e[variable], variable)  # a malformed entry is an error here, not a skip
            header_names.extend(parse_env_headers(e[variable], liberal=True))  # as the exporters read them

    interval_raw = e.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")
    try:
        interval_ms = float(interval_raw)
    except ValueError:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL={interval_raw!r} is not a number of milliseconds") from None
    if not 0 < interval_ms < math.inf:  # the SDK's periodic reader starts no thread for inf or nan
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL={interval_raw!r} must be positive and finite")

    # Read by the SDK's OTLP exporters, in seconds: checked here so a bad value is an error now.
    for variable in ("OTEL_EXPORTER_OTLP_TIMEOUT", *(f"OTEL_EXPORTER_OTLP_{s}_TIMEOUT" for s in _SIGNALS)):
        if _number(e, variable, 10.0, minimum=0.0) == 0 and e.get(variable, "").strip():
            raise ConfigError(f"{variable}={e[variable]!r} must be more than 0 seconds")

    selected: dict[str, bool] = {}
    extras: dict[str, tuple[str, ...]] = {}
    for signal in _SIGNALS:
        names = _names(e, f"OTEL_{signal}_EXPORTER")
        signal_endpoint = e.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        if signal_endpoint is not None:
            _check_endpoint(signal_endpoint, f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        if names is None:
            selected[signal] = force_otlp or endpoint is not None or signal_endpoint is not None
            extras[signal] = ()
        else:
            selected[signal] = any(n in OTLP_NAMES for n in names)
            extras[signal] = tuple(n for n in names if n not in OTLP_NAMES)
    if sdk_disabled:
        selected = dict.fromkeys(selected, False)
        extras = dict.fromkeys(extras, ())

    try:
        if resume is not None:
            mode = parse_mode(resume, "Tracking(resume=...)")
        else:
            mode = parse_mode(e.get("OTEL_TRACKING_RESUME"))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    explicit_id = run_id if run_id else _run_id(e)
    if mode not in (NEVER, "auto"):  # a run id: resume that run
        if explicit_id and explicit_id != mode:
            raise ConfigError(
                f"OTEL_TRACKING_RESUME={mode!r} and OTEL_TRACKING_RUN_ID={explicit_id!r} name different runs"
            )
        explicit_id = mode
    rank = _rank(e)
    resumed = _find_resumed(project, experiment, mode, explicit_id, rank, e)
    # "atuo": a typo, not the id of a run to start
    if resumed is None and mode not in (NEVER, "auto") and looks_like_a_mode(mode):
        source = "Tracking(resume=...)" if resume is not None else "OTEL_TRACKING_RESUME"
        raise ConfigError(
            f"{source}={mode!r} is neither 'auto' nor 'never', and no run with that id was found; did you mean 'auto'?"
        )
    run_id = resumed.run_id if resumed else (explicit_id or uuid.uuid4().hex)
    policy = Policy(
        queue_size=int(_number(e, "OTEL_TRACKING_QUEUE_SIZE", Policy.queue_size, minimum=1, integer=True)),
        max_attempts=int(_number(e, "OTEL_TRACKING_MAX_ATTEMPTS", Policy.max_attempts, minimum=1, integer=True)),
        probe_interval_s=_number(e, "OTEL_TRACKING_PROBE_INTERVAL", Policy.probe_interval_s, minimum=0.0),
        export_interval_s=_number(e, "OTEL_BSP_SCHEDULE_DELAY", 0.0, minimum=0.0) / 1000.0,
    )

    resource_attributes = {}
    if "OTEL_RESOURCE_ATTRIBUTES" in e:
        resource_attributes = parse_key_value_list(e["OTEL_RESOURCE_ATTRIBUTES"], "OTEL_RESOURCE_ATTRIBUTES")
    service_name = e.get("OTEL_SERVICE_NAME") or resource_attributes.get("service.name") or project

    return Settings(
        project=project,
        experiment=experiment,
        backends=backends,
        service_name=service_name,
        resource_attributes=resource_attributes,
        run_id=run_id,
        rank=rank,
        host=socket.gethostname(),
        otlp=OtlpSettings(
            traces=selected["TRACES"],
            metrics=selected["METRICS"],
            logs=selected["LOGS"],
            protocol=protocol,
            metric_interval_s=interval_ms / 1000.0,
            endpoint=endpoint,
            header_names=tuple(header_names),
            certificate=any(
                e.get(v)
                for v in ("OTEL_EXPORTER_OTLP_CERTIFICATE", *(f"OTEL_EXPORTER_OTLP_{s}_CERTIFICATE" for s in _SIGNALS))
            ),
        ),
        extra_metric_exporters=extras["METRICS"],
        extra_span_exporters=extras["TRACES"],
        extra_log_exporters=extras["LOGS"],
        sdk_disabled=sdk_disabled,
        delivery=policy,
        finish_timeout_s=_number(e, "OTEL_TRACKING_FINISH_TIMEOUT", 30.0, minimum=0.0),
        start_timeout_s=_number(e, "OTEL_TRACKING_START_TIMEOUT", 5.0, minimum=0.0),
        bridge_process=_bool(e, "OTEL_TRACKING_BRIDGE_PROCESS", default=True),
        spool_dir=paths.spool_dir(project, experiment, run_id, e),
        spool_max_bytes=int(_number(e, "OTEL_TRACKING_SPOOL_MAX_MB", 1024, minimum=1) * (1 << 20)),
        file_path=paths.file_sink_path(project, experiment, e),
        tensorboard_dir=paths.tensorboard_dir(project, experiment, e),
        role=e.get("OTEL_TRACKING_ROLE") or None,
        resume=mode,
        attempt=resumed.attempt if resumed else 1,
        resumed=resumed,
        resume_step=_resume_step(e),
        stall_after_s=_stall_after(e),
        stall_floor_s=_number(e, "OTEL_TRACKING_STALL_FLOOR", 300.0, minimum=0.0),
        traces_url=_traces_url(e),
        anatomy=_bool(e, "OTEL_TRACKING_ANATOMY") if _set(e, "OTEL_TRACKING_ANATOMY") else None,
        anatomy_buckets=_anatomy_buckets(e),
        env=e,
    )


def _set(env: Mapping[str, str], name: str) -> bool:
    return bool((env.get(name) or "").strip())


def _stall_after(env: Mapping[str, str]) -> float | None:
    """None (unset): stall bounds are learned; 0: no stall reports."""
    return _number(env, "OTEL_TRACKING_STALL_AFTER", 0, minimum=0) if _set(env, "OTEL_TRACKING_STALL_AFTER") else None


def _anatomy_buckets(env: Mapping[str, str]) -> dict[str, str]:
    """``OTEL_TRACKING_ANATOMY_BUCKETS``: ``phase=bucket,...``, a bucket of ``semconv.BUCKETS``."""
    name = "OTEL_TRACKING_ANATOMY_BUCKETS"
    found: dict[str, str] = {}
    for item in env.get(name, "").split(","):
        phase, sep, bucket = (part.strip() for part in item.partition("="))
        if not item.strip():
            continue
        if not sep or not phase or bucket.lower() not in semconv.BUCKETS:
            raise ConfigError(
                f"{name}: {item.strip()!r} is not phase=bucket with a bucket of {', '.join(semconv.BUCKETS)}"
            )
        found[phase] = bucket.lower()
    return found


def _resume_step(env: Mapping[str, str]) -> int | None:
    if not _set(env, "OTEL_TRACKING_RESUME_STEP"):
        return None
    return int(_number(env, "OTEL_TRACKING_RESUME_STEP", 0, minimum=0, integer=True))


def _traces_url(env: Mapping[str, str]) -> str | None:
    try:
        return check_traces_url(env)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _find_resumed(
    project: str, experiment: str, mode: str, run_id: str | None, rank: int | None, env: Mapping[str, str]
) -> Resumed | None:
    """The previous attempt's record: for ``auto`` with OTEL_TRACKING_RUN_ID set, that run's."""
    from otel_tracking.config import resume

    if mode == NEVER:
        return None
    target = run_id if run_id else resume.AUTO
    project_dir = paths.spool_dir(project, experiment, "x", env).parent
    experiment_dirname = paths.spool_dir(project, experiment, "x", env).name[: -len("-x")]
    return resume.find(project_dir, experiment_dirname, project, experiment, rank, target)


_SIGNALS = ("TRACES", "METRICS", "LOGS")


def _check_endpoint(value: str, variable: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{variable} must be an http:// or https:// URL with a host, got {value!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise ConfigError(f"{variable} has a malformed port: {value!r}") from None


def _number(env: Mapping[str, str], name: str, default: float, minimum: float, integer: bool = False) -> float:
    """A finite number of at least ``minimum`` (a whole one when ``integer``), or ``ConfigError``
    naming the variable: ``inf`` and ``nan`` are refused here, not met later as an
    ``OverflowError`` in ``finish()`` or in the bridge process."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} must be a finite number")
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum:g}")
    if integer and value != int(value):
        raise ConfigError(f"{name}={raw!r} must be a whole number")
    return value


def _rank(env: Mapping[str, str]) -> int | None:
    """The first of RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID that is set (an empty one is not);
    a value that is not an integer is an error, not a reason to look at the next one."""
    for variable in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        raw = env.get(variable)
        if raw is None or not raw.strip():
            continue
        try:
            return int(raw.strip())
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not an integer (the process's rank)") from None
    return None


def _run_id(env: Mapping[str, str]) -> str | None:
    raw = env.get("OTEL_TRACKING_RUN_ID")
    if raw is None:
        return None
    if not raw.strip():
        raise ConfigError("OTEL_TRACKING_RUN_ID is set but empty; unset it to get a new run id")
    if not is_run_id(raw):
        raise ConfigError(
            f"OTEL_TRACKING_RUN_ID={raw!r} is not a run id: 1 to 128 letters, digits, '_', '.' or '-', not only dots"
        )
    return raw


def identity_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(project, experiment) for an exporter built by a plain OTel SDK setup: from
    OTEL_RESOURCE_ATTRIBUTES (ml.project / ml.experiment), else the service name, else defaults."""
    e = _env(env)
    attributes: dict[str, str] = {}
    if "OTEL_RESOURCE_ATTRIBUTES" in e:
        attributes = parse_key_value_list(e["OTEL_RESOURCE_ATTRIBUTES"], "OTEL_RESOURCE_ATTRIBUTES")
    project = attributes.get(semconv.PROJECT) or e.get("OTEL_SERVICE_NAME") or "otel-tracking"
    experiment = attributes.get(semconv.EXPERIMENT) or "run"
    return project, experiment


def rl_insight_enabled(env: Mapping[str, str] | None = None) -> bool:
    return _env(env).get("VERL_RL_INSIGHT_ENABLE") == "1"


def describe_otlp(settings: Settings) -> str:
    """A one-line description safe to print: endpoint and header *names* only, never values."""
    o = settings.otlp
    signals = [name for name, on in (("traces", o.traces), ("metrics", o.metrics), ("logs", o.logs)) if on]
    headers = redact_header_values(o.header_names)
    endpoint = scrub_text(o.endpoint) if o.endpoint else "default endpoint"  # https://user:pw@collector
    return f"OTLP {o.protocol} -> {endpoint} ({', '.join(signals)}){headers}"
