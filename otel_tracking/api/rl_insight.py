"""``RLInsightLogger``: the reference's class API, on OpenTelemetry instead of the ``rl_insight`` package.

Everything is gated by ``VERL_RL_INSIGHT_ENABLE=1``, as in the reference; disabled, every method
is a no-op and ``trace_state`` yields without a span.  Enabled, the logger's run exports over
OTLP (to ``OTEL_EXPORTER_OTLP_ENDPOINT``, default ``http://localhost:4318``): ``log()`` values
become gauges there (not in the ML trackers: the reference sent them only to rl_insight), and
``trace_state`` phases become spans.  When ``Tracking`` is built with the ``rl_insight`` backend,
the logger shares that run instead of starting its own.

``register_metrics`` / ``register_rollout_metrics`` / ``register_transfer_queue_metrics`` record
Prometheus scrape targets (e.g. vLLM servers' ``/metrics``) once per (job, addresses, labels) and,
when a targets directory is configured, write them as file-based service discovery files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from otel_tracking.api.spans import trace_state as _trace_state
from otel_tracking.config import settings as settings_module
from otel_tracking.config.settings import Settings

logger = logging.getLogger("otel_tracking")


def say_where_it_goes(settings: Settings) -> None:
    """rl_insight turns OTLP on whether an endpoint is configured or not: without one, a warning
    says where its data goes (the OpenTelemetry default on localhost, where an agent may listen)
    and where what cannot be delivered is kept, as a worker run without an exporter says."""
    from otel_tracking.delivery.otlp_sinks import otlp_endpoint

    otlp = settings.otlp
    signals = [s for s in ("traces", "metrics", "logs") if getattr(otlp, s)]
    defaulted = [s for s in signals if not otlp_endpoint(s, otlp.protocol, settings.env)[1]]
    if not defaulted:
        return
    default = "http://localhost:4317" if otlp.protocol == "grpc" else "http://localhost:4318"
    logger.warning(
        "otel-tracking: rl_insight: no OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT), so its %s go to "
        "the OpenTelemetry default %s (an agent or collector there: see `otel-tracking stack`); what cannot be "
        "delivered is spooled in %s, for `otel-tracking replay`",
        ", ".join(defaulted[:-1]) + " and " + defaulted[-1] if len(defaulted) > 1 else defaulted[0],
        default,
        settings.spool_dir,
    )


class RLInsightLogger:
    """verl's ``RLInsightLogger`` (its ``rl_insight`` integration), on OpenTelemetry: gauges and
    phase spans over OTLP, and Prometheus scrape targets for the local stack's collector.

    Everything is off unless ``VERL_RL_INSIGHT_ENABLE=1`` (as in verl): then every method is a
    no-op and ``trace_state`` yields without a span.  On, its values go to OTLP only (to
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, default ``http://localhost:4318``), not to the ML trackers;
    with ``Tracking(default_backend=[..., "rl_insight"])`` it shares that run.  All methods are
    class methods, as in verl; constructing one calls ``init``.

    :param project_name: the project of the run it starts (when no ``Tracking`` run is shared).
    :param experiment_name: the experiment of that run.
    :param config: verl's config; ``transfer_queue.metrics.enabled`` registers the transfer
        queue's metrics endpoint.  Default ``None``.

    Example:

    ```python
    from otel_tracking import RLInsightLogger

    RLInsightLogger.init(project_name="gsm8k", experiment_name="run-1")  # no-op unless enabled
    with RLInsightLogger.trace_state("rollout", state_lane_id=0):
        ...
    RLInsightLogger.log({"rollout/throughput": 2400.0}, step=1)
    RLInsightLogger.finish()
    ```
    """

    ENABLE_ENV = "VERL_RL_INSIGHT_ENABLE"
    """The variable that switches it on (``1``)."""
    _init_done: ClassVar[bool] = False
    _run: ClassVar[Any] = None
    _owns_run: ClassVar[bool] = False
    _registered_metrics: ClassVar[set[tuple[str | None, tuple[str, ...], str | None]]] = set()
    registered_targets: ClassVar[list[dict[str, Any]]] = []
    """Every scrape target registered in this process (file-based service discovery groups)."""

    def __init__(self, project_name: str | None, experiment_name: str | None, config: Any = None) -> None:
        """As verl's: ``init`` with the same arguments (see the class's parameters)."""
        self.init(project_name=project_name, experiment_name=experiment_name, config=config)

    @classmethod
    def enabled(cls) -> bool:
        """Whether rl-insight is enabled in this process (VERL_RL_INSIGHT_ENABLE=1)."""
        return settings_module.rl_insight_enabled()

    @classmethod
    def init(cls, project_name: str | None = None, experiment_name: str | None = None, config: Any = None) -> None:
        """Start its run (OTLP only), once per process; nothing when disabled or already started.

        :param project_name: the run's project; default ``None``: from the caller's baggage or
            the environment, as a worker's spans get it.
        :param experiment_name: the run's experiment; default ``None``, likewise.
        :param config: verl's config, for the transfer queue's metrics endpoint; default ``None``.
        """
        if not cls.enabled() or cls._init_done:
            return
        from otel_tracking.delivery.otlp_sinks import build_otlp_sinks
        from otel_tracking.distributed.worker import worker_settings
        from otel_tracking.runtime.run import Run

        # In a worker the identity comes from the caller's baggage or the environment, as for spans.
        s = worker_settings(project=project_name, experiment=experiment_name, force_otlp=True)
        say_where_it_goes(s)
        cls._run = Run(s, sinks=[], otlp_sinks=build_otlp_sinks(s), driver=False)
        cls._owns_run = True
        cls._init_done = True
        if config is not None:
            cls.register_transfer_queue_metrics(config)

    @classmethod
    def attach(cls, run: Any, config: Any = None) -> None:
        """Share a ``Tracking`` run (its ``rl_insight`` backend) instead of starting one; ``Tracking``
        calls it.

        :param run: the ``Tracking``'s run.
        :param config: verl's config, for the transfer queue's metrics endpoint; default ``None``.
        """
        if not cls.enabled():
            return
        if cls._init_done and cls._owns_run:
            cls.finish()
        cls._run, cls._owns_run, cls._init_done = run, False, True
        if config is not None:
            cls.register_transfer_queue_metrics(config)

    @classmethod
    def log(cls, data: dict[str, Any], step: int) -> None:
        """Send ``data`` as OTLP gauges at ``step`` (not to the ML trackers, as in verl); starts the
        run on first use.

        :param data: ``{key: number}``.
        :param step: the step the values belong to; the training loop's step is left alone.
        """
        if not cls.enabled():
            return
        if not cls._init_done:
            cls.init()
        # Gauges for the observability path only: no ML sink sees these, and the step of a
        # shared Tracking run stays the training loop's (Run.observe).
        cls._run.observe(data, step)

    @classmethod
    def finish(cls) -> None:
        """End its own run (a shared ``Tracking`` run is left to ``Tracking.finish``) and forget the
        registered targets; the next call starts again."""
        if not cls._init_done:
            return
        if cls._owns_run and cls._run is not None:
            cls._run.finish()
        cls._run, cls._owns_run, cls._init_done = None, False, False
        cls._registered_metrics.clear()

    @classmethod
    @contextmanager
    def trace_state(cls, state_name: str, *, state_lane_id: str | int | None = None, **labels: Any) -> Iterator[None]:
        """A phase as a span, like ``otel_tracking.trace_state``; without a span when disabled.

        :param state_name: the phase's name.
        :param state_lane_id: who runs it (``ml.lane``); default ``None``.
        :param labels: ``ml.label.<name>`` attributes (``step=``, ``weight_version=``, ``links=``
            as for ``trace_state``).
        """
        if not cls.enabled():
            yield
            return
        if not cls._init_done:
            cls.init()
        with _trace_state(state_name, state_lane_id=state_lane_id, **labels):
            yield

    @classmethod
    def register_rollout_metrics(
        cls,
        server_addresses: list[str],
        rollout_name: str | None,
        labels: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """Register rollout servers' Prometheus endpoints (vLLM's, SGLang's ``/metrics``) to be scraped.

        :param server_addresses: ``host:port`` of each server.
        :param rollout_name: the job's name, the ``job`` label (e.g. ``"vllm"``).
        :param labels: one dict of extra labels per address (or ``None``); default ``None``.
        """
        cls.register_metrics(server_addresses, rollout_name, labels)

    @classmethod
    def register_transfer_queue_metrics(cls, config: Any) -> None:
        """Register the transfer queue's metrics endpoint when ``transfer_queue.metrics.enabled``.

        :param config: verl's config (a mapping).
        """
        try:
            enabled = bool((config or {}).get("transfer_queue", {}).get("metrics", {}).get("enabled", False))
        except AttributeError:
            return
        if not enabled:
            return
        try:
            import transfer_queue as tq  # type: ignore[import-not-found]

            endpoint = tq.get_metrics_endpoint()
        except Exception:
            logger.exception("[rl-insight] Failed to get transfer_queue metrics endpoint")
            return
        if endpoint:
            cls.register_metrics([endpoint], "transfer_queue", None)

    @classmethod
    def register_metrics(
        cls,
        server_addresses: list[str],
        job_name: str | None = None,
        labels: list[dict[str, Any] | None] | None = None,
    ) -> None:
        """Register Prometheus endpoints to be scraped, once per (job, addresses, labels): written as
        file-based service discovery JSON into ``OTEL_TRACKING_SCRAPE_TARGETS_DIR``, which the
        local stack's collector watches.

        :param server_addresses: ``host:port`` of each endpoint.
        :param job_name: the ``job`` label; default ``None``.
        :param labels: one dict of extra labels per address (or ``None``); default ``None``.

        Example: ``RLInsightLogger.register_metrics(["10.0.0.5:8000"], "vllm")``
        """
        if not cls.enabled():
            return
        metric_key = (job_name, tuple(server_addresses), repr(labels))
        if metric_key in cls._registered_metrics:
            return
        try:
            from otel_tracking.distributed.targets import register_scrape_targets

            cls.registered_targets.extend(register_scrape_targets(server_addresses, job_name, labels))
            cls._registered_metrics.add(metric_key)
        except Exception:
            logger.exception("[rl-insight] Failed to register metrics endpoint")
