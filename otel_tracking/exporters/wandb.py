"""Weights & Biases tracker.

One wandb run per session, opened as the reference did::

    wandb.init(project=project, name=experiment, entity=$WANDB_ENTITY, config=config,
               settings=wandb.Settings(https_proxy=config["trainer"]["wandb_proxy"]) if that is set)

and written with ``run.log(data, step=step)``, ended with ``run.finish(exit_code=...)``.
In the bridge process (the default), ``console="off"`` is added to those settings unless
``WANDB_CONSOLE`` says otherwise: wandb's console capture there would record only the other
trackers' messages, which share that process, never the training script's output.

* Metrics: every scalar under the caller's key, at the caller's step (NaN and +/-inf included: wandb
  stores them), plus the non-number values the reference also handed to wandb (strings, None,
  lists, dicts).  wandb ignores data logged at a step below the highest step it has seen (unless
  tensorboard is patched by sync_tensorboard); such a record is not sent.  Neither is a value wandb
  refuses (the other values of its step still go).  Both are permanent refusals, not failures:
  ``export()`` returns SUCCESS (a retry or a replay could not change them), they are counted in
  ``WandbSession.skipped``, warned about once and summed up at ``finish()``.  FAILURE means wandb
  itself failed (e.g. its run is gone): the delivery layer retries or spools that.
* Spans: ``timing_s/state/<name>`` (seconds) once per step at the spans' ``ml.step``, with ``.../slowest`` for a
  phase several lanes ran (``timings.StepTimings``).
* Events: ``ml.validation.generations`` becomes the reference's ``val/generations`` table (columns
  ``step, input_1, output_1, score_1, ...``, one row per validation step) and
  ``ml.table.filtered_reward_counts`` the DAPO ``training/filter_groups/filtered_reward_counts``
  table (``step, reward_counts``).  With wandb >= 0.20 both are INCREMENTAL tables: each log adds
  only its new row (the reference re-uploaded every previous generations row at every step); the
  union of the increments is the reference's table.  Older wandb gets the full table each time.
  When the number of samples per validation step changes (the reference raised ``ValueError``
  there), a new table with the new columns starts under the same key.

A step of plain numbers (the usual one) does not go through ``run.log``: the tracker hands wandb's
service the very request ``run.log`` would send for it, built without run.log's per-value work
(``compat/wandb_internals.py``; with the wandb releases it was checked against).  Everything else does.

A resumed run (``OTEL_TRACKING_RESUME``) opens its wandb run when its first step arrives, as a
*rewind* of the previous attempt's run: ``wandb.init(resume_from="<run id>?_step=<c>")``, ``c`` the
checkpoint step it restarts from (``config/resume.py``; without one, the step before its first), so
that wandb replaces what the killed job logged after it (offline, the branch point is
recorded in the run's ``_wandb.branch_point`` config and applied by ``wandb sync``).  Where wandb
refuses a rewind (a server without the feature), the run is resumed by id with ``resume="allow"``
instead: then wandb keeps the first attempt's values at the overlapping steps and drops the new
ones (counted in ``skipped``).  Spans and events that come before that first step wait for it.

``WandbSession.start`` takes the wandb-like module to drive, so the vemlp_wandb tracker (Volcengine's
``volcengine_ml_platform.wandb``) reuses all of this.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_tracking.compat.wandb_internals import FastSteps
from otel_tracking.exporters._base import (
    AlertLimit,
    Event,
    SinkParts,
    StepRecord,
    TrackerContext,
    TrackerSession,
    sample_parts,
    stall_summary,
    stall_title,
    tracker_exporters,
)
from otel_tracking.exporters.timings import PhaseTiming
from otel_tracking.signals.semconv import GENERATIONS_EVENT, REWARD_TABLE_EVENT, STALL_EVENT

logger = logging.getLogger("otel_tracking")

GENERATIONS_KEY = "val/generations"
REWARD_TABLE_KEY = "training/filter_groups/filtered_reward_counts"


def _incremental_supported(module: Any) -> bool:
    from packaging.version import InvalidVersion, Version

    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        return True  # a fork without a version: try, and fall back on TypeError
    try:
        return Version(version) >= Version("0.20.0")
    except InvalidVersion:
        return True


class _Table:
    """One logged table: INCREMENTAL where the module supports it, else rebuilt with every row."""

    def __init__(self, module: Any, columns: list[str]) -> None:
        self.module = module
        self.columns = columns
        self.rows: list[list[Any]] = []
        self.incremental: Any = None
        if _incremental_supported(module):
            try:
                self.incremental = module.Table(columns=columns, log_mode="INCREMENTAL")
            except TypeError:  # a Table without log_mode
                self.incremental = None

    def add(self, row: list[Any]) -> Any:
        """The object to log after adding ``row``."""
        if self.incremental is not None:
            self.incremental.add_data(*row)
            return self.incremental
        self.rows.append(row)
        return self.module.Table(columns=self.columns, data=[list(r) for r in self.rows])


class WandbSession(TrackerSession):
    """One wandb run shared by a metric, a span and a log exporter.  Calls are serialized by a
    lock (spans end in any thread); no threads of its own."""

    events: tuple[str, ...] = (GENERATIONS_EVENT, REWARD_TABLE_EVENT, STALL_EVENT)  # the event kinds it writes

    def __init__(self, module: Any, run: Any, backend: str = "wandb", monotonic_steps: bool = True) -> None:
        self.module = module
        self.run = run
        self.backend = backend
        # The run object when init returned one (it keeps writing to *our* run even if the app
        # starts another); else the module's own log/finish, as the reference called them.
        self._target = run if run is not None and callable(getattr(run, "log", None)) else module
        self._lock = threading.RLock()
        self.alerts = AlertLimit()  # stall alerts reach Slack or email: never a flood
        self.high_step: int | None = None  # the highest step handed to wandb
        # wandb ignores data at a step below one it has seen, unless sync_tensorboard patched
        # tensorboard (then it ignores explicit steps altogether); a fork decides for itself.
        self.monotonic_steps = monotonic_steps
        self.finished = False
        self.skipped = 0  # values wandb could not take, or records at a step it would ignore
        self._generations: _Table | None = None
        self._reward_table: _Table | None = None
        self._warned: set[str] = set()
        self.pid = os.getpid()
        self.where = self._where()
        self.resume = self._resume()
        self._deferred: dict[str, Any] | None = None  # init kwargs of a rewind that waits for its first step
        self._checkpoint_step: int | None = None  # where that rewind goes back to
        self._pending: list[tuple[dict[str, Any], int]] = []  # what came before that step
        self._history: FastSteps | None = None  # the fast path for steps of plain numbers (write_steps)
        self._history_looked = False  # whether _history was looked for (once the run is open)

    @classmethod
    def rewind(cls, module: Any, run_id: str, checkpoint_step: int | None = None, **init_kwargs: Any) -> WandbSession:
        """A session whose run opens at the first step written, as a rewind of run ``run_id`` to
        ``checkpoint_step``, else to the step before that first one (see the module's notes)."""
        session = cls(module, None)
        session._checkpoint_step = checkpoint_step
        session._deferred = {**init_kwargs, "id": run_id}
        session.resume = {"id": run_id, "project": init_kwargs.get("project"), "entity": init_kwargs.get("entity")}
        session.where = f"wandb run {run_id} (resumed; opens at its first step)"
        return session

    def _open_deferred(self, step: int) -> None:
        kwargs = dict(self._deferred or {})
        self._deferred = None
        run_id = str(kwargs.pop("id"))
        # wandb keeps the rewound run's history up to the given step: the checkpoint's, or the
        # step before the first one this attempt logs.
        back_to = max(step - 1, 0) if self._checkpoint_step is None else self._checkpoint_step
        try:
            run = self.module.init(**kwargs, resume_from=f"{run_id}?_step={back_to}")
        except Exception as error:
            logger.warning(
                "otel-tracking: wandb did not rewind run %s to step %s (%s); resuming it by id instead: "
                "wandb keeps the earlier values of the steps logged again",
                run_id,
                back_to,
                error,
            )
            run = self.module.init(**kwargs, id=run_id, resume="allow")
        self.run = run
        self._target = run if run is not None and callable(getattr(run, "log", None)) else self.module
        self.where = self._where()
        self.resume = self._resume() or self.resume
        try:
            current = int(getattr(run, "step", 0) or 0)
        except (TypeError, ValueError):
            current = 0
        if current > 0:  # what wandb would drop: below its step (a resume by id, online)
            self.high_step = current

    # --- opening --------------------------------------------------------------------------------

    @classmethod
    def open(cls, context: TrackerContext) -> WandbSession:
        import wandb

        # The real proxy URL (credentials and all) from inputs; the recorded config has it redacted.
        proxy = context.inputs.get("wandb_proxy") or _proxy(context.config)
        chosen: dict[str, Any] = {"https_proxy": proxy} if proxy else {}
        if context.in_bridge_process and not context.env.get("WANDB_CONSOLE"):
            # Its console capture would record the other trackers' messages (MLflow's, Trackio's)
            # as the run's Logs, and never a line of the training script: off, unless asked for.
            chosen["console"] = "off"
        settings = wandb.Settings(**chosen) if chosen else None
        kwargs: dict[str, Any] = {
            "project": context.project,
            "name": context.experiment,
            "entity": context.env.get("WANDB_ENTITY") or None,
            "config": context.config,
            "settings": settings,
        }
        resumed = (context.resume or {}).get("id")
        if context.continuing and resumed:  # a restarted job: rewind the run at its first step
            kwargs.update(resume_kwargs(context))
            kwargs.pop("resume", None)
            return cls.rewind(wandb, str(kwargs.pop("id")), context.checkpoint_step, **kwargs)
        return cls.start(wandb, **{**kwargs, **resume_kwargs(context)})

    @classmethod
    def start(
        cls, module: Any, backend: str = "wandb", monotonic_steps: bool = True, **init_kwargs: Any
    ) -> WandbSession:
        """``module.init(**init_kwargs)`` and a session writing to the run it returned."""
        run = module.init(**init_kwargs)
        session = cls(module, run, backend=backend, monotonic_steps=monotonic_steps)
        if init_kwargs.get("resume"):
            # A resumed run continues at wandb's step (online: one past the last step it holds):
            # what comes below it is counted as skipped, as wandb would drop it.
            try:
                current = int(getattr(run, "step", 0) or 0)
            except (TypeError, ValueError):
                current = 0
            if current > 0:
                session.high_step = current
        return session

    # --- writing --------------------------------------------------------------------------------

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("otel-tracking: %s: " + message, self.backend, *args)

    def log(self, data: Mapping[str, Any], step: int, opens: bool = False) -> bool:
        """Hand ``data`` to wandb at ``step``.  False only when wandb failed (worth a retry); values
        it refuses for good (a step below one already logged, a value it cannot serialize) are
        counted in ``skipped`` and do not make the call fail.  ``opens``: a step record, which opens
        a rewind that waits for its first step (anything else waits with it)."""
        if not data:
            return True
        with self._lock:
            if self.finished:
                return False
            if self._deferred is not None:
                if not opens:
                    self._pending.append((dict(data), step))
                    return True
                self._open_deferred(step)
                pending, self._pending = self._pending, []
                for earlier, at in pending:
                    self.log(earlier, at)
            if self.high_step is not None and step < self.high_step and self._drops_backwards_steps():
                # wandb would drop it with a warning: count it instead.
                self.skipped += len(data)
                self._warn_once(
                    "backwards",
                    "step %s is below the step already logged (%s); wandb keeps steps monotonic, so "
                    "this data is not stored (further cases are counted and reported at finish)",
                    step,
                    self.high_step,
                )
                return True
            try:
                self._target.log(dict(data), step=step)
            except (TypeError, ValueError) as error:  # a value it refuses: the others still go
                if len(data) == 1:
                    self.skipped += 1
                    self._warn_once(f"value:{type(error).__name__}", "wandb refused %r: %s", next(iter(data)), error)
                    return True
                ok = True
                for key, value in data.items():
                    ok = self.log({key: value}, step) and ok
                return ok
            self._reached(step)
            return True

    def write_step(self, record: StepRecord) -> bool:
        return self.write_steps([record]) == [None]

    def write_steps(
        self, records: Sequence[StepRecord], progress: Callable[[], None] = lambda: None
    ) -> list[StepRecord | None]:
        """Each step as :meth:`log` writes it, but a step of plain numbers, when this wandb has the
        internals ``compat/wandb_internals.py`` needs, goes to wandb's service as the very request ``run.log``
        would send, built without run.log's per-value work, several steps a hand-off."""
        rests: list[StepRecord | None] = []  # None for each record written, in order
        with self._lock:
            if not self._history_looked and self._deferred is None and not self.finished:
                self._history_looked = True
                self._history = FastSteps.of(self.run)
            history = self._history
            batch: list[Any] = []  # the requests of records[len(rests):], built and not sent yet
            values = 0
            before = self.high_step  # high_step before the batch: restored if wandb fails to take it

            def send() -> bool:
                nonlocal batch, values, before
                assert history is not None
                if not self._send(history, batch, before):
                    return False
                rests.extend([None] * len(batch))
                batch, values, before = [], 0, self.high_step
                progress()
                return True

            for record in records:
                request = history.request(record.scalars, record.step) if history and self._direct(record) else None
                if request is not None:
                    batch.append(request)
                    values += len(record.scalars)
                    self._reached(record.step)
                    if values >= _VALUES_A_HANDOFF and not send():
                        break
                    continue
                if batch and not send():
                    break
                if not self._log_step(record):
                    break
                rests.append(None)
                before = self.high_step
                progress()
            else:
                if not batch or send():
                    return rests
        return rests + list(records[len(rests) :])

    def _reached(self, step: int) -> None:
        """wandb was handed ``step``: the highest step it has seen (under the lock)."""
        self.high_step = step if self.high_step is None else max(self.high_step, step)

    def _direct(self, record: StepRecord) -> bool:
        """Whether :meth:`log` would do nothing with ``record`` but hand its numbers to wandb."""
        if record.others or self.finished or self._deferred is not None:
            return False
        return self.high_step is None or record.step >= self.high_step or not self._drops_backwards_steps()

    def _send(self, history: FastSteps, batch: list[Any], before: int | None) -> bool:
        """Hand ``batch`` to wandb; False (and ``high_step`` as it was before) if wandb failed."""
        try:
            history.send(batch)
        except Exception as error:
            self.high_step = before
            self._warn_once("send", "wandb did not take %d step(s): %s (they are retried)", len(batch), error)
            return False
        return True

    def _log_step(self, record: StepRecord) -> bool:
        data: dict[str, Any] = dict(record.scalars)
        for key, value in record.others.items():
            data.setdefault(key, value)
        return self.log(data, record.step, opens=True)

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        return self.log({key: seconds}, step)

    def write_spans(self, spans: Sequence[Any]) -> bool:
        """Spans without ``ml.step`` count at the highest step logged."""
        return self.write_timings(self.step_timings.add(spans, self.high_step or 0))

    def write_timings(self, timings: Sequence[PhaseTiming]) -> bool:
        """One ``log`` per step, in step order."""
        by_step: dict[int, dict[str, float]] = {}
        for timing in timings:
            by_step.setdefault(timing.step, {}).update(timing.scalars())
        ok = True
        for step in sorted(by_step):
            try:
                ok = self.log(by_step[step], step) and ok
            except Exception:
                logger.debug("otel-tracking: %s span export failed", self.backend, exc_info=True)
                ok = False
        if not ok:
            self.step_timings.hold(timings)
        return ok

    def write_event(self, event: Event) -> bool:
        """The event kinds in :attr:`events`, as the reference wrote them; other log records are ignored."""
        if event.name not in self.events:
            return True
        step = 0 if event.step is None else event.step
        if event.name == STALL_EVENT:
            return self.alert_stall(event)
        if event.name == GENERATIONS_EVENT:
            return self.log_generations(list(event.body.get("samples") or []), step)
        row = list(event.body.get("row") or [step, ""])
        return self.log_reward_row(list(event.body.get("columns") or ["step", "reward_counts"]), row, step)

    def _drops_backwards_steps(self) -> bool:
        if not self.monotonic_steps:
            return False
        patched = getattr(self.module, "patched", None)
        return not (isinstance(patched, Mapping) and patched.get("tensorboard"))

    def alert_stall(self, event: Event) -> bool:
        """A wandb alert (what wandb sends to Slack or email, per the user's settings), WARN."""
        alert = getattr(self.run, "alert", None)
        if not callable(alert):  # a rewind that has not opened yet, or a wandb-like without alerts
            return True
        title = stall_title(event)[:63]
        with self._lock:
            if not self.alerts.allow(str(event.attributes.get("ml.phase"))):
                return True  # held back: counted, and said by the next alert
            alert(title=title, text=self.alerts.text(stall_summary(event)), level="WARN", wait_duration=0)
        return True

    def log_generations(self, samples: Sequence[Any], step: int) -> bool:
        """The reference's ``_log_generations_to_wandb``: one row ``[step, in_1, out_1, score_1, ...]``."""
        with self._lock:
            columns = ["step"]
            for i in range(len(samples)):
                columns += [f"input_{i + 1}", f"output_{i + 1}", f"score_{i + 1}"]
            row: list[Any] = [step]
            for sample in samples:
                # A short sample is padded with None, a long one cut to 3 (the reference's table
                # raised ValueError for either).
                row += sample_parts(sample)
            if self._generations is None or self._generations.columns != columns:
                self._generations = _Table(self.module, columns)
            return self.log({GENERATIONS_KEY: self._generations.add(row)}, step)

    def log_reward_row(self, columns: Sequence[str], row: Sequence[Any], step: int) -> bool:
        """The reference's DAPO table: one ``[step, "reward:count, ..."]`` row per call."""
        with self._lock:
            columns = [str(c) for c in columns]
            if self._reward_table is None or self._reward_table.columns != columns:
                self._reward_table = _Table(self.module, columns)
            return self.log({REWARD_TABLE_KEY: self._reward_table.add(list(row))}, step)

    # --- the end --------------------------------------------------------------------------------

    def finish(self, exit_code: int = 0) -> None:
        with self._lock:
            if self.finished:
                return
            self.finished = True
            if os.getpid() != self.pid:
                return  # a forked child must not end its parent's run
            if self.skipped:
                logger.warning(
                    "otel-tracking: %s: %d value(s) were not stored (steps below one already logged, "
                    "or values wandb refused)",
                    self.backend,
                    self.skipped,
                )
            if self._deferred is not None:  # resumed, and nothing logged: end the run it resumed
                kwargs = dict(self._deferred)
                self._deferred = None
                self._target = self.module.init(**kwargs, resume="allow")
            self._target.finish(exit_code=exit_code)

    def _resume(self) -> dict[str, Any] | None:
        """What ``open_tracker`` needs (as ``context.resume``) to reattach to this run."""
        try:
            run_id = getattr(self.run, "id", None)
            project = getattr(self.run, "project", None)
            entity = getattr(self.run, "entity", None)
        except Exception:
            return None
        if not run_id:
            return None
        return {"id": str(run_id), "project": project or None, "entity": entity or None}

    def _where(self) -> str:
        url = None
        try:
            url = getattr(self.run, "url", None)
        except Exception:
            url = None
        if url:
            return str(url)
        try:
            sync_dir = self.run.settings.sync_dir
        except Exception:
            sync_dir = None
        return f"{self.backend} run at {sync_dir}" if sync_dir else f"{self.backend} run"


# --- steps of plain numbers -------------------------------------------------------------------------
#
# run.log does per-value work for a step (checks, a JSON encoder and a protobuf item per value, a
# telemetry histogram) and one hand-off to wandb's asyncio thread per step: in the bridge process
# that is the whole of a burst's time to land.  For a step of plain numbers under ordinary keys,
# compat/wandb_internals.py builds the very request run.log would build, and several such steps
# go in one hand-off.  tests/test_wandb_fast_steps.py checks the stored records against run.log's.

_VALUES_A_HANDOFF = 4_000  # values of the steps sent in one hand-off to wandb's asyncio thread


# --- opening a run ------------------------------------------------------------------------------


def _proxy(config: Any) -> str | None:
    """``config["trainer"]["wandb_proxy"]`` when the config has it (the reference required a
    ``trainer`` section whenever a config was given; a config without one works here)."""
    if not isinstance(config, Mapping):
        return None
    trainer = config.get("trainer")
    if not isinstance(trainer, Mapping):
        return None
    proxy = trainer.get("wandb_proxy")
    return str(proxy) if proxy else None


def resume_kwargs(context: TrackerContext) -> dict[str, Any]:
    """On replay (``context.resume`` from a spool header), and for vemlp_wandb when a restarted job
    resumes its run: reattach to the same run by id, with ``resume="allow"``.  wandb ignores data
    at steps below the run's current step (a replay's, and a resumed run's overlapping steps)."""
    resume = context.resume or {}
    if not resume.get("id"):
        return {}
    kwargs: dict[str, Any] = {"id": str(resume["id"]), "resume": "allow"}
    if resume.get("project"):
        kwargs["project"] = str(resume["project"])
    if resume.get("entity"):
        kwargs["entity"] = str(resume["entity"])
    return kwargs


EXPORTERS = tracker_exporters("Wandb", WandbSession, __name__)
WandbMetricExporter, WandbSpanExporter, WandbLogExporter = EXPORTERS.metrics, EXPORTERS.spans, EXPORTERS.logs


def open_tracker(context: TrackerContext) -> SinkParts:
    return EXPORTERS.parts(WandbSession.open(context))


__all__ = [
    "WandbLogExporter",
    "WandbMetricExporter",
    "WandbSession",
    "WandbSpanExporter",
    "open_tracker",
]
