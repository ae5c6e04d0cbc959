"""Weights & Biases bridge.

One wandb run per session, opened as the reference did::

    wandb.init(project=project, name=experiment, entity=$WANDB_ENTITY, config=config,
               settings=wandb.Settings(https_proxy=config["trainer"]["wandb_proxy"]) if that is set)

and written with ``run.log(data, step=step)``, ended with ``run.finish(exit_code=...)``.

* Metrics: every scalar under the caller's key, at the caller's step (NaN and +/-inf included: wandb
  stores them), plus the non-number values the reference also handed to wandb (strings, None,
  lists, dicts).  wandb ignores data logged at a step below the highest step it has seen (unless
  tensorboard is patched by sync_tensorboard); such a record is not sent.  Neither is a value wandb
  refuses (the other values of its step still go).  Both are permanent refusals, not failures:
  ``export()`` returns SUCCESS (a retry or a replay could not change them), they are counted in
  ``WandbSession.skipped``, warned about once and summed up at ``finish()``.  FAILURE means wandb
  itself failed (e.g. its run is gone): the delivery layer retries or spools that.
* Spans: each finished span becomes ``timing_s/state/<name>`` (seconds) at its ``ml.step``.
* Events: ``ml.validation.generations`` becomes the reference's ``val/generations`` table (columns
  ``step, input_1, output_1, score_1, ...``, one row per validation step) and
  ``ml.table.filtered_reward_counts`` the DAPO ``training/filter_groups/filtered_reward_counts``
  table (``step, reward_counts``).  With wandb >= 0.20 both are INCREMENTAL tables: each log adds
  only its new row (the reference re-uploaded every previous generations row at every step); the
  union of the increments is the reference's table.  Older wandb gets the full table each time.
  When the number of samples per validation step changes (the reference raised ``ValueError``
  there), a new table with the new columns starts under the same key.

``open_session`` takes the wandb-like module to drive, so the vemlp_wandb bridge (Volcengine's
``volcengine_ml_platform.wandb``) reuses all of this.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.exporters._base import BridgeContext, BridgeParts, StepMetricExporter, StepRecord, span_timing

logger = logging.getLogger("otel_tracking")

GENERATIONS_EVENT = "ml.validation.generations"
REWARD_TABLE_EVENT = "ml.table.filtered_reward_counts"
GENERATIONS_KEY = "val/generations"
REWARD_TABLE_KEY = "training/filter_groups/filtered_reward_counts"
_STEP_ATTRIBUTE = "ml.step"


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


class WandbSession:
    """One wandb run shared by a metric, a span and a log exporter.  Calls are serialized by a
    lock (spans end in any thread); no threads of its own."""

    def __init__(self, module: Any, run: Any, backend: str = "wandb", monotonic_steps: bool = True) -> None:
        self.module = module
        self.run = run
        self.backend = backend
        # The run object when init returned one (it keeps writing to *our* run even if the app
        # starts another); else the module's own log/finish, as the reference called them.
        self._target = run if run is not None and callable(getattr(run, "log", None)) else module
        self._lock = threading.RLock()
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

    # --- writing --------------------------------------------------------------------------------

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("otel-tracking: %s: " + message, self.backend, *args)

    def log(self, data: Mapping[str, Any], step: int) -> bool:
        """Hand ``data`` to wandb at ``step``.  False only when wandb failed (worth a retry); values
        it refuses for good (a step below one already logged, a value it cannot serialize) are
        counted in ``skipped`` and do not make the call fail."""
        if not data:
            return True
        with self._lock:
            if self.finished:
                return False
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
            self.high_step = step if self.high_step is None else max(self.high_step, step)
            return True

    def _drops_backwards_steps(self) -> bool:
        if not self.monotonic_steps:
            return False
        patched = getattr(self.module, "patched", None)
        return not (isinstance(patched, Mapping) and patched.get("tensorboard"))

    def log_generations(self, samples: Sequence[Any], step: int) -> bool:
        """The reference's ``_log_generations_to_wandb``: one row ``[step, in_1, out_1, score_1, ...]``."""
        with self._lock:
            columns = ["step"]
            for i in range(len(samples)):
                columns += [f"input_{i + 1}", f"output_{i + 1}", f"score_{i + 1}"]
            row: list[Any] = [step]
            for sample in samples:
                parts = list(sample) if isinstance(sample, (list, tuple)) else [sample]
                # (input, output, score): a short sample is padded with None, a long one cut to 3
                # (the reference's table raised ValueError for either).
                row += [*parts, None, None, None][:3]
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
            self._target.finish(exit_code=exit_code)

    def resume(self) -> dict[str, Any] | None:
        """What ``open_bridge`` needs (as ``context.resume``) to reattach to this run."""
        try:
            run_id = getattr(self.run, "id", None)
            project = getattr(self.run, "project", None)
            entity = getattr(self.run, "entity", None)
        except Exception:
            return None
        if not run_id:
            return None
        return {"id": str(run_id), "project": project or None, "entity": entity or None}

    def where(self) -> str:
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


def open_session(module: Any, backend: str = "wandb", monotonic_steps: bool = True, **init_kwargs: Any) -> WandbSession:
    """``module.init(**init_kwargs)`` and a session writing to the run it returned."""
    run = module.init(**init_kwargs)
    return WandbSession(module, run, backend=backend, monotonic_steps=monotonic_steps)


