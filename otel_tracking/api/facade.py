"""``Tracking``: verl's tracking facade, on OpenTelemetry.

A drop-in for ``verl.utils.tracking.Tracking``: same constructor, ``log(data, step, backend=None)``,
``finish(exit_code=0)``, ``supported_backend`` and the deprecated ``tracking`` alias.  Differences,
all deliberate:

* an unknown backend raises ``ValueError`` listing the supported names (the reference asserted);
* ``config=None`` works with every backend;
* ``with Tracking(...) as t:`` finishes on exit, with exit code 1 when the block raised (130 for
  Ctrl-C, a ``SystemExit``'s own code);
* a run that was never finished is finished once at interpreter exit, after its exporters flushed
  (also when the ``Tracking`` object was dropped: nothing is done in a garbage-collector finalizer),
  with the exit code the program ends with (130 after Ctrl-C, 1 after an uncaught exception);
* ``finish()`` returns per-sink delivery counts.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from otel_tracking.api.rl_insight import RLInsightLogger, say_where_it_goes
from otel_tracking.config.run_config import RunConfig, restart_step
from otel_tracking.config.settings import Settings, build_settings
from otel_tracking.config.traces_link import traces_link
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.registry import SUPPORTED_BACKENDS
from otel_tracking.delivery.spool import check_spool_dir
from otel_tracking.runtime.assembly import check_backends, open_run
from otel_tracking.runtime.lifecycle import exit_code_for
from otel_tracking.runtime.run import Run

logger = logging.getLogger("otel_tracking")


def _backend_names(default_backend: str | Iterable[str]) -> list[str]:
    requested = [default_backend] if isinstance(default_backend, str) else list(default_backend)
    names: list[str] = []
    for backend in requested:
        if backend == "tracking":
            warnings.warn("`tracking` logger is deprecated. use `wandb` instead.", DeprecationWarning, stacklevel=3)
            backend = "wandb"
        elif backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"{backend!r} is not a supported tracking backend; supported: {', '.join(SUPPORTED_BACKENDS)}"
            )
        if backend not in names:
            names.append(backend)
    return names


class Tracking:
    """Log experiment data to ML trackers and to OpenTelemetry at once: a drop-in for verl's
    ``verl.utils.tracking.Tracking`` (same constructor, ``log``, ``finish``, ``supported_backend``).

    One ``Tracking`` is one run.  Each ``log()`` reaches every backend named in
    ``default_backend``; with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, the run also goes over OTLP
    (metrics as gauges, ``trace_state`` phases as spans, one trace per step).  The trackers run
    in a child process, so ``log()`` costs a hand-over, never a tracker's network call.

    Example:

    ```python
    from otel_tracking import Tracking, trace_state

    with Tracking(project_name="my-project", experiment_name="run-1",
                  default_backend=["console", "file"], config={"lr": 1e-6}) as tracking:
        for step in range(1, 4):
            with trace_state("rollout"):
                reward = 0.1 * step
            tracking.log({"reward/mean": reward}, step=step)
    ```
    """

    supported_backend = list(SUPPORTED_BACKENDS)
    """The backend names ``default_backend`` accepts: ``wandb``, ``mlflow``, ``swanlab``,
    ``vemlp_wandb``, ``tensorboard``, ``console``, ``clearml``, ``trackio``, ``file``,
    ``rl_insight`` (and the deprecated ``tracking``, an alias of ``wandb``), as in verl."""

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | list[str] = "console",
        config: Any = None,
        resume: str | None = None,
    ) -> None:
        """Open the run: check every backend, then start each (the trackers in the child process).

        :param project_name: the project, in every tracker (wandb's project, MLflow's experiment,
            TensorBoard's and the file sink's directory) and as ``ml.project`` on every span.
        :param experiment_name: the run's name in every tracker, the file sink's file name, and
            ``ml.experiment``.
        :param default_backend: one backend name or a list of them (see ``supported_backend``);
            default ``"console"``.  A tracker's extra must be installed (``pip install
            'otel-tracking[wandb]'``).
        :param config: the run's configuration (a dict, an OmegaConf config or a dataclass), given
            to each tracker as its config or params, with secrets redacted; default ``None``.
        :param resume: ``"auto"``, ``"never"`` or a run id; default ``None``: the variable
            ``OTEL_TRACKING_RESUME``, else ``"never"``.  ``"auto"`` continues the previous run of
            this project and experiment in every tracker (a job restarted from a checkpoint); see
            the guide *Resuming a run*.
        :raises ValueError: a backend name that is not supported.
        :raises ConfigError: an ``OTEL_*`` variable or argument that cannot be used.
        :raises ModuleNotFoundError: a tracker whose package is not installed."""
        self._run: Run | None = None
        names = _backend_names(default_backend)
        insight = "rl_insight" in names and RLInsightLogger.enabled()
        settings = build_settings(
            str(project_name), str(experiment_name), tuple(names), force_otlp=insight, resume=resume
        )
        settings = check_spool_dir(settings)
        if insight:
            say_where_it_goes(settings)
        # Everything that can be found wrong without opening anything is found first: a failed
        # Tracking() leaves nothing open and nothing written (runtime/assembly.py).
        check_backends(settings, names)
        run_config = RunConfig.of(config)  # redacted once, for every backend
        _say_resume(settings, run_config)
        self._run = open_run(settings, names, run_config)
        # Also when the exit hook finishes a run nobody finished: the counts and the replay
        # command are printed all the same.
        self._run.on_finished = functools.partial(_after_finish, self._run)
        self.logger: dict[str, Sink] = {sink.name: sink for sink in [*self._run.sinks, *self._run.periodic_sinks]}
        """The run's sinks by backend name, as verl's ``Tracking.logger`` holds its loggers by name
        (a sink writes to its tracker; use ``log()`` rather than a sink directly)."""
        if insight:
            RLInsightLogger.attach(self._run, config)

    # --- the verl API ----------------------------------------------------------------------------

    def log(self, data: Mapping[str, Any], step: int, backend: str | Iterable[str] | None = None) -> None:
        """Log one step's values to every backend (or to those named by ``backend``).

        Returns at once: the values are handed over, and each backend gets them on its own queue
        (retried, then spooled to disk if it cannot take them).  What values are accepted (numbers,
        numpy and torch scalars; strings to the file sink) is in *What log() accepts*.

        :param data: ``{key: value}``, e.g. ``{"actor/pg_loss": 0.12, "reward/mean": 0.8}``.
        :param step: the training step, an integer (verl's ``global_steps``).  A call also closes
            the step's trace: the ``trace_state`` phases before it are that step's.
        :param backend: one backend name or several, a subset of the run's; default ``None``:
            every backend of the run.

        Example: ``tracking.log({"actor/pg_loss": loss, "critic/score/mean": score}, step=step)``
        """
        if self._run is None:
            return

        backends = None if backend is None else ([backend] if isinstance(backend, str) else list(backend))
        self._run.log(data, step, backends)

    def finish(self, exit_code: int = 0) -> dict[str, dict[str, int]]:
        """Flush and end every backend's run, once (a second call returns the same counts).

        Called at interpreter exit when you do not call it (with the exit code the program ends
        with), and by ``with Tracking(...)``.  Prints one summary line per queued sink on stderr.

        :param exit_code: the program's exit code; default ``0``.  Not 0 marks the run as failed in
            the trackers that have a run state (wandb, MLflow, SwanLab).
        :returns: per sink name, the counts ``delivered``, ``spooled`` and ``dropped`` (items: a
            ``log()`` call, a span or a log record) and ``failed`` and ``retried`` (export
            attempts), e.g. ``{"wandb": {"delivered": 3, "failed": 0, "retried": 0, "spooled": 0,
            "dropped": 0}}``.

        Example: ``counts = tracking.finish(); assert counts["wandb"]["spooled"] == 0``
        """
        if self._run is None:
            return {}
        return self._run.finish(exit_code)  # the first time, the run calls _after_finish

    # --- beyond the reference --------------------------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until what was logged so far has left the queues (delivered, or spooled); ``log()``
        itself never waits.

        :param timeout_s: how long to wait at most, in seconds; default ``30.0``.
        :returns: ``True`` when everything left the queues, ``False`` if ``timeout_s`` passed first.

        Example: ``tracking.flush(timeout_s=10)`` before a checkpoint, so the trackers show it.
        """
        return self._run.flush(timeout_s) if self._run is not None else True

    @property
    def run_id(self) -> str | None:
        """The run's id (32 hex digits; ``ml.run.id`` on every span and metric, the spool
        directory's name), or ``None`` when the run could not be opened."""
        return self._run.settings.run_id if self._run else None

    def where(self) -> dict[str, str]:
        """Where each sink writes, for humans: ``{"file": "./proj/exp.jsonl (metrics), ...",
        "otlp-traces": "OTLP http/protobuf -> http://...", ...}``; the demo prints it."""
        if self._run is None:
            return {}
        return {s.name: s.where or "" for s in [*self._run.sinks, *self._run.observability_sinks]}

    def __enter__(self) -> Tracking:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish(exit_code=exit_code_for(exc))  # Ctrl-C: 130; SystemExit: its code; an exception: 1


def _say_resume(settings: Settings, config: RunConfig) -> None:
    """One line on stderr when resuming was asked for: what was found, or that nothing was."""
    if settings.resume == "never":
        return
    where = f"{settings.project}/{settings.experiment}"
    if settings.resumed is None:
        print(
            f"otel-tracking: resume={settings.resume}: no earlier run of {where} found; starting a new run "
            f"{settings.run_id}",
            file=sys.stderr,
        )
        return
    state = "finished" if settings.resumed.previous_state == "finished" else "not finished (killed?)"
    step = restart_step(settings, config)
    if step is None:
        restart = "what it logged from this attempt's first step on is replaced"
    else:
        source = "OTEL_TRACKING_RESUME_STEP" if settings.resume_step is not None else "verl's checkpoint"
        restart = f"what it logged after step {step} ({source}) is replaced"
    print(
        f"otel-tracking: resuming run {settings.run_id} of {where}, attempt {settings.attempt} "
        f"(the previous attempt was {state}; {restart})",
        file=sys.stderr,
    )


def _after_finish(run: Run, stats: dict[str, dict[str, int]]) -> None:
    """Once, when the run has finished (``finish()``, ``with``, or the exit hook)."""
    if RLInsightLogger._run is run:
        RLInsightLogger.finish()
    _print_summary(run, stats)


def _print_summary(run: Run, stats: dict[str, dict[str, int]]) -> None:
    """One line per sink fed by a worker (file and console are written inline: nothing to report),
    on stderr, a link to the run's traces when a trace UI is configured, and where to find what
    was spooled."""
    queued = [sink.name for sink in run.all_sinks if not sink.inline]
    for name in queued:
        c = stats[name]
        print(  # items are what log() and trace_state hand over; failed and retried count export attempts
            f"otel-tracking: {name}: {c['delivered']} items delivered, {c['spooled']} spooled, {c['dropped']} dropped "
            f"(items: log() calls, spans, log records); {c['failed']} exports failed, {c['retried']} retried",
            file=sys.stderr,
        )
    settings = run.settings
    if settings.traces_url and settings.otlp.traces:
        link = traces_link(settings.traces_url, settings.service_name, settings.run_id, run.started_ns, time.time_ns())
        print(f"otel-tracking: the run's traces: {link}", file=sys.stderr)
    if any(stats[name]["spooled"] for name in queued):
        print(
            f"otel-tracking: deliver the spooled data with: otel-tracking replay {run.settings.spool_dir}",
            file=sys.stderr,
        )
