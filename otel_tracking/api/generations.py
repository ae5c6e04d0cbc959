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
    project_name: str | None = None
    experiment_name: str | None = None

    def log(self, loggers: Iterable[str] | str, samples: Sequence[Sequence[Any]], step: int) -> None:
        rows = [
            [_plain(part) for part in sample] if isinstance(sample, (list, tuple)) else [_plain(sample)]
            for sample in samples
        ]
        _emit(GENERATIONS_EVENT, "val/generations", loggers, step, {"samples": rows})


@dataclasses.dataclass
class DapoFilteredRewardTableLogger:
    """One row per step of ``reward:count`` pairs (wandb only, as in the reference)."""

    project_name: str | None = None
    experiment_name: str | None = None

    def log(self, loggers: Iterable[str] | str, reward_counts: dict[Any, Any], step: int) -> None:
        row = {float(value): int(count) for value, count in reward_counts.items()}
        counts_text = ", ".join(f"{value:g}:{row[value]}" for value in sorted(row))
        body = {
            "columns": ["step", "reward_counts"],
            "row": [to_step(step), counts_text],
            "reward_counts": {f"{value:g}": count for value, count in sorted(row.items())},
        }
        _emit(REWARD_TABLE_EVENT, "training/filter_groups/filtered_reward_counts", loggers, step, body)