def resume_kwargs(context: BridgeContext) -> dict[str, Any]:
    """On replay (``context.resume`` from a spool header): reattach to the same run.  wandb still
    ignores replayed data at steps below the run's current step."""
    resume = context.resume or {}
    if not resume.get("id"):
        return {}
    kwargs: dict[str, Any] = {"id": str(resume["id"]), "resume": "allow"}
    if resume.get("project"):
        kwargs["project"] = str(resume["project"])
    if resume.get("entity"):
        kwargs["entity"] = str(resume["entity"])
    return kwargs


def open_wandb_session(context: BridgeContext) -> WandbSession:
    import wandb

    proxy = _proxy(context.config)
    settings = wandb.Settings(https_proxy=proxy) if proxy else None
    kwargs: dict[str, Any] = {
        "project": context.project,
        "name": context.experiment,
        "entity": context.env.get("WANDB_ENTITY") or None,
        "config": context.config,
        "settings": settings,
    }
    return open_session(wandb, **{**kwargs, **resume_kwargs(context)})


def bridge_parts(session: WandbSession, metric_cls: type, span_cls: type, log_cls: type) -> BridgeParts:
    return BridgeParts(
        metrics=metric_cls(session),
        spans=span_cls(session),
        logs=log_cls(session),
        finish=session.finish,
        where=session.where(),
        resume=session.resume(),
    )


def open_bridge(context: BridgeContext) -> BridgeParts:
    return bridge_parts(open_wandb_session(context), WandbMetricExporter, WandbSpanExporter, WandbLogExporter)


# --- one process-wide session for exporters built with no arguments ----------------------------


class SharedSessions:
    """The session that exporters built with no arguments (by a plain OTel SDK setup) share: opened
    from ``BridgeContext.from_env()`` by the first of them, ended when the last one shuts down."""

    def __init__(self, opener: Any) -> None:
        self._opener = opener
        self._lock = threading.Lock()
        self._session: WandbSession | None = None
        self._users = 0

    def acquire(self) -> WandbSession:
        with self._lock:
            session = self._session
            if session is None or session.finished or session.pid != os.getpid():
                session = self._session = self._opener(BridgeContext.from_env())
                self._users = 0
            self._users += 1
            return session

    def release(self, session: WandbSession) -> None:
        with self._lock:
            if session is not self._session:
                return
            self._users -= 1
            if self._users > 0:
                return
            self._session = None
        session.finish(0)


_SHARED = SharedSessions(open_wandb_session)


class _SessionUser:
    _shared: SharedSessions = _SHARED
    session: WandbSession
    _owns_session: bool = False

    def _take(self, session: WandbSession | None) -> WandbSession:
        self._owns_session = session is None
        return self._shared.acquire() if session is None else session

    def _let_go(self) -> None:
        if self._owns_session:
            self._owns_session = False
            self._shared.release(self.session)


# --- the exporters ------------------------------------------------------------------------------


class WandbMetricExporter(_SessionUser, StepMetricExporter):
    def __init__(self, session: WandbSession | None = None) -> None:
        StepMetricExporter.__init__(self)
        self.session = self._take(session)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        ok = True
        for record in self.records(metrics_data):
            ok = self._write(record) and ok
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def write(self, record: StepRecord) -> None:
        self._write(record)

    def _write(self, record: StepRecord) -> bool:
        data: dict[str, Any] = dict(record.scalars)
        for key, value in record.others.items():
            data.setdefault(key, value)
        try:
            return self.session.log(data, record.step)
        except Exception:
            logger.debug("otel-tracking: wandb metric export failed", exc_info=True)
            return False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._let_go()


class WandbSpanExporter(_SessionUser, SpanExporter):
    def __init__(self, session: WandbSession | None = None) -> None:
        self.session = self._take(session)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        fallback = self.session.high_step or 0
        by_step: dict[int, dict[str, float]] = {}
        for span in spans:
            step, key, seconds = span_timing(span, fallback)
            by_step.setdefault(step, {})[key] = seconds
        ok = True
        for step in sorted(by_step):
            try:
                ok = self.session.log(by_step[step], step) and ok
            except Exception:
                logger.debug("otel-tracking: wandb span export failed", exc_info=True)
                ok = False
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._let_go()


class WandbLogExporter(_SessionUser, LogRecordExporter):
    """Writes the two event kinds the reference wrote to wandb; other log records are ignored."""

    events: tuple[str, ...] = (GENERATIONS_EVENT, REWARD_TABLE_EVENT)

    def __init__(self, session: WandbSession | None = None) -> None:
        self.session = self._take(session)

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        ok = True
        for item in batch:
            try:
                ok = self._write(item.log_record) and ok
            except Exception:
                logger.debug("otel-tracking: wandb event export failed", exc_info=True)
                ok = False
        return LogRecordExportResult.SUCCESS if ok else LogRecordExportResult.FAILURE

    def _write(self, record: Any) -> bool:
        name = record.event_name or ""
        if name not in self.events:
            return True
        attributes = record.attributes or {}
        body = record.body if isinstance(record.body, Mapping) else {}
        raw_step = attributes.get(_STEP_ATTRIBUTE)
        step = int(raw_step) if isinstance(raw_step, (int, float)) and not isinstance(raw_step, bool) else 0
        if name == GENERATIONS_EVENT:
            return self.session.log_generations(list(body.get("samples") or []), step)
        row = list(body.get("row") or [step, ""])
        return self.session.log_reward_row(list(body.get("columns") or ["step", "reward_counts"]), row, step)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._let_go()


__all__ = [
    "WandbLogExporter",
    "WandbMetricExporter",
    "WandbSession",
    "WandbSpanExporter",
    "open_bridge",
    "open_session",
]
