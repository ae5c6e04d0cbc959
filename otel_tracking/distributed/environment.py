"""What a process without ``Tracking`` (a Ray worker, a rollout server, a subprocess) runs with:
its settings, from the run identity it was handed, and the variables a driver hands it (through a
Ray ``runtime_env``, ``ray_tracing.runtime_env``) so that it exports as the driver does."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from urllib.parse import quote

from otel_tracking.config.resume import NEVER
from otel_tracking.config.settings import Settings, build_settings, identity_from_env, parse_key_value_list
from otel_tracking.signals import semconv
from otel_tracking.signals.carrier import extract_env, identity_from

WORKER_EXPORT_INTERVAL_S = 0.1  # a worker run's default OTEL_BSP_SCHEDULE_DELAY
# ... once its caller covers it (drain.py asks for its spans before Ray ends it): fewer, larger
# exports, as the SDK's batch processors make (OTEL_BSP_SCHEDULE_DELAY's and OTEL_BLRP_SCHEDULE_DELAY's
# default, 5 s; a full export of 512 leaves at once): bench/results/2026-12-04-verl-cpu-2.md.
COVERED_EXPORT_INTERVAL_S = 5.0


def build_worker_settings(
    identity: Mapping[str, str],
    project: str | None = None,
    experiment: str | None = None,
    force_otlp: bool = False,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Settings for a process without ``Tracking`` (a Ray worker, a rollout server, a subprocess):
    the run identity from the caller's baggage (``identity``), else from the environment
    (``BAGGAGE``, ``OTEL_TRACKING_RUN_ID``, ``OTEL_RESOURCE_ATTRIBUTES`` with ``ml.project``, ``ml.experiment``,
    ``ml.run.id``, as ``ray_tracing.runtime_env`` sets them), else defaults; explicit arguments win."""
    e = dict(os.environ if env is None else env)
    if not identity:  # a subprocess handed its context in TRACEPARENT / BAGGAGE
        identity = identity_from(extract_env(e))
    attributes: dict[str, str] = {}
    if "OTEL_RESOURCE_ATTRIBUTES" in e:
        attributes = parse_key_value_list(e["OTEL_RESOURCE_ATTRIBUTES"], "OTEL_RESOURCE_ATTRIBUTES")
    default_project, default_experiment = identity_from_env(e)
    # The run id a caller's baggage names is used as it is (only its spool path is made safe): a
    # worker's span must not fail on what another process sent.  OTEL_TRACKING_RUN_ID is checked.
    run_id = identity.get(semconv.RUN_ID) or (None if "OTEL_TRACKING_RUN_ID" in e else attributes.get(semconv.RUN_ID))
    settings = build_settings(
        project or identity.get(semconv.PROJECT) or default_project,
        experiment or identity.get(semconv.EXPERIMENT) or default_experiment,
        (),
        env=e,
        force_otlp=force_otlp,
        resume=NEVER,  # a worker joins the driver's attempt; it never looks for records of its own
        run_id=run_id or None,
    )
    attempt = identity.get(semconv.RUN_ATTEMPT) or attributes.get(semconv.RUN_ATTEMPT)
    if attempt and str(attempt).isdigit() and int(attempt) > 1:
        settings = replace(settings, attempt=int(attempt))
    if "OTEL_BSP_SCHEDULE_DELAY" not in e:
        # Workers open spans by the hundred a second: one OTLP request each would cost a large
        # share of a core; batched, a small one (bench/bench_workers.py measures both).
        settings = replace(settings, delivery=replace(settings.delivery, export_interval_s=WORKER_EXPORT_INTERVAL_S))
    return settings


# What a worker process needs to export as the driver does: the OTLP and otel-tracking settings.
# Header variables carry credentials: passed on only when asked (a node-local agent needs none).
_PROPAGATED_PREFIXES = ("OTEL_EXPORTER_OTLP_", "OTEL_TRACKING_", "OTEL_METRIC_EXPORT_", "OTEL_BSP_", "OTEL_BLRP_")
_PROPAGATED_NAMES = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_LOGS_EXPORTER",
    "OTEL_PROPAGATORS",
    "OTEL_SDK_DISABLED",
    "VERL_RL_INSIGHT_ENABLE",
)


def propagated_env(
    identity: Mapping[str, str], headers: bool = False, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables to hand a worker process (e.g. through a Ray ``runtime_env``): this process's
    OTel and otel-tracking settings, plus the run identity (``OTEL_TRACKING_RUN_ID`` and
    ``ml.project``/``ml.experiment``/``ml.run.id`` in ``OTEL_RESOURCE_ATTRIBUTES``)."""
    e = os.environ if env is None else env
    out = {
        name: value
        for name, value in e.items()
        if (name in _PROPAGATED_NAMES or name.startswith(_PROPAGATED_PREFIXES))
        and (headers or not name.endswith("_HEADERS"))
    }
    out.pop("OTEL_TRACKING_ROLE", None)  # each worker says its own
    if identity:
        attributes = parse_key_value_list(out.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES")
        attributes.update(identity)
        out["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(f"{quote(k)}={quote(v)}" for k, v in attributes.items())
        if identity.get(semconv.RUN_ID):
            out["OTEL_TRACKING_RUN_ID"] = identity[semconv.RUN_ID]
    return out
