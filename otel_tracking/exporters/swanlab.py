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
  would emit, without its per-value checks (``_StepEvents``): the same records.
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
        self._steps = _StepEvents.of(self.run)
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


# SwanLab's run.log spends ~1 ms of a step of 200 numbers checking it (a flatten, a context manager
# and a pydantic key check per value) before it emits one event for SwanLab's writer thread, in the
# one GIL that thread needs for the rest (~6 ms of that step).  The step records of a training run
# are plain numbers under the same keys step after step: for those, _StepEvents emits the event
# run.log would emit, with the same lock, step and timestamp, once each key has been through
# SwanLab's own key check unchanged.  Anything else (a table, a NumPy number, a key SwanLab trims
# or rejects, a finished run) and a SwanLab without these internals go through run.log.
# tests/test_swanlab_steps.py checks that the records are run.log's.

_NUMBERS = (float, int, bool)


class _StepEvents:
    """Emits a step of plain numbers as SwanLab's ``run.log`` would."""

    def __init__(self, run: Any, event: Any, timestamp: Any, validate_key: Any) -> None:
        self.run = run
        self._event = event
        self._timestamp = timestamp
        self._validate_key = validate_key
        self._emit = run._components.emitter.emit
        self._kept: set[str] = set()  # keys SwanLab's key check returned unchanged

    @classmethod
    def of(cls, run: Any) -> _StepEvents | None:
        try:
            from google.protobuf.timestamp_pb2 import Timestamp
            from swanlab.sdk.internal.bus import MetricLogEvent
            from swanlab.sdk.internal.run import fmt

            if not all(hasattr(run, name) for name in ("_api_lock", "_ctx", "alive")):
                return None
            if not callable(getattr(run._ctx, "next_step", None)):
                return None
            return cls(run, MetricLogEvent, Timestamp, fmt.validate_key)
        except Exception:  # another SwanLab: run.log it is
            return None

    def emit(self, data: Mapping[str, Any], step: int) -> bool:
        """Emit ``data`` at ``step``; False (nothing emitted) unless run.log would emit it as it is."""
        if type(step) is not int or step < 0:
            return False
        kept = self._kept
        for key, value in data.items():
            if type(value) not in _NUMBERS:
                return False
            if key not in kept and not self._keeps(key):
                return False
        run = self.run
        with run._api_lock:
            if not run.alive:
                return False
            next_step = run._ctx.next_step(step)
            timestamp = self._timestamp()
            timestamp.GetCurrentTime()
            self._emit(self._event(data=dict(data), step=next_step, timestamp=timestamp))
        return True

    def _keeps(self, key: Any) -> bool:
        if type(key) is not str:
            return False
        try:
            same = self._validate_key(key) == key
        except Exception:  # rejected: run.log says so
            return False
        if same:
            self._kept.add(key)
        return same


EXPORTERS = tracker_exporters("SwanLab", SwanLabSession, __name__)
SwanLabMetricExporter, SwanLabSpanExporter, SwanLabLogExporter = EXPORTERS.metrics, EXPORTERS.spans, EXPORTERS.logs


def open_tracker(context: TrackerContext) -> SinkParts:
    return EXPORTERS.parts(SwanLabSession.open(context))
