"""ClearML bridge.

Opens the task as the reference did: ``Task.init(task_name=<experiment>, project_name=<project>,
continue_last_task=True, output_uri=False)``, then ``task.connect_configuration(config,
name="Hyperparameters")``.  ClearML's own settings (server, credentials, ``CLEARML_CONFIG_FILE``)
are ClearML's business; the one variable read here is ``CLEARML_OFFLINE_MODE`` (from the run's
environment mapping): when it is true, ``Task.set_offline(True)`` is called before ``Task.init``,
so offline mode works even when ClearML was imported before the variable was set.

What lands where:

* ``log(data, step)`` numbers -> ``logger.report_scalar(title, series, value, iteration=step)``.
  A key with a ``/`` is split at its first ``/`` into ``title, series`` (as the reference did:
  ``train/loss`` -> ``train`` / ``loss``, ``a/b/c`` -> ``a`` / ``b/c``).  **Fix**: a key without a
  ``/`` (``loss``) is reported as ``title = series = key``; the reference crashed on it and lost
  the rest of that ``log()`` call.
* NaN and +/-inf are skipped: ClearML cannot store them and would report them as ``0.0`` (the
  reference's behaviour), a value the run never had.  Bools are reported as ClearML stores them
  (1.0 / 0.0), as in the reference.  Non-number values are skipped (the reference tried to warn
  through ``Logger.warning``, which ClearML's Logger does not have, and crashed).
* each finished ``trace_state`` span -> scalar ``timing_s/state/<name>`` at the span's step
  (title ``timing_s``, series ``state/<name>``).
* ``ml.validation.generations`` -> ``logger.report_table(title="Validation", series="Validation
  generations", table_plot=DataFrame[step, input, output, score], iteration=step)``.
* ``ml.table.filtered_reward_counts`` is wandb-only in the reference: nothing is written here.
* ``finish()`` -> ``task.close()``.
* **Fix**: ``config=None`` connects no configuration (the reference passed ``None`` to
  ``connect_configuration``, which raises ``ValueError``, so the reference could not start).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.exporters._base import BridgeContext, BridgeParts, StepMetricExporter, StepRecord, span_timing

logger = logging.getLogger("otel_tracking.clearml")

GENERATIONS_EVENT = "ml.validation.generations"
TABLE_TITLE = "Validation"
TABLE_SERIES = "Validation generations"
CONFIGURATION_NAME = "Hyperparameters"
_TRUE = {"1", "true", "yes", "on", "y"}


def title_and_series(key: str) -> tuple[str, str]:
    """The ClearML (title, series) of a log() key: split at the first ``/``; no ``/``: (key, key)."""
    if "/" in key:
        title, series = key.split("/", 1)
        return title, series
    return key, key


def _configuration(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    return {"config": config}  # connect_configuration takes a dict (or a file), not a list or a number


def _json_safe(config: dict[str, Any]) -> dict[str, Any]:
    result = json.loads(json.dumps(config, default=str))
    return result if isinstance(result, dict) else {"config": result}


class ClearMLSession:
    """One ClearML task shared by the metric, span and log exporters of one process."""

    def __init__(self, context: BridgeContext) -> None:
        from clearml import Task

        if str(context.env.get("CLEARML_OFFLINE_MODE", "")).strip().lower() in _TRUE:
            Task.set_offline(True)
        self.task = Task.init(
            task_name=context.experiment,
            project_name=context.project,
            continue_last_task=True,
            output_uri=False,
        )
        configuration = _configuration(context.config)
        if configuration is not None:
            try:
                self.task.connect_configuration(configuration, name=CONFIGURATION_NAME)
            except Exception:  # a value ClearML cannot write: connect its JSON form instead
                logger.debug("clearml connect_configuration failed; connecting a JSON copy", exc_info=True)
                self.task.connect_configuration(_json_safe(configuration), name=CONFIGURATION_NAME)
        self.logger = self.task.get_logger()
        self.last_step = 0
        self.finished = False
        self.skipped_non_finite = 0
        self._lock = threading.Lock()
        self._users = 0
        self.where = self._describe(context)

    def _describe(self, context: BridgeContext) -> str:
        try:
            if self.task.is_offline():
                return f"ClearML offline task {self.task.id} in {self.task.get_offline_mode_folder()}"
            return f"ClearML task {self.task.id}: {self.task.get_output_log_web_page()}"
        except Exception:
            return f"ClearML task {context.project}/{context.experiment}"

    # --- writing -------------------------------------------------------------------------------

    def report_scalars(self, scalars: Mapping[str, Any], step: int) -> bool:
        ok = True
        with self._lock:
            if self.finished:
                return False
            self.last_step = max(self.last_step, step)
            for key, value in scalars.items():
                if isinstance(value, float) and not math.isfinite(value):
                    self.skipped_non_finite += 1
                    continue
                title, series = title_and_series(key)
                try:
                    self.logger.report_scalar(title=title, series=series, value=value, iteration=step)
                except Exception:
                    logger.debug("clearml rejected %r at step %s", key, step, exc_info=True)
                    ok = False
        return ok

    def report_generations(self, samples: Sequence[Any], step: int) -> bool:
        import pandas as pd

        rows = []
        for sample in samples:
            parts = list(sample) if isinstance(sample, (list, tuple)) else [sample]
            parts = [*parts, None, None, None][:3]
            rows.append({"step": step, "input": parts[0], "output": parts[1], "score": parts[2]})
        table = pd.DataFrame.from_records(rows, columns=["step", "input", "output", "score"])
        with self._lock:
            if self.finished:
                return False
            self.logger.report_table(title=TABLE_TITLE, series=TABLE_SERIES, table_plot=table, iteration=step)
        return True

    # --- lifetime ------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0) -> None:
        with self._lock:
            if self.finished:
                return
            self.finished = True
        if self.skipped_non_finite:
            logger.info(
                "otel-tracking: %d NaN/inf values were not sent to ClearML (it cannot store them)",
                self.skipped_non_finite,
            )
        self.task.close()

    def attach(self) -> None:
        with self._lock:
            self._users += 1

    def detach(self) -> bool:
        with self._lock:
            self._users -= 1
            return self._users <= 0


# --- the process-wide session, for exporters built with no arguments ------------------------------

_shared_lock = threading.Lock()
_shared: ClearMLSession | None = None


def _shared_session() -> ClearMLSession:
    global _shared
    with _shared_lock:
        if _shared is None or _shared.finished:
            _shared = ClearMLSession(BridgeContext.from_env())
        _shared.attach()
        return _shared


class _UsesSession:
    def _init_session(self, session: ClearMLSession | None) -> None:
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


class ClearMLMetricExporter(_UsesSession, StepMetricExporter):
    def __init__(self, session: ClearMLSession | None = None) -> None:
        StepMetricExporter.__init__(self)
        self._init_session(session)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        ok = True
        try:
            for record in self.records(metrics_data):
                ok = self._write(record) and ok
        except Exception:
            logger.debug("clearml metric export failed", exc_info=True)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def write(self, record: StepRecord) -> None:
        if not self._write(record):
            raise RuntimeError(f"clearml rejected values at step {record.step}")

    def _write(self, record: StepRecord) -> bool:
        # Non-number values (record.others) are skipped: report_scalar takes numbers only.
        return self.session.report_scalars(record.scalars, record.step)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._release()


class ClearMLSpanExporter(_UsesSession, SpanExporter):
    def __init__(self, session: ClearMLSession | None = None) -> None:
        self._init_session(session)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = True
        for span in spans:
            try:
                step, key, seconds = span_timing(span, self.session.last_step)
                ok = self.session.report_scalars({key: seconds}, step) and ok
            except Exception:
                logger.debug("clearml span export failed", exc_info=True)
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._release()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class ClearMLLogExporter(_UsesSession, LogRecordExporter):
    def __init__(self, session: ClearMLSession | None = None) -> None:
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
                ok = self.session.report_generations(list(body.get("samples") or []), step) and ok
            except Exception:
                logger.debug("clearml generations export failed", exc_info=True)
                ok = False
        return LogRecordExportResult.SUCCESS if ok else LogRecordExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._release()


def open_bridge(context: BridgeContext) -> BridgeParts:
    session = ClearMLSession(context)
    return BridgeParts(
        metrics=ClearMLMetricExporter(session),
        spans=ClearMLSpanExporter(session),
        logs=ClearMLLogExporter(session),
        finish=session.finish,
        where=session.where,
    )
