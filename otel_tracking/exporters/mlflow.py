"""MLflow tracker: metrics, params, timing scalars, traces and validation generations in one MLflow run.

What lands where (the reference is verl's ``Tracking(..., default_backend="mlflow")``):

* the run: tracking URI from ``MLFLOW_TRACKING_URI`` (default ``sqlite:////tmp/mlruns.db``, as the
  reference; one MLflow would refuse is a ``ConfigError`` before anything opens, see
  :func:`check_environment`); ``MLFLOW_RUN_ID`` attaches to that existing run, else the experiment named after the
  project (created when missing) gets a new run named after the experiment, with the tags MLflow's
  fluent ``start_run`` would set (``mlflow.runName``, ``mlflow.user``, ``mlflow.source.*``).
  Opening is tried :data:`INIT_ATTEMPTS` times, :data:`INIT_RETRY_SLEEP_S` apart; when every try
  fails the run goes on without MLflow (a warning, as the reference), and what is logged for it is
  spooled for ``otel-tracking replay``.
* params: the config flattened as the reference's ``_compute_mlflow_params_from_objects`` does
  (nested keys joined with ``/``, lists as ``list_len`` plus indices, dataclasses, ``Path``,
  ``Enum``), each value ``str()``-ed; secrets arrive already redacted.
* metrics: ``log(data, step)`` numbers via ``log_batch`` at that step, keys sanitized as the
  reference's ``_MlflowLoggingAdapter`` did (``@`` -> ``_at_``, repeated ``/`` collapsed, any other
  character outside ``[/\\w.\\- :]`` -> ``_``).  NaN is stored as NaN; MLflow's SQL store clamps
  +/-inf to +/-``sys.float_info.max`` (as it did for the reference).  Bools are stored as 1.0/0.0.
* spans: finished ``trace_state`` spans are the metric ``timing_s/state/<name>`` (seconds), once
  per step at the spans' step (with ``.../slowest`` for a phase several lanes ran:
  ``timings.StepTimings``), and each one an MLflow trace span (the same conversion MLflow's OTLP endpoint does),
  logged to the run's experiment; a trace is linked to the run when its root span arrives.
* events: ``ml.validation.generations`` becomes the artifact ``val_step{N}.json`` at the run's
  artifact root, ``[{"input", "output", "score"}, ...]``, byte-for-byte as the reference wrote it.
  The DAPO reward table is wandb-only in the reference and is ignored here.

Fixed against the reference:

* ``finish(exit_code)`` ends the MLflow run: FINISHED for 0, FAILED otherwise (the reference left it
  RUNNING until MLflow's own ``atexit`` hook marked it FINISHED, whatever the outcome);
* one bad key or value (a string, a key MLflow rejects such as one longer than 250 characters or
  ending with ``/``) is skipped with a warning; the reference lost every value of that step;
* a config key MLflow rejects as a param name is sanitized like a metric key (the reference's whole
  MLflow init failed), and one rejected param does not lose the others;
* no global MLflow state: the tracker uses ``MlflowClient`` with an explicit run id and never calls
  ``mlflow.set_tracking_uri``/``start_run``, so several runs (and threads) in one process do not
  fight over ``mlflow.active_run()``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.sdk.trace import ReadableSpan

from otel_tracking.config.settings import ConfigError
from otel_tracking.exporters._base import (
    Event,
    SinkParts,
    StepRecord,
    TrackerContext,
    TrackerSession,
    sample_parts,
    stall_markdown,
    stall_summary,
    tracker_exporters,
)
from otel_tracking.exporters._batching import Limits, Point, send_in_lanes
from otel_tracking.exporters.timings import PhaseTiming
from otel_tracking.signals import semconv
from otel_tracking.signals.redact import scrubbed_logger
from otel_tracking.signals.semconv import GENERATIONS_EVENT, STEP_SPAN_NAME
from otel_tracking.signals.semconv import STEP as STEP_ATTRIBUTE

logger = scrubbed_logger("otel_tracking.mlflow")

DEFAULT_TRACKING_URI = "sqlite:////tmp/mlruns.db"
INIT_ATTEMPTS = 3
INIT_RETRY_SLEEP_S = 5.0  # as the reference; tests set it small
_INVALID = "INVALID_PARAMETER_VALUE"
ATTEMPT_TAG = semconv.RUN_ATTEMPT  # on a resumed run: its attempt number (no tag: attempt 1)
_LINK_BATCH = 100  # MlflowClient.link_traces_to_run takes at most 100 trace ids per call
# log_batch's limits (mlflow.utils.validation: 1,000 metrics, 1 MB a request), with room for the
# request's own JSON; a metric's JSON is its key and ~70 bytes of value, timestamp and step.
BATCH_LIMITS = Limits(points=1_000, bytes=900_000)
_METRIC_JSON_BYTES = 100
# Requests in flight at once against a tracking server (one lane each, see _batching): as many as
# `mlflow server` has workers by default (4); MLflow's own async client keeps up to 10 in flight.
# A database URI writes in this process, where a second writer would only wait for the first.
REQUESTS_IN_FLIGHT = 4


# --- names and params ---------------------------------------------------------------------------

_REPEATED_SLASHES = re.compile(r"/{2,}")
_NOT_ALLOWED = re.compile(r"[^/\w.\- :]")


def sanitize_key(key: str) -> str:
    """A metric key as the reference's MLflow adapter wrote it: ``@`` -> ``_at_``, runs of ``/``
    become one, then every character MLflow refuses (outside ``[/\\w.\\- :]``) becomes ``_``."""
    return _NOT_ALLOWED.sub("_", _REPEATED_SLASHES.sub("/", key.replace("@", "_at_")))


def _plain_params(value: Any) -> Any:
    """Dataclasses to dicts, lists to ``{"list_len": n, "0": ..., ...}``, Path to str, Enum to its value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain_params(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _plain_params(v) for k, v in value.items()}
    if isinstance(value, list):
        converted: dict[str, Any] = {"list_len": len(value)}
        for index, item in enumerate(value):
            converted[str(index)] = _plain_params(item)
        return converted
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    return value


