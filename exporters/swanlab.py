"""SwanLab bridge.

Opens the run as the reference did: ``SWANLAB_API_KEY`` -> ``swanlab.login(key)`` (the key goes to
login and nowhere else), ``SWANLAB_LOG_DIR`` (default ``swanlog``), ``SWANLAB_MODE`` (default
``cloud``, which SwanLab 0.10 treats as ``online``), then ``swanlab.init(project=, name=<experiment>,
config={"FRAMEWORK": "verl", **config}, log_dir=, mode=)``.  All variables come from the run's
environment mapping (``BridgeContext.env``).

What lands where:

* ``log(data, step)`` numbers -> ``run.log({key: value, ...}, step=step)``, keys exactly as written;
  NaN and +/-inf included (SwanLab stores them); bools as SwanLab stores them (1/0).  Non-number
  values are skipped: the reference passed them too, and SwanLab rejected each with an error line.
* each finished ``trace_state`` span -> scalar ``timing_s/state/<name>`` at the span's step.
* ``ml.validation.generations`` -> ``swanlab.echarts.Table`` with headers ``step, input, output,
  score`` and one row ``[step, input, output, score]`` per sample, logged as ``val/generations``.
* ``ml.table.filtered_reward_counts`` is wandb-only in the reference: nothing is written here.
* ``finish(exit_code)`` -> ``run.finish()``, state ``success`` for exit code 0, ``crashed`` otherwise.

Differences from the reference, on purpose:

* login happens only when the run goes online (``SWANLAB_MODE`` ``cloud``/``online``).  In
  ``offline``/``local``/``disabled`` mode login is useless and, without a network, raises after
  about 15 s, which made the reference unusable offline on a machine whose environment holds a key.
* the run ends ``crashed`` on a non-zero exit code (the reference always ended it ``success``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.exporters._base import BridgeContext, BridgeParts, StepMetricExporter, StepRecord, span_timing

logger = logging.getLogger("otel_tracking.swanlab")

GENERATIONS_EVENT = "ml.validation.generations"
GENERATIONS_KEY = "val/generations"
GENERATIONS_HEADERS = ["step", "input", "output", "score"]
_OFFLINE_MODES = {"offline", "local", "disabled"}


def swanlab_init_arguments(context: BridgeContext) -> tuple[str | None, dict[str, Any]]:
    """(API key or None, keyword arguments for ``swanlab.init``), from the context as the reference read them."""
    env = context.env
    api_key = env.get("SWANLAB_API_KEY") or None
    log_dir = env.get("SWANLAB_LOG_DIR", "swanlog")
    mode = env.get("SWANLAB_MODE", "cloud")
    config = context.config
    if config is None:
        config = {}
    # The reference needed a mapping; anything else is kept under one key.
    merged = {"FRAMEWORK": "verl", **config} if isinstance(config, Mapping) else {"FRAMEWORK": "verl", "config": config}
    kwargs = {
        "project": context.project,
        "name": context.experiment,
        "config": merged,
        "log_dir": log_dir,
        "mode": mode,
    }
    return api_key, kwargs


class SwanLabSession:
    """One SwanLab run shared by the metric, span and log exporters of one process."""

    def __init__(self, context: BridgeContext) -> None:
        import swanlab

        self._swanlab = swanlab
        api_key, kwargs = swanlab_init_arguments(context)
        if api_key and str(kwargs["mode"]).lower() not in _OFFLINE_MODES:
            swanlab.login(api_key)  # NOTE: overwrites any previous login, as in the reference
        self.run = swanlab.init(**kwargs)
        self.last_step = 0
        self.finished = False
        self._lock = threading.Lock()
        self._users = 0
        run_dir = getattr(self.run, "dir", None)
        self.where = f"SwanLab {kwargs['mode']} run {context.project}/{context.experiment}" + (
            f" at {run_dir}" if run_dir else ""
        )

    # --- writing -------------------------------------------------------------------------------

    def log(self, data: dict[str, Any], step: int) -> bool:
        """Log one step's values; a value SwanLab rejects does not lose the others."""
        if not data:
            return True
        with self._lock:
            if self.finished:
                return False
            self.last_step = max(self.last_step, step)
            try:
                self.run.log(data, step=step)
                return True
            except Exception:
                if len(data) == 1:
                    logger.debug("swanlab rejected %r at step %s", list(data), step, exc_info=True)
                    return False
            ok = True
            for key, value in data.items():  # one by one, so one bad value costs only itself
                try:
                    self.run.log({key: value}, step=step)
                except Exception:
                    logger.debug("swanlab rejected %r at step %s", key, step, exc_info=True)
                    ok = False
            return ok

    def log_generations(self, samples: Sequence[Any], step: int) -> bool:
        table = self._swanlab.echarts.Table()
        rows = [[step, *_three(sample)] for sample in samples]
        table.add(headers=list(GENERATIONS_HEADERS), rows=rows)
        return self.log({GENERATIONS_KEY: table}, step)

    # --- lifetime ------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0) -> None:
        with self._lock:
            if self.finished:
                return
            self.finished = True
        state = "success" if exit_code == 0 else "crashed"
        self.run.finish(state=state, error=None if exit_code == 0 else f"exit code {exit_code}")

    def attach(self) -> None:
        with self._lock:
            self._users += 1

    def detach(self) -> bool:
        """True when the last exporter that attached has let go."""
        with self._lock:
            self._users -= 1
            return self._users <= 0


