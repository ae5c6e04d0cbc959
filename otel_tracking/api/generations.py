"""Validation generations and tables travel as OTel log records (events).

The reference's ``ValidationGenerationsLogger`` and ``DapoFilteredRewardTableLogger`` keep their
signatures; each call emits one event on the current run.  The event's ``ml.backends`` attribute
holds the ``loggers`` names the caller passed, and an ML tracker writes the event only when its
backend is named there (as the reference did); the file sink and OTLP record every event.

Event shapes (the contract the trackers read):

``ml.validation.generations``
    attributes: ``ml.step``, ``ml.key`` = ``"val/generations"``, ``ml.backends``
    body: ``{"samples": [[input, output, score], ...]}`` (each sample as given; strings kept,
    numbers converted by the ``log()`` rules, anything else as ``str()``)
``ml.table.filtered_reward_counts``
    attributes: ``ml.step``, ``ml.key`` = ``"training/filter_groups/filtered_reward_counts"``,
    ``ml.backends``
    body: ``{"columns": ["step", "reward_counts"], "row": [step, "0:3, 1:5"],
    "reward_counts": {"0": 3, "1": 5}}``
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from otel_tracking.signals.semconv import EVENT_BACKENDS as BACKENDS_ATTRIBUTE
from otel_tracking.signals.semconv import EVENT_KEY as KEY_ATTRIBUTE
from otel_tracking.signals.semconv import GENERATIONS_EVENT, REWARD_TABLE_EVENT
from otel_tracking.signals.semconv import STEP as STEP_ATTRIBUTE
from otel_tracking.signals.values import to_number, to_step


def _plain(value: Any) -> Any:
    if isinstance(value, str) or value is None:
        return value
    number = to_number(value)
    return str(value) if number is None else number


def _backends(loggers: Iterable[str] | str) -> list[str]:
    return [loggers] if isinstance(loggers, str) else [str(name) for name in loggers]


def _emit(event: str, key: str, loggers: Iterable[str] | str, step: Any, body: dict[str, Any]) -> bool:
    from otel_tracking.runtime.run import current_run

    run = current_run()
    if run is None:
        return False
    attributes = {STEP_ATTRIBUTE: to_step(step), KEY_ATTRIBUTE: key, BACKENDS_ATTRIBUTE: _backends(loggers)}
    run.emit_event(event, body, attributes)
    return True


@dataclasses.dataclass
class ValidationGenerationsLogger:
    """Log validation generations (input, output, score) as a table in the trackers: verl's
    ``ValidationGenerationsLogger``, same signature.

    Each ``log()`` is one event on the current run: wandb, SwanLab, ClearML and Trackio show a
    table, TensorBoard and MLflow text; the file sink and OTLP (a log record) get every event.

    :param project_name: kept for verl's signature; the run's own project is used. Default ``None``.
    :param experiment_name: kept for verl's signature; the run's own is used. Default ``None``.

    Example:

    ```python
    from otel_tracking import ValidationGenerationsLogger

    samples = [("What is 2+2?", "4", 1.0), ("What is 3+3?", "5", 0.0)]
    ValidationGenerationsLogger().log(["wandb"], samples, step=10)
    ```
    """

    project_name: str | None = None
    """Kept for verl's signature."""
    experiment_name: str | None = None
    """Kept for verl's signature."""

    def log(self, loggers: Iterable[str] | str, samples: Sequence[Sequence[Any]], step: int) -> None:
        """Send ``samples`` of ``step`` to the trackers named in ``loggers`` (nothing when no run is open).

        :param loggers: the tracker names that should write the table (verl's
            ``trainer.log_val_generations`` targets), one name or a list; a tracker not named
            skips the event.
        :param samples: rows ``[input, output, score]`` (any length); strings are kept, numbers
            converted as ``log()`` converts them, anything else becomes ``str()``.
        :param step: the training step the generations belong to.
        """
        rows = [
            [_plain(part) for part in sample] if isinstance(sample, (list, tuple)) else [_plain(sample)]
            for sample in samples
        ]
        _emit(GENERATIONS_EVENT, "val/generations", loggers, step, {"samples": rows})


@dataclasses.dataclass
class DapoFilteredRewardTableLogger:
    """Log how many groups each reward value filtered out, one table row per step (DAPO's
    ``filter_groups``): verl's ``DapoFilteredRewardTableLogger``, same signature.  Written by wandb
    only, as in verl; the file sink and OTLP get every event.

    :param project_name: kept for verl's signature; the run's own project is used. Default ``None``.
    :param experiment_name: kept for verl's signature; the run's own is used. Default ``None``.

    Example:

    ```python
    from otel_tracking import DapoFilteredRewardTableLogger

    DapoFilteredRewardTableLogger().log(["wandb"], {0.0: 3, 1.0: 5}, step=10)  # row: 10, "0:3, 1:5"
    ```
    """

    project_name: str | None = None
    """Kept for verl's signature."""
    experiment_name: str | None = None
    """Kept for verl's signature."""

    def log(self, loggers: Iterable[str] | str, reward_counts: dict[Any, Any], step: int) -> None:
        """Send one row for ``step`` (nothing when no run is open).

        :param loggers: the tracker names that should write the row, one name or a list.
        :param reward_counts: ``{reward value: count}``; values become floats, counts integers.
        :param step: the training step.
        """
        row = {float(value): int(count) for value, count in reward_counts.items()}
        counts_text = ", ".join(f"{value:g}:{row[value]}" for value in sorted(row))
        body = {
            "columns": ["step", "reward_counts"],
            "row": [to_step(step), counts_text],
            "reward_counts": {f"{value:g}": count for value, count in sorted(row.items())},
        }
        _emit(REWARD_TABLE_EVENT, "training/filter_groups/filtered_reward_counts", loggers, step, body)