def _flatten(tree: Mapping[Any, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            _flatten(value, name, out)  # an empty dict leaves no param, as in the reference
        else:
            out[name] = value


def flatten_params(config: Any) -> dict[str, Any]:
    """The reference's ``_compute_mlflow_params_from_objects`` (values not yet ``str()``-ed), keys as
    ``str``: top-level leaves first, then the nested ones joined with ``/`` (a nested leaf wins over
    a top-level key of the same name).  A config that is neither a mapping, a list nor a dataclass
    gives no params (the reference failed its MLflow init on it)."""
    if config is None:
        return {}
    tree = _plain_params(config)
    if not isinstance(tree, dict):
        return {}
    params = {str(k): v for k, v in tree.items() if not isinstance(v, dict)}
    nested: dict[str, Any] = {}
    _flatten({k: v for k, v in tree.items() if isinstance(v, dict)}, "", nested)
    params.update(nested)
    return params


def _safe_uri(uri: str) -> str:
    """The tracking URI without any user:password part, for messages."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparsable tracking URI>"
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def mlflow_training_view(experiment_id: str) -> str:
    """The UI's page of an experiment in its training view (its charts and runs): an experiment
    holding traces opens in the GenAI view unless the link says otherwise."""
    return f"#/experiments/{experiment_id}?workflowType=machine_learning"


def _ui_base(uri: str) -> str:
    """An http(s) tracking server serves the UI itself; a database is shown by ``mlflow ui``."""
    safe = _safe_uri(uri)
    return safe.rstrip("/") + "/" if safe.startswith(("http://", "https://")) else "(mlflow ui) "


# --- what a step's trace says in MLflow's trace list ---------------------------------------------

# Root-span attributes MLflow's span ingestion reads (mlflow.tracing.constant): trace tags (the
# trace's name among them), and the inputs and outputs its request/response previews come from.
TRACE_TAG_PREFIX = "mlflow.traceTag."
TRACE_NAME_ATTRIBUTE = TRACE_TAG_PREFIX + "mlflow.traceName"
SPAN_INPUTS_ATTRIBUTE = "mlflow.spanInputs"
SPAN_OUTPUTS_ATTRIBUTE = "mlflow.spanOutputs"
_HEADLINE = re.compile(r"^(?!timing).*(loss|score|reward|acc|kl|entropy)", re.IGNORECASE)  # not phase times
_REMEMBERED_STEPS = 8  # a step's root span arrives right after its log(): a few steps suffice


def headline_first(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics in their logged order, those a reader looks for first (loss, score, reward,
    accuracy, KL, entropy; not the timings) ahead of the rest: what a truncated preview keeps."""
    first = {key: value for key, value in metrics.items() if _HEADLINE.search(key)}
    return {**first, **{key: value for key, value in metrics.items() if key not in first}}


def _kvlist(any_value: Any, key_value: Any, values: Mapping[str, Any]) -> Any:
    """An OTLP map value: MLflow stores it as the JSON object (a string would be JSON twice)."""
    entries = []
    for key, value in values.items():
        if isinstance(value, bool):
            entry = any_value(bool_value=value)
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            entry = any_value(int_value=value)
        elif math.isfinite(float(value)):
            entry = any_value(double_value=float(value))
        else:  # NaN and infinities are not JSON: their names
            entry = any_value(string_value=str(float(value)))
        entries.append(key_value(key=key, value=entry))
    return any_value(kvlist_value={"values": entries})


# --- the tracking URI, checked without importing MLflow ------------------------------------------

# The tracking stores MLflow 3 builds in (mlflow/tracking/_tracking_service/utils.py; a test holds
# this list to MLflow's registry); plugins add theirs as ``mlflow.tracking_store`` entry points.
TRACKING_SCHEMES = ("http", "https", "databricks")
UNITY_CATALOG_SCHEMES = ("databricks-uc", "uc")  # registered, but refused as a tracking URI
DATABASE_SCHEMES = ("postgresql", "mysql", "sqlite", "mssql")  # each with an optional +driver, through SQLAlchemy


def check_environment(env: Mapping[str, str]) -> None:
    """``ConfigError`` for a tracking URI MLflow would refuse without asking any server, found in
    the training process in milliseconds (MLflow's own refusal came only after its init attempts,
    as "not reachable")."""
    uri = env.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    allow_file_store = env.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    problem = tracking_uri_problem(uri, allow_file_store)
    if problem is not None:
        raise ConfigError(f"MLFLOW_TRACKING_URI={_safe_uri(uri)!r} {problem}")


def tracking_uri(context: TrackerContext) -> str:
    """``MLFLOW_TRACKING_URI``; on replay, when it is not set, the URI the run was logged to (kept in
    the spool header unless it carried credentials), so replay goes where the run went."""
    return (
        context.env.get("MLFLOW_TRACKING_URI")
        or str((context.resume or {}).get("tracking_uri") or "")
        or DEFAULT_TRACKING_URI
    )


def tracking_uri_problem(uri: str, allow_file_store: bool = False) -> str | None:
    """Why MLflow would refuse ``uri`` as a tracking URI (its own rules), or None."""
    if uri == "databricks":  # MLflow takes the bare word as that store
        return None
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError as error:
        return f"cannot be parsed as a URI ({error})"
    scheme = parts.scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter: MLflow takes it as a local path
        scheme = ""
    if scheme in UNITY_CATALOG_SCHEMES or uri in UNITY_CATALOG_SCHEMES:
        return "is a Unity Catalog URI, which MLflow's client does not take as a tracking URI"
    if scheme in ("", "file"):
        if allow_file_store:
            return None
        return (
            "is a local path, and MLflow 3 refuses its file store (in maintenance mode): use a database "
            "such as sqlite:////abs/path/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true"
        )
    if scheme in ("http", "https") and not parts.hostname:  # MLflow takes it, and every request fails
        return "has no host"
    database, _, driver = scheme.partition("+")
    if database in DATABASE_SCHEMES and "+" not in driver:
        if importlib.util.find_spec("sqlalchemy") is None:
            return "needs the 'sqlalchemy' package: pip install 'otel-tracking[mlflow]'"
        return None
    if scheme in TRACKING_SCHEMES or scheme in _plugin_schemes():
        return None
    known = ", ".join(TRACKING_SCHEMES + DATABASE_SCHEMES)
    return f"has the scheme {scheme!r}, for which MLflow has no tracking store (it knows {known}, and those of plugins)"


def _plugin_schemes() -> set[str]:
    from importlib.metadata import entry_points

    return {entry.name for entry in entry_points(group="mlflow.tracking_store")}


def _metric_size(point: Point) -> int:
    """What a metric adds to a ``log_batch`` request's JSON, about."""
    return len(point[1].encode("utf-8", "surrogatepass")) + _METRIC_JSON_BYTES


def _error_code(error: BaseException) -> str | None:
    return getattr(error, "error_code", None)


# --- the session ---------------------------------------------------------------------------------


class MlflowSession(TrackerSession):
    """One MLflow run shared by the metric, span and log exporters of a process or a ``Tracking``."""

    def __init__(
        self, client: Any, run_id: str, experiment_id: str, tracking_uri: str, project: str, replaying: bool = False
    ) -> None:
        self.client = client
        self.run_id = run_id
        # Replay of this run's spool attaches to the same run, at the same URI unless told otherwise
        # (a URI with credentials is not written to disk: replay then needs MLFLOW_TRACKING_URI).
        remembered = tracking_uri if _safe_uri(tracking_uri) == tracking_uri else None
        self.resume = {"run_id": run_id, "tracking_uri": remembered}
        self.replaying = replaying  # attached by replay: the run's status is not ours to change
        self.attempt = 1  # > 1: a resumed run (OTEL_TRACKING_RESUME) continues this MLflow run
        self._first_step_tagged = False
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self.project = project
        self.where = (
            f"MLflow run {run_id} (experiment {project!r}) at {_safe_uri(tracking_uri)}; in MLflow's UI: "
            f"{_ui_base(tracking_uri)}{mlflow_training_view(experiment_id)}"
        )
        self._span_step = 0  # spans without ml.step land at the step of the span before them
        self._step_metrics: dict[int, dict[str, Any]] = {}  # the latest steps' scalars, for their traces
        self._tracing: Any = None
        self._keys: dict[str, str] = {}
        self._rejected: set[str] = set()
        self._last_error: BaseException | None = None
        self._lock = threading.Lock()
        self._stall_names: dict[str, int] = {}  # stall artifact names written, and how often
        self._pool: ThreadPoolExecutor | None = None  # the lanes beyond the first (REQUESTS_IN_FLIGHT)
        self.ended = False

    # opening ------------------------------------------------------------------------------------

    @classmethod
    def open(  # type: ignore[override]  # None: MLflow unreachable, the run goes on without it
        cls, context: TrackerContext, *, attempts: int | None = None, retry_sleep_s: float | None = None
    ) -> MlflowSession | None:
        """Open (or attach to) the run, log the params; None when every attempt failed."""
        attempts = INIT_ATTEMPTS if attempts is None else max(1, attempts)
        sleep_s = INIT_RETRY_SLEEP_S if retry_sleep_s is None else retry_sleep_s
        uri = tracking_uri(context)
        logger.info("Using MLFlow tracking URI: %s", _safe_uri(uri))
        session: MlflowSession | None = None
        for attempt in range(1, attempts + 1):
            try:
                if session is None:  # a run made by an earlier attempt is kept, never made twice
                    session = cls._start(context, uri)
                session.log_params(flatten_params(context.config))
                return session
            except Exception as error:
                logger.warning("MLflow initialization attempt %d/%d failed: %s", attempt, attempts, error)
                if attempt < attempts:
                    time.sleep(sleep_s)
        if session is not None:
            logger.warning("MLflow params could not be logged; metrics still go to run %s.", session.run_id)
            return session
        logger.warning("All MLflow initialization attempts failed. Proceeding without MLflow tracking.")
        return None

    @classmethod
    def _start(cls, context: TrackerContext, uri: str) -> MlflowSession:
        from mlflow import MlflowClient
        from mlflow.entities import LifecycleStage, RunStatus
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

        client = MlflowClient(tracking_uri=uri)
        resumed = (context.resume or {}).get("run_id")
        if resumed and context.continuing:  # a restarted job (OTEL_TRACKING_RESUME): the same run, running again
            session = cls._reopen(client, str(resumed), uri, context)
            if session is not None:
                return session
        elif resumed:  # otel-tracking replay: the spooled items belong to this run
            run = client.get_run(str(resumed))
            # Its status is not replay's to change, unless the spool says the run ended with no
            # tracker left to end it ("end_run": the bridge process had died).
            replaying = not (context.resume or {}).get("end_run")
            return cls(client, str(resumed), run.info.experiment_id, uri, context.project, replaying=replaying)
        existing = context.env.get("MLFLOW_RUN_ID")
        if existing:
            # Azure ML, Databricks and others start the run and hand us its id.
            run = client.get_run(existing)
            if run.info.lifecycle_stage == LifecycleStage.DELETED:
                raise MlflowException(f"Cannot start run with ID {existing} because it is in the deleted state.")
            client.update_run(existing, status=RunStatus.to_string(RunStatus.RUNNING))
            return cls(client, existing, run.info.experiment_id, uri, context.project)
        experiment = client.get_experiment_by_name(context.project)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(context.project)
            except MlflowException as error:
                if _error_code(error) != "RESOURCE_ALREADY_EXISTS":  # another rank made it first
                    raise
                found = client.get_experiment_by_name(context.project)
                if found is None:
                    raise
                experiment_id = found.experiment_id
        else:
            if experiment.lifecycle_stage != LifecycleStage.ACTIVE:
                raise MlflowException(f"Cannot use the deleted experiment {context.project!r}.")
            experiment_id = experiment.experiment_id
        tags = resolve_tags({MLFLOW_RUN_NAME: context.experiment})
        run = client.create_run(experiment_id, tags=tags, run_name=context.experiment)
        return cls(client, run.info.run_id, experiment_id, uri, context.project)

    @classmethod
    def _reopen(cls, client: Any, run_id: str, uri: str, context: TrackerContext) -> MlflowSession | None:
        """The previous attempt's run, RUNNING again (a killed job's run was left RUNNING or ended
        FAILED by its bridge process), tagged ``ml.run.attempt``; None when it is gone from this
        tracking store (then a new run is made, with a warning)."""
        from mlflow.entities import LifecycleStage, RunStatus
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException as error:
            if _error_code(error) != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is None or run.info.lifecycle_stage == LifecycleStage.DELETED:
            logger.warning(
                "otel-tracking: MLflow run %s of the resumed run is not in %s; starting a new one",
                run_id,
                _safe_uri(uri),
            )
            return None
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        client.set_tag(run_id, ATTEMPT_TAG, str(context.attempt))
        session = cls(client, run_id, run.info.experiment_id, uri, context.project)
        session.attempt = context.attempt
        return session

    # the tracker's writes ---------------------------------------------------------------------------

    def write_step(self, record: StepRecord) -> bool:
        return self.write_steps([record]) == [None]

    def write_steps(
        self, records: Sequence[StepRecord], progress: Callable[[], None] = lambda: None
    ) -> list[StepRecord | None]:
        """The steps' numbers packed into ``log_batch`` requests of up to 1,000 metrics (whole
        steps or not: a point is a point), in :data:`REQUESTS_IN_FLIGHT` lanes by key, each key's
        points in step order; for each step None when it landed, else what did not (retried or
        spooled as that, so no point is sent twice).  MLflow metrics have no place for the
        non-number values (``record.others``)."""
        from mlflow.entities import Metric

        if self.attempt > 1 and not self._first_step_tagged and records:
            # MLflow keeps every point: 101..130 logged again after a restart from step 100 hold two
            # values each.  This tag (and the timestamps) says which attempt wrote which.
            try:
                self.client.set_tag(self.run_id, f"{ATTEMPT_TAG}.{self.attempt}.first_step", str(records[0].step))
                self._first_step_tagged = True
            except Exception as error:
                logger.debug("MLflow attempt tag failed: %s", error)
                return list(records)
        points: list[Point] = []
        for index, record in enumerate(records):
            self._step_metrics[record.step] = {**self._step_metrics.pop(record.step, {}), **record.scalars}
            while len(self._step_metrics) > _REMEMBERED_STEPS:
                del self._step_metrics[next(iter(self._step_metrics))]
            ms = record.time_unix_nano // 1_000_000 if record.time_unix_nano else int(time.time() * 1000)
            for key, value in record.scalars.items():
                name = self.metric_key(key)
                if name not in self._rejected:  # refused once already (too long, not a unique path)
                    points.append(
                        (index, key, Metric(name, float(value) if isinstance(value, bool) else value, ms, record.step))
                    )
        missing = send_in_lanes(
            points, self._lanes(), BATCH_LIMITS, _metric_size, self._send_metrics, self._lane_pool(), progress
        )
        if not missing:
            return [None] * len(records)
        left: dict[int, set[str]] = {}
        for index, key, _ in missing:
            left.setdefault(index, set()).add(key)
        return [
            None
            if index not in left
            else dataclasses.replace(record, scalars={k: v for k, v in record.scalars.items() if k in left[index]})
            for index, record in enumerate(records)
        ]

    def _send_metrics(self, request: list[Point]) -> list[Point]:
        """One ``log_batch``: the points that did not land."""
        rest = self._log_batch_rest(
            "metrics",
            [metric for _, _, metric in request],
            lambda batch: self.client.log_batch(self.run_id, metrics=batch),
        )
        if not rest:
            return []
        left = {id(metric) for metric in rest}
        return [point for point in request if id(point[2]) in left]

    def _lanes(self) -> int:
        return REQUESTS_IN_FLIGHT if self.tracking_uri.startswith(("http://", "https://")) else 1

    def _lane_pool(self) -> ThreadPoolExecutor | None:
        if self._lanes() < 2:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._lanes() - 1, thread_name_prefix="otel-tracking-mlflow-lane")
        return self._pool

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        return self.log_metrics([(key, seconds)], step, int(time.time() * 1000))

    def write_spans(self, spans: Sequence[ReadableSpan]) -> bool:
        """The timing metrics of the steps these spans close (``timings.StepTimings``), and every span
        as an MLflow trace span.  One failing does not keep the other from being tried."""
        ok = self.write_timings(self.step_timings.add(spans, self._span_step))
        try:
            self.log_spans(spans)
        except Exception as error:
            logger.debug("MLflow trace export failed: %s", error)
            ok = False
        return ok

    def write_timings(self, timings: Sequence[PhaseTiming]) -> bool:
        """One batch per step, timestamped at the end of the step's last phase span."""
        by_step: dict[int, tuple[int, dict[str, float]]] = {}
        for timing in timings:
            self._span_step = timing.step  # spans without ml.step land at the step of the span before them
            end_ms, values = by_step.get(timing.step, (0, {}))
            by_step[timing.step] = (max(end_ms, timing.last_end_ns // 1_000_000), {**values, **timing.scalars()})
        ok = True
        for step, (end_ms, values) in by_step.items():
            try:
                ok = self.log_metrics(list(values.items()), step, end_ms) and ok
            except Exception as error:
                logger.debug("MLflow timing export failed: %s", error)
                ok = False
        if not ok:
            self.step_timings.hold(timings)
        return ok

    def write_event(self, event: Event) -> bool:
        """Validation generations as ``val_step{N}.json`` artifacts; a stall report as the tag
        ``ml.stall.<phase>`` (its summary: what the runs table shows) and the text artifact
        ``stalls/<phase>-step<N>-report<n>.md`` (summary and stacks; ``-2``, ``-3``, ... after it when
        that name was written already); other events are not MLflow's."""
        if event.name == semconv.STALL_EVENT:
            return self.log_stall(event)
        if event.name != GENERATIONS_EVENT:
            return True
        try:
            self.log_generations(list(event.body.get("samples") or []), 0 if event.step is None else event.step)
        except Exception as error:
            logger.warning("WARNING: save validation generation file to mlflow failed with error %s", error)
            return False
        return True

    # params and metrics ---------------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(self._param_key(key), str(value)) for key, value in params.items()]
        if items and not self._log_batch(
            "params", items, lambda batch: self.client.log_batch(self.run_id, params=batch)
        ):
            raise RuntimeError(f"MLflow did not take the params of run {self.run_id}: {self._last_error}")

    def _param_key(self, key: str) -> str:
        from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

        if validate_param_and_metric_name(key) and not path_not_unique(key):
            return key
        cleaned = sanitize_key(key)
        logger.warning("[MLflow] Param name '%s' sanitized to '%s' due to invalid characters.", key, cleaned)
        return cleaned

    def metric_key(self, key: str) -> str:
        cleaned = self._keys.get(key)
        if cleaned is None:
            cleaned = sanitize_key(key)
            if cleaned != key:
                logger.warning("[MLflow] Metric key '%s' sanitized to '%s' due to invalid characters.", key, cleaned)
            self._keys[key] = cleaned
        return cleaned

    def log_metrics(self, values: Sequence[tuple[str, int | float]], step: int, timestamp_ms: int) -> bool:
        """Log (key as the user wrote it, number) pairs at ``step``.  False when the backend failed
        (not for values MLflow rejects: those are skipped with a warning)."""
        from mlflow.entities import Metric

        metrics = []
        for key, value in values:
            name = self.metric_key(key)
            if name in self._rejected:  # refused once already (too long, not a unique path): skip without asking
                continue
            metrics.append(Metric(name, float(value) if isinstance(value, bool) else value, timestamp_ms, step))
        if not metrics:
            return True
        return self._log_batch("metrics", metrics, lambda batch: self.client.log_batch(self.run_id, metrics=batch))

    def _log_batch(self, what: str, items: list[Any], log: Any) -> bool:
        return not self._log_batch_rest(what, items, log)

    def _log_batch_rest(self, what: str, items: list[Any], log: Any) -> list[Any]:
        """One call for the whole batch; if MLflow rejects it as invalid, one call per item so that a
        bad key or value costs only itself (skipped, with a warning: a retry could not help).  The
        items that did not land because the backend failed."""
        try:
            log(items)
            return []
        except Exception as error:
            if _error_code(error) != _INVALID:
                logger.debug("MLflow %s batch failed: %s", what, error)
                self._last_error = error
                return list(items)
        failed = []
        for item in items:
            try:
                log([item])
            except Exception as error:
                if _error_code(error) != _INVALID:
                    self._last_error = error
                    failed.append(item)
                    continue
                with self._lock:
                    first = item.key not in self._rejected
                    self._rejected.add(item.key)
                if first:
                    logger.warning("[MLflow] %s %r skipped: %s", what[:-1], item.key, error)
        return failed

    # spans and artifacts ----------------------------------------------------------------------------

    def log_spans(self, spans: Sequence[ReadableSpan]) -> None:
        """The spans as MLflow trace spans in the run's experiment, converted exactly as MLflow's own
        OTLP endpoint converts them; traces whose root span is here get linked to the run."""
        from mlflow.entities import Span
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        request = encode_spans(spans)
        converted = []
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for proto_span in scope_spans.spans:
                    if not proto_span.parent_span_id and proto_span.name == STEP_SPAN_NAME:
                        self._describe_step_trace(proto_span)
                    converted.append(Span.from_otel_proto(proto_span, resource=resource_spans.resource))
        if not converted:
            return
        self._tracing_client().log_spans(self.experiment_id, converted)
        roots = sorted({span.trace_id for span in converted if span.parent_id is None})
        for start in range(0, len(roots), _LINK_BATCH):
            self.client.link_traces_to_run(roots[start : start + _LINK_BATCH], self.run_id)

    def _describe_step_trace(self, root: Any) -> None:
        """What MLflow shows of a step's trace, set on its root span (an OTLP span proto, MLflow's
        copy): the trace's and the root span's name ``step N``, the tag ``ml.step``, the request
        ``{"step": N}`` and the response: that step's metrics, the headline ones first."""
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

        step = next((attr.value.int_value for attr in root.attributes if attr.key == STEP_ATTRIBUTE), None)
        if step is None:
            return
        metrics = self._step_metrics.get(step, {})
        root.name = f"step {step}"  # the trace's top row in MLflow's trace view (elsewhere it stays ml.step)
        described = {
            TRACE_NAME_ATTRIBUTE: AnyValue(string_value=f"step {step}"),
            TRACE_TAG_PREFIX + STEP_ATTRIBUTE: AnyValue(string_value=str(step)),
            SPAN_INPUTS_ATTRIBUTE: _kvlist(AnyValue, KeyValue, {"step": step}),
            SPAN_OUTPUTS_ATTRIBUTE: _kvlist(AnyValue, KeyValue, headline_first(metrics)),
        }
        for key, value in described.items():
            root.attributes.append(KeyValue(key=key, value=value))

    def _tracing_client(self) -> Any:
        if self._tracing is None:
            from mlflow.tracing.client import TracingClient

            self._tracing = TracingClient(self.tracking_uri)
        return self._tracing

    def log_stall(self, event: Event) -> bool:
        a = event.attributes
        # A tag's name and a file's: MLflow takes letters, digits, "_.-/ " and no "//" or "..";
        # the phase, scrubbed on its way out, may be a URL (``<redacted>`` becomes ``_redacted_``).
        phase = re.sub(r"[^A-Za-z0-9_.\- ]|\.\.", "_", str(a.get("ml.phase", "phase")))[:200]
        name = f"stalls/{phase}-step{a.get('ml.step', 'none')}-report{a.get('ml.stall.report', 1)}"
        # The same phase may stall twice at one step (it recovered, then stalled again): each report
        # gets a file of its own, never one over another.
        taken = self._stall_names.get(name, 0)
        path = f"{name}-{taken + 1}.md" if taken else f"{name}.md"
        try:
            self.client.set_tag(self.run_id, f"ml.stall.{phase}", stall_summary(event)[:5000])
            self.client.log_text(self.run_id, stall_markdown(event), path)
        except Exception as error:
            logger.warning("otel-tracking: MLflow did not take a stall report: %s", error)
            return False
        self._stall_names[name] = taken + 1
        return True

    def log_generations(self, samples: Sequence[Any], step: int) -> None:
        """``val_step{step}.json`` at the artifact root, as the reference wrote it."""
        rows = []
        for sample in samples:
            input_text, output_text, score = sample_parts(sample)
            rows.append({"input": input_text, "output": output_text, "score": score})
        with tempfile.TemporaryDirectory() as tmp_dir:
            path = os.path.join(tmp_dir, f"val_step{step}.json")
            with open(path, "w") as file:
                json.dump(rows, file)
            self.client.log_artifact(self.run_id, path)

    # the end --------------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0) -> None:
        """FINISHED for exit code 0, FAILED otherwise; once."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if not self.replaying:
            self.client.set_terminated(self.run_id, "FINISHED" if exit_code == 0 else "FAILED")


class SharedMlflowSession(TrackerSession):
    """What exporters built with no arguments share: the run :meth:`MlflowSession.open` opens from
    the environment or, when every attempt failed, this stand-in, which sends nothing and fails
    every export (``open_tracker`` instead hands the ``Tracking`` no MLflow exporters at all)."""

    where = "MLflow not reachable: nothing sent (see warnings)"

    @classmethod
    def open(cls, context: TrackerContext) -> TrackerSession:
        return MlflowSession.open(context) or cls()

    def write_step(self, record: StepRecord) -> bool:
        return False

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        return False

    def write_spans(self, spans: Sequence[Any]) -> bool:
        return False

    def write_event(self, event: Event) -> bool:
        return False

    def finish(self, exit_code: int = 0) -> None:
        return None


EXPORTERS = tracker_exporters("Mlflow", SharedMlflowSession, __name__)
MlflowMetricExporter, MlflowSpanExporter, MlflowLogExporter = EXPORTERS.metrics, EXPORTERS.spans, EXPORTERS.logs


def open_tracker(context: TrackerContext) -> SinkParts:
    session = MlflowSession.open(context)
    if session is None:
        uri = tracking_uri(context)
        return SinkParts(where=f"MLflow not reachable at {_safe_uri(uri)}: spooled", unreachable=True)
    return EXPORTERS.parts(session)


__all__ = [
    "MlflowLogExporter",
    "MlflowMetricExporter",
    "MlflowSession",
    "MlflowSpanExporter",
    "flatten_params",
    "open_tracker",
    "sanitize_key",
]
