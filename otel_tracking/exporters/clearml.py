"""ClearML tracker.

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
* a resumed run (``OTEL_TRACKING_RESUME``) continues the task by id (``continue_last_task=<task
  id>``, offline too: the same offline session folder), iterations not offset; ClearML keeps every
  reported point, so steps logged again after a restart hold both attempts' values, in report order.
* **Fix**: ``config=None`` connects no configuration (the reference passed ``None`` to
  ``connect_configuration``, which raises ``ValueError``, so the reference could not start).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from otel_tracking.exporters._base import (
    Event,
    HighestStep,
    SinkParts,
    StepRecord,
    TrackerContext,
    TrackerSession,
    sample_parts,
    stall_markdown,
    tracker_exporters,
)
from otel_tracking.signals.redact import scrubbed_logger
from otel_tracking.signals.semconv import GENERATIONS_EVENT, STALL_EVENT

logger = scrubbed_logger("otel_tracking.clearml")

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


def _forget_closed_parent_task() -> None:
    """ClearML marks the process that called ``Task.init`` in the environment (``<pid>:<task id>``)
    so that its subprocesses report into that task.  In the bridge process, a marker inherited from
    a training process whose task is already closed (``<pid>:``) would make ``Task.init`` return a
    task that writes nowhere: drop it, so that the tracker opens its own task as in one process."""
    for variable in ("CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID"):
        pid, _, task_id = os.environ.get(variable, "").partition(":")
        if pid and pid != str(os.getpid()) and not task_id:
            del os.environ[variable]


class ClearMLSession(HighestStep, TrackerSession):
    """One ClearML task shared by the metric, span and log exporters of one process."""

    def __init__(self, context: TrackerContext) -> None:
        from clearml import Task

        if str(context.env.get("CLEARML_OFFLINE_MODE", "")).strip().lower() in _TRUE:
            Task.set_offline(True)
        _forget_closed_parent_task()
        # A resumed run (or replay) continues the task it opened before, by id; else, as the
        # reference, the last task of this project and name.
        task_id = (context.resume or {}).get("task_id")
        self.task: Any = Task.init(
            task_name=context.experiment,
            project_name=context.project,
            continue_last_task=str(task_id) if task_id else True,
            output_uri=False,
        )
        if task_id:
            # ClearML offsets a continued task's iterations by its last one; ours are the caller's steps.
            self.task.set_initial_iteration(0)
        configuration = _configuration(context.config)
        if configuration is not None:
            try:
                self.task.connect_configuration(configuration, name=CONFIGURATION_NAME)
            except Exception:  # a value ClearML cannot write: connect its JSON form instead
                logger.debug("clearml connect_configuration failed; connecting a JSON copy", exc_info=True)
                self.task.connect_configuration(_json_safe(configuration), name=CONFIGURATION_NAME)
        self.logger: Any = self.task.get_logger()
        self.finished = False
        self.skipped_non_finite = 0
        self._lock = threading.Lock()
        self.where = self._describe(context)
        task_id = getattr(self.task, "id", None)
        self.resume = {"task_id": str(task_id)} if task_id else None

    @classmethod
    def open(cls, context: TrackerContext) -> ClearMLSession:
        return cls(context)

    def _describe(self, context: TrackerContext) -> str:
        try:
            if self.task.is_offline():
                return f"ClearML offline task {self.task.id} in {self.task.get_offline_mode_folder()}"
            return f"ClearML task {self.task.id}: {self.task.get_output_log_web_page()}"
        except Exception:
            return f"ClearML task {context.project}/{context.experiment}"

    # --- writing -------------------------------------------------------------------------------

    def write_step(self, record: StepRecord) -> bool:
        # Non-number values (record.others) are skipped: report_scalar takes numbers only.
        return self.report_scalars(record.scalars, record.step)

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        return self.report_scalars({key: seconds}, step)

    def write_event(self, event: Event) -> bool:
        if event.name == STALL_EVENT:  # a WARNING line in the task's console (its Console tab)
            with self._lock:
                if self.finished:
                    return False
                self.logger.report_text(stall_markdown(event), level=logging.WARNING, print_console=False)
            return True
        if event.name != GENERATIONS_EVENT:
            return True  # the filtered-reward table is wandb-only in the reference
        step = self.last_step if event.step is None else event.step
        return self.report_generations(list(event.body.get("samples") or []), step)

    def report_scalars(self, scalars: Mapping[str, Any], step: int) -> bool:
        ok = True
        with self._lock:
            if self.finished:
                return False
            self.last_step = step
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
            input_text, output_text, score = sample_parts(sample)
            rows.append({"step": step, "input": input_text, "output": output_text, "score": score})
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


EXPORTERS = tracker_exporters("ClearML", ClearMLSession, __name__)
ClearMLMetricExporter, ClearMLSpanExporter, ClearMLLogExporter = EXPORTERS.metrics, EXPORTERS.spans, EXPORTERS.logs


def open_tracker(context: TrackerContext) -> SinkParts:
    return EXPORTERS.parts(ClearMLSession.open(context))
