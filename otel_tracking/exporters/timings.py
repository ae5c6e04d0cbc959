"""Phase spans as tracker timings: one value per key and step (``timing_s/state/<name>``), however
many lanes ran the phase; each lane's own duration stays in its span."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.signals.semconv import CONTINUES, STEP_SPAN_NAME
from otel_tracking.signals.semconv import STEP as STEP_ATTRIBUTE


def span_duration_s(span: Any) -> float:
    if span.end_time is None or span.start_time is None:
        return 0.0
    return (span.end_time - span.start_time) / 1e9


TIMING_PREFIX = "timing_s/state/"
SLOWEST_SUFFIX = "/slowest"


def span_step(span: Any, fallback_step: int) -> int:
    """The step a span belongs to: its ``ml.step`` attribute (the step in progress when it
    started), else ``fallback_step``."""
    raw = (span.attributes or {}).get(STEP_ATTRIBUTE)
    return int(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else fallback_step


@dataclass
class PhaseTiming:
    """The spans of one name within one step, as one timing value: what a tracker shows for a
    phase that several lanes (rollout workers, ranks) ran at once."""

    step: int
    name: str
    first_start_ns: int
    last_end_ns: int
    slowest_s: float
    span_ids: set[int] = field(default_factory=set)  # a retried export folds the same spans in again: no change
    traces: set[int] = field(default_factory=set)  # the trace ids of its spans

    @property
    def wall_s(self) -> float:
        """From the first span's start to the last one's end: how long the step spent in the phase."""
        return max(0, self.last_end_ns - self.first_start_ns) / 1e9

    def scalars(self) -> dict[str, float]:
        """``timing_s/state/<name>``: the phase's wall time; with several spans (lanes) also
        ``timing_s/state/<name>/slowest``: the longest single span."""
        values = {TIMING_PREFIX + self.name: self.wall_s}
        if len(self.span_ids) > 1:
            values[TIMING_PREFIX + self.name + SLOWEST_SUFFIX] = self.slowest_s
        return values

    def add(self, span_id: int, start_ns: int, end_ns: int) -> None:
        self.merge(PhaseTiming(self.step, self.name, start_ns, end_ns, (end_ns - start_ns) / 1e9, {span_id}))

    def merge(self, other: PhaseTiming) -> None:
        self.first_start_ns = min(self.first_start_ns, other.first_start_ns)
        self.last_end_ns = max(self.last_end_ns, other.last_end_ns)
        self.slowest_s = max(self.slowest_s, other.slowest_s)
        self.span_ids |= other.span_ids
        self.traces |= other.traces


class StepTimings:
    """Folds finished phase spans into one :class:`PhaseTiming` per (step, span name), and hands
    each back once its step is over, so that a tracker gets one value per key and step (four
    lanes' ``generate`` spans are one ``timing_s/state/generate``; each lane's own duration stays
    in its span).  A step is over when its root span (``ml.step``) ends, when a span of a later
    step arrives, or at :meth:`drain` (flush, finish).  A span that arrives after its step was
    handed back (a rollout outliving its step) is handed back on its own at the next of those.

    A span without ``ml.step`` (the first step's phases: no step was logged yet when they
    started) takes the step of its trace's root, which ends after it and says the step its
    ``log()`` gave; until the root comes it waits (at :meth:`drain`, flush or finish, it goes to
    the fallback step: the last step written).

    A root that says ``ml.step.continues`` (the step was logged again after a phase began a root
    of its own that could not join the step's trace: ``runtime/step_roots.py``) takes its trace's
    phases, which said the next step, to its own step.

    A span folded in again (the delivery layer retries a batch the backend failed) changes
    nothing: the ids of the spans handed back are remembered for the last :attr:`REMEMBERED_STEPS`
    steps, and a held timing holds its span ids."""

    REMEMBERED_STEPS = 16

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str], PhaseTiming] = {}
        self._handed_back: dict[int, set[int]] = {}  # step -> ids of its spans already handed back
        self._waiting: dict[int, list[Any]] = {}  # trace id -> its spans without a step, until its root
        self._lock = threading.Lock()

    def add(self, spans: Sequence[Any], fallback_step: int) -> list[PhaseTiming]:
        """Fold ``spans`` in, in their order; the timings of the steps they close, in that order."""
        closed: list[PhaseTiming] = []
        with self._lock:
            for span in spans:
                context = getattr(span, "context", None)
                stepless = STEP_ATTRIBUTE not in (span.attributes or {})
                if span.name == STEP_SPAN_NAME:
                    step = span_step(span, fallback_step)
                    if context is not None and (span.attributes or {}).get(CONTINUES):
                        self._move_trace(context.trace_id, step)
                    for waiting in self._waiting.pop(context.trace_id if context is not None else 0, ()):
                        self._fold(waiting, step)
                    closed += self._take(lambda pending: pending <= step)  # noqa: B023 - used at once
                    continue
                if span.start_time is None or span.end_time is None:
                    continue
                if stepless and context is not None:
                    self._waiting.setdefault(context.trace_id, []).append(span)
                    continue
                step = span_step(span, fallback_step)
                closed += self._take(lambda pending: pending < step)  # noqa: B023 - used at once
                self._fold(span, step)
        return closed

    def _fold(self, span: Any, step: int) -> None:
        context = getattr(span, "context", None)
        span_id = context.span_id if context is not None else id(span)
        if span_id in self._handed_back.get(step, ()):
            return
        timing = self._pending.get((step, span.name))
        if timing is None:
            timing = PhaseTiming(step, span.name, span.start_time, span.end_time, 0.0)
            self._pending[(step, span.name)] = timing
        timing.add(span_id, span.start_time, span.end_time)
        if context is not None:
            timing.traces.add(context.trace_id)

    def _move_trace(self, trace_id: int, step: int) -> None:
        """The timings held for the phases of trace ``trace_id`` alone go to ``step``."""
        for key in [key for key, timing in self._pending.items() if timing.traces == {trace_id} and key[0] != step]:
            timing = self._pending.pop(key)
            timing.step = step
            held = self._pending.setdefault((step, timing.name), timing)
            if held is not timing:
                held.merge(timing)

    def hold(self, timings: Sequence[PhaseTiming]) -> None:
        """Keep ``timings`` (not written) until the next close or drain, merged with any newer spans."""
        with self._lock:
            for timing in timings:
                self._handed_back.get(timing.step, set()).difference_update(timing.span_ids)
                held = self._pending.setdefault((timing.step, timing.name), timing)
                if held is not timing:
                    held.merge(timing)

    def drain(self, fallback_step: int = 0) -> list[PhaseTiming]:
        """Every timing still held, in step order, with the spans still waiting for their root at
        ``fallback_step``."""
        with self._lock:
            for waiting in self._waiting.values():
                for span in waiting:
                    self._fold(span, fallback_step)
            self._waiting.clear()
            return self._take(lambda step: True)

    def _take(self, over: Callable[[int], bool]) -> list[PhaseTiming]:
        done = sorted((self._pending.pop(key) for key in list(self._pending) if over(key[0])), key=_in_step_order)
        for timing in done:
            self._handed_back.setdefault(timing.step, set()).update(timing.span_ids)
        for step in sorted(self._handed_back)[: -self.REMEMBERED_STEPS]:
            del self._handed_back[step]
        return done


def _in_step_order(timing: PhaseTiming) -> tuple[int, int]:
    return timing.step, timing.first_start_ns
