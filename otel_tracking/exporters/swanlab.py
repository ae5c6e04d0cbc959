"""SwanLab tracker.

Opens the run as the reference did: ``SWANLAB_API_KEY`` -> ``swanlab.login(key)`` (the key goes to
login and nowhere else), ``SWANLAB_LOG_DIR`` (default ``swanlog``), ``SWANLAB_MODE`` (default
``cloud``, which SwanLab 0.10 treats as ``online``), then ``swanlab.init(project=, name=<experiment>,
config={"FRAMEWORK": "verl", **config}, log_dir=, mode=)``.  All variables come from the run's
environment mapping (``TrackerContext.env``).

What lands where:

* ``log(data, step)`` numbers -> ``run.log({key: value, ...}, step=step)``, keys exactly as written;
  NaN and +/-inf included (SwanLab stores them); bools as SwanLab stores them (1/0).  Non-number
  values are skipped: the reference passed them too, and SwanLab rejected each with an error line.
  A step of plain numbers under keys SwanLab keeps as they are is emitted as the event ``run.log``
  would emit, without its per-value checks (``compat/swanlab_internals.py``): the same records.
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

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from otel_tracking.compat.swanlab_internals import FastSteps
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

logger = scrubbed_logger("otel_tracking.swanlab")

GENERATIONS_KEY = "val/generations"
GENERATIONS_HEADERS = ["step", "input", "output", "score"]
_OFFLINE_MODES = {"offline", "local", "disabled"}


def swanlab_init_arguments(context: TrackerContext) -> tuple[str | None, dict[str, Any]]:
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
    run_id = (context.resume or {}).get("id")
    if run_id:  # a resumed run (or replay): the same SwanLab run, by id
        kwargs.update(id=str(run_id), resume="allow")
    return api_key, kwargs


class SwanLabSession(HighestStep, TrackerSession):
    """One SwanLab run shared by the metric, span and log exporters of one process."""

    def __init__(self, context: TrackerContext) -> None:
        import swanlab

        self._swanlab = swanlab
        api_key, kwargs = swanlab_init_arguments(context)
        if api_key and str(kwargs["mode"]).lower() not in _OFFLINE_MODES:
            swanlab.login(api_key)  # NOTE: overwrites any previous login, as in the reference
        self.run = swanlab.init(**kwargs)
        run_id = getattr(self.run, "id", None)
        self.resume = {"id": str(run_id)} if run_id else None  # how a resumed run reattaches
        self.finished = False
        self._lock = threading.Lock()
        self._steps = FastSteps.of(self.run)
        run_dir = getattr(self.run, "dir", None)
        self.where = f"SwanLab {kwargs['mode']} run {context.project}/{context.experiment}" + (
            f" at {run_dir}" if run_dir else ""
        )

    @classmethod
    def open(cls, context: TrackerContext) -> SwanLabSession:
        return cls(context)

    # --- writing -------------------------------------------------------------------------------

    def log(self, data: dict[str, Any], step: int) -> bool:
        """Log one step's values; a value SwanLab rejects does not lose the others."""
        if not data:
            return True
        with self._lock:
            if self.finished:
                return False
            self.last_step = step
            try:
                if self._steps is not None and self._steps.emit(data, step):
                    return True
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

    def write_step(self, record: StepRecord) -> bool:
        # Non-number values (record.others) are skipped: SwanLab rejects plain strings, lists, dicts.
        return self.log(dict(record.scalars), record.step)

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        return self.log({key: seconds}, step)

    def write_event(self, event: Event) -> bool:
        if event.name == STALL_EVENT:  # a text entry at the step, under ml.stall/<phase>
            step = self.last_step if event.step is None else event.step
            key = f"ml.stall/{event.attributes.get('ml.phase', 'phase')}"
            return self.log({key: self._swanlab.Text(stall_markdown(event))}, step)
        if event.name != GENERATIONS_EVENT:
            return True  # the filtered-reward table is wandb-only in the reference
        step = self.last_step if event.step is None else event.step
        return self.log_generations(list(event.body.get("samples") or []), step)

    def log_generations(self, samples: Sequence[Any], step: int) -> bool:
        table = self._swanlab.echarts.Table()
        rows = [[step, *sample_parts(sample)] for sample in samples]
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


EXPORTERS = tracker_exporters("SwanLab", SwanLabSession, __name__)
SwanLabMetricExporter, SwanLabSpanExporter, SwanLabLogExporter = EXPORTERS.metrics, EXPORTERS.spans, EXPORTERS.logs


def open_tracker(context: TrackerContext) -> SinkParts:
    return EXPORTERS.parts(SwanLabSession.open(context))