def _three(sample: Any) -> list[Any]:
    """input, output, score of one sample (missing parts are None, extra parts dropped)."""
    parts = list(sample) if isinstance(sample, (list, tuple)) else [sample]
    return [*parts, None, None, None][:3]


# --- the process-wide session, for exporters built with no arguments ------------------------------

_shared_lock = threading.Lock()
_shared: SwanLabSession | None = None


def _shared_session() -> SwanLabSession:
    global _shared
    with _shared_lock:
        if _shared is None or _shared.finished:
            _shared = SwanLabSession(BridgeContext.from_env())
        _shared.attach()
        return _shared


class _UsesSession:
    def _init_session(self, session: SwanLabSession | None) -> None:
        self._owns_share = session is None
        self.session = _shared_session() if session is None else session
        self._shut = False

    def _release(self) -> None:
        # A process-wide session ends when the last exporter built on it shuts down; a session handed
        # in by open_bridge is ended by the bridge's finish().
        if self._shut:
            return
        self._shut = True
        if self._owns_share and self.session.detach():
            self.session.finish(0)


class SwanLabMetricExporter(_UsesSession, StepMetricExporter):
    def __init__(self, session: SwanLabSession | None = None) -> None:
        StepMetricExporter.__init__(self)
        self._init_session(session)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        ok = True
        try:
            for record in self.records(metrics_data):
                ok = self._write(record) and ok
        except Exception:
            logger.debug("swanlab metric export failed", exc_info=True)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def write(self, record: StepRecord) -> None:
        if not self._write(record):
            raise RuntimeError(f"swanlab rejected values at step {record.step}")

    def _write(self, record: StepRecord) -> bool:
        # Non-number values (record.others) are skipped: SwanLab rejects plain strings, lists, dicts.
        return self.session.log(dict(record.scalars), record.step)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._release()


class SwanLabSpanExporter(_UsesSession, SpanExporter):
    def __init__(self, session: SwanLabSession | None = None) -> None:
        self._init_session(session)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = True
        for span in spans:
            try:
                step, key, seconds = span_timing(span, self.session.last_step)
                ok = self.session.log({key: seconds}, step) and ok
            except Exception:
                logger.debug("swanlab span export failed", exc_info=True)
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._release()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class SwanLabLogExporter(_UsesSession, LogRecordExporter):
    def __init__(self, session: SwanLabSession | None = None) -> None:
        self._init_session(session)

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        ok = True
        for item in batch:
            record = item.log_record
            if record.event_name != GENERATIONS_EVENT:
                continue  # the filtered-reward table is wandb-only in the reference
            try:
                attributes = record.attributes or {}
                step = int(attributes.get("ml.step", self.session.last_step))
                body = record.body if isinstance(record.body, Mapping) else {}
                ok = self.session.log_generations(list(body.get("samples") or []), step) and ok
            except Exception:
                logger.debug("swanlab generations export failed", exc_info=True)
                ok = False
        return LogRecordExportResult.SUCCESS if ok else LogRecordExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._release()


def open_bridge(context: BridgeContext) -> BridgeParts:
    session = SwanLabSession(context)
    return BridgeParts(
        metrics=SwanLabMetricExporter(session),
        spans=SwanLabSpanExporter(session),
        logs=SwanLabLogExporter(session),
        finish=session.finish,
        where=session.where,
    )
