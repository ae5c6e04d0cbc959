"""Console sink: verl's line format, one line per log() call.

``step:{step} - key:value - ...`` with only number values, each formatted as ``pprint.pformat``
does (so ``0.1``, ``True``, ``nan``, ``np.float32(1.1)``), in the order the caller logged them;
numbers and the step as the caller gave them (``values.as_logged``), as the reference printed them.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from otel_tracking.exporters._base import StepMetricExporter, StepRecord


def format_line(record: StepRecord) -> str:
    # pprint.pformat of an int, float, bool or numpy scalar is its repr; repr directly is ~10x cheaper.
    step = record.step if record.step_as_logged is None else record.step_as_logged
    parts = [f"step:{step}"]
    logged = record.as_logged
    if logged:  # numpy scalars as the caller gave them, as the reference printed them
        parts.extend(f"{key}:{logged.get(key, value)!r}" for key, value in record.scalars.items())
    else:
        parts.extend(f"{key}:{value!r}" for key, value in record.scalars.items())
    return " - ".join(parts)


class ConsoleMetricExporter(StepMetricExporter):
    def __init__(self, out: TextIO | None = None) -> None:
        super().__init__()
        self._out = out
        self._lock = threading.Lock()  # one whole line per log() call, whichever thread logs

    def write(self, record: StepRecord) -> None:
        line = format_line(record) + "\n"
        out = self._out or sys.stdout  # resolved per call so pytest's capsys and redirects work
        with self._lock:
            out.write(line)
            out.flush()

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        return None
