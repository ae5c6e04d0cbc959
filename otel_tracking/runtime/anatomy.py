"""Step anatomy: where each step of the driver went, as numbers the trackers show at that step.

The driver's step is one trace (``step_roots.py``).  While it runs, :class:`StepAnatomy` keeps
what it needs of that trace: each driver phase's name and interval (``trace_state``, verl's
``marked_timer``), and each *call* a phase handed to a rank: a verl worker-group call per rank
(``verl/waiting.py`` stamps when each rank's result was ready, on the driver's clock, so no two
hosts' clocks are compared) or a lane span inside a phase (``trace_state(..., state_lane_id=n)``).
When the step's root ends, :meth:`StepAnatomy.step_ended` turns them into:

* ``anatomy/goodput``: the productive share of the step's wall time, and ``anatomy/overhead_frac``,
  ``anatomy/wasted_frac``, ``anatomy/idle_frac`` (the four add up to 1).  Each instant of the step
  counts once, for the best bucket of the phases running then (productive over wasted over
  overhead); an instant in no phase (or only in an *enclosing* one such as verl's ``step``) is
  idle.  A phase's bucket comes from :data:`DEFAULT_BUCKETS`, then ``OTEL_TRACKING_ANATOMY_BUCKETS``
  (``name=bucket,...``); a phase not named there is overhead (goodput never overstates), and a
  phase that raised is wasted (its result was dropped);
* ``anatomy/<role>/busy_frac``: per worker role, the mean over its ranks of the share of the step
  that rank spent in calls;
* ``anatomy/<phase>/straggler_rank`` and ``anatomy/<phase>/straggler_lag_s``: for a phase that
  handed work to several ranks (or lanes), the one busy longest in it, and by how much longer than
  the median.

Measured by default where verl's ``marked_timer`` phases are instrumented (``OTEL_TRACKING_VERL``
and the other switches), elsewhere with ``OTEL_TRACKING_ANATOMY=1`` (``0`` turns it off): the
numbers go to the trackers as values of the step, before the next step's (``run.py`` measures a
step once it is over, over all of its roots), and to the file sink's events file as an
``ml.step.anatomy`` record (its metrics file and the console keep verl's one line per ``log()``).
Phase and role names in keys are scrubbed; a lane named as text counts as the rank it ends with.
The step's wall time runs from the root's start (the previous step's ``log()``) to its end; the
first step starts at its first phase instead, so the run's set-up counts for no step.
"""

from __future__ import annotations

import re
import statistics
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.signals import semconv
from otel_tracking.signals.redact import scrub_value
from otel_tracking.signals.semconv import ENCLOSING, IDLE, OVERHEAD, PRODUCTIVE, WASTED
from otel_tracking.signals.steps import labelled_gauge

# verl 0.9's marked_timer names (ray_trainer.py and the async recipes) and the demo's phases.
DEFAULT_BUCKETS: dict[str, str] = {
    **dict.fromkeys(("gen", "generate_async", "reward", "update_actor", "update_critic"), PRODUCTIVE),
    **dict.fromkeys(("rollout", "update"), PRODUCTIVE),  # the demo's
    **dict.fromkeys(
        (
            "old_log_prob",
            "ref",
            "values",
            "adv",
            "save_checkpoint",
            "update_weights",
            "sync_rollout_weights",
            "switch_to_rollout",
            "switch_to_trainer",
            "testing",
            "validate",
            "dump_rollout_generations",
            "start_profile",
            "stop_profile",
        ),
        OVERHEAD,
    ),
    **dict.fromkeys(("wait_for_enough_samples", "switch_wait"), IDLE),
    "step": ENCLOSING,
}
_RANKED = {PRODUCTIVE: 3, WASTED: 2, OVERHEAD: 1, IDLE: 0}  # which bucket an instant counts for


@dataclass(frozen=True)
class Phase:
    name: str
    start_ns: int
    end_ns: int
    failed: bool = False


@dataclass(frozen=True)
class Call:
    """Work a phase handed to one rank (a worker-group call) or lane (a lane span)."""

    phase: str  # the name of the driver span it was handed out under
    rank: int | str
    start_ns: int
    end_ns: int
    role: str | None = None  # a worker role (actor, rollout, ...); None for a lane of the driver
    ranks: int = 0  # how many ranks the role has (those not called were idle)


@dataclass
class Anatomy:
    step: int
    wall_s: float
    shares: dict[str, float]  # bucket -> share of the wall time (productive, overhead, wasted, idle)
    busy: dict[str, float] = field(default_factory=dict)  # role -> mean busy share of its ranks
    stragglers: dict[str, tuple[int | str, float]] = field(default_factory=dict)  # phase -> (rank, lag s)

    def metrics(self) -> dict[str, float]:
        """The tracker keys, one value each at the step."""
        found = {
            "anatomy/goodput": self.shares[PRODUCTIVE],
            "anatomy/overhead_frac": self.shares[OVERHEAD],
            "anatomy/wasted_frac": self.shares[WASTED],
            "anatomy/idle_frac": self.shares[IDLE],
            "anatomy/step_s": self.wall_s,
        }
        # Phase and role names are the user's (a URL with a password in a phase name): scrubbed
        # as the span names are, so the keys match the trace and carry no secret.
        for role, busy in sorted(self.busy.items()):
            found[f"anatomy/{scrub_value(role)}/busy_frac"] = busy
        for phase, (rank, lag_s) in sorted(self.stragglers.items()):
            number = lane_number(rank)
            if number is not None:
                found[f"anatomy/{scrub_value(phase)}/straggler_rank"] = number
            found[f"anatomy/{scrub_value(phase)}/straggler_lag_s"] = lag_s
        return {key: round(value, 6) if isinstance(value, float) else value for key, value in found.items()}


_TRAILING_NUMBER = re.compile(r"(\d+)$")


def lane_number(lane: int | str) -> int | None:
    """The rank a lane stands for: the lane itself when it is a number, else the number a lane
    named as text ends with (``"worker_3"``, ``"replica-12"``: 3, 12); None for a lane with none."""
    if isinstance(lane, int):
        return lane
    found = _TRAILING_NUMBER.search(lane)
    return int(found.group(1)) if found else None


_by_default = False  # measured without OTEL_TRACKING_ANATOMY: verl's phases are instrumented here


def measure_by_default() -> None:
    """verl's ``marked_timer`` phases open spans in this process (``verl/timers.py``): a run measures
    its steps unless ``OTEL_TRACKING_ANATOMY=0``."""
    global _by_default
    _by_default = True


def measured(setting: bool | None) -> bool:
    """Whether a driver run measures its steps, given ``OTEL_TRACKING_ANATOMY`` (None: unset)."""
    return _by_default if setting is None else setting


# Where worker-group calls come from (verl/waiting.py adds one): given a step's trace id, the calls
# handed out under it, and forgotten there.
CallSource = Callable[[int], Iterable[Call]]
_sources: list[CallSource] = []


def add_call_source(source: CallSource) -> None:
    if source not in _sources:
        _sources.append(source)


@dataclass(frozen=True)
class StepTrace:
    """One trace of a step (``step_roots.py``): a step logged again after a phase that began after
    its first ``log()`` has two (the second merged into the first, or a root of its own), its
    phases told by each trace's id, and one anatomy covering both."""

    trace_id: int
    start_ns: int
    end_ns: int
    first: bool = False  # the run's first root: its set-up before the first phase counts for no step


class StepAnatomy:
    """The phases and calls of each step in progress, by the trace id of its root; then its numbers."""

    FORGOTTEN = 1024  # how many measured traces are remembered, so that their late phases are dropped

    def __init__(self, buckets: Mapping[str, str] | None = None) -> None:
        self.buckets = {**DEFAULT_BUCKETS, **(buckets or {})}
        self._lock = threading.Lock()
        self._phases: dict[int, list[Phase]] = {}
        self._calls: dict[int, list[Call]] = {}
        # Traces measured already (a phase still open when its step was measured ends later): what
        # they are told afterwards is dropped, not kept for ever.
        self._measured: dict[int, None] = {}

    def phase_ended(self, trace_id: int, phase: Phase) -> None:
        with self._lock:
            if trace_id not in self._measured:
                self._phases.setdefault(trace_id, []).append(phase)

    def call_ended(self, trace_id: int, call: Call) -> None:
        with self._lock:
            if trace_id not in self._measured:
                self._calls.setdefault(trace_id, []).append(call)

    def step_ended(self, step: int | None, traces: Iterable[StepTrace]) -> Anatomy | None:
        """The numbers of the step whose roots are ``traces``; None for a step with no phase, or
        never logged (``step`` None)."""
        traces = list(traces)
        phases: list[Phase] = []
        calls: list[Call] = []
        with self._lock:
            for trace in traces:
                phases += self._phases.pop(trace.trace_id, [])
                calls += self._calls.pop(trace.trace_id, [])
                self._measured[trace.trace_id] = None
            while len(self._measured) > self.FORGOTTEN:
                del self._measured[next(iter(self._measured))]
        for trace in traces:
            for source in _sources:
                calls.extend(source(trace.trace_id))
        if step is None or not phases or not traces:
            return None
        start_ns, end_ns = min(t.start_ns for t in traces), max(t.end_ns for t in traces)
        if any(t.first for t in traces):  # the run's set-up before the first phase belongs to no step
            start_ns = max(start_ns, min(p.start_ns for p in phases))
        if end_ns <= start_ns:
            return None
        return measure(step, start_ns, end_ns, phases, calls, self.buckets)


def measure(
    step: int, start_ns: int, end_ns: int, phases: list[Phase], calls: list[Call], buckets: Mapping[str, str]
) -> Anatomy:
    wall_ns = end_ns - start_ns
    shares = {bucket: 0.0 for bucket in (PRODUCTIVE, OVERHEAD, WASTED, IDLE)}
    # Sweep the phases' edges: between two edges, the instant counts for the best bucket open.
    edges: list[tuple[int, int, str]] = []
    for phase in phases:
        bucket = WASTED if phase.failed else buckets.get(phase.name, OVERHEAD)
        if bucket == ENCLOSING:
            continue
        lo, hi = max(phase.start_ns, start_ns), min(phase.end_ns, end_ns)
        if hi > lo:
            edges += [(lo, 1, bucket), (hi, -1, bucket)]
    edges.sort(key=lambda e: (e[0], e[1]))
    open_count = dict.fromkeys(_RANKED, 0)
    at = start_ns
    for time_ns, delta, bucket in edges:
        if time_ns > at:
            best = max((b for b, n in open_count.items() if n > 0), key=_RANKED.__getitem__, default=IDLE)
            shares[best] += time_ns - at
            at = time_ns
        open_count[bucket] += delta
    shares[IDLE] += end_ns - at
    anatomy = Anatomy(step, wall_ns / 1e9, {b: ns / wall_ns for b, ns in shares.items()})

    busy_ns: dict[tuple[str | None, int | str], list[tuple[int, int]]] = {}
    size: dict[str, int] = {}
    by_phase: dict[str, dict[tuple[str | None, int | str], list[tuple[int, int]]]] = {}
    for call in calls:
        lo, hi = max(call.start_ns, start_ns), min(call.end_ns, end_ns)
        if hi <= lo:
            continue
        key = (call.role, call.rank)
        busy_ns.setdefault(key, []).append((lo, hi))
        by_phase.setdefault(call.phase, {}).setdefault(key, []).append((lo, hi))
        if call.role is not None:
            size[call.role] = max(size.get(call.role, 0), call.ranks)
    for role in size:
        ranks = {key: _covered(spans) for key, spans in busy_ns.items() if key[0] == role}
        count = max(size[role], len(ranks))
        anatomy.busy[role] = sum(ranks.values()) / count / wall_ns
    for phase_name, per_rank in by_phase.items():
        if len(per_rank) < 2:
            continue
        took = {key: _covered(spans) for key, spans in per_rank.items()}
        (_, rank), longest = max(took.items(), key=lambda item: (item[1], str(item[0][1])))
        anatomy.stragglers[phase_name] = (rank, (longest - statistics.median(took.values())) / 1e9)
    return anatomy


def _covered(spans: list[tuple[int, int]]) -> int:
    """How long the union of the intervals lasts (a rank's overlapping calls count once)."""
    total, reach = 0, None
    for lo, hi in sorted(spans):
        if reach is None or lo > reach:
            total += hi - lo
            reach = hi
        elif hi > reach:
            total += hi - reach
            reach = hi
    return total


def gauges(anatomy: Anatomy, time_ns: int) -> list[Any]:
    """The same numbers as OTLP gauges, one name each, the phase or role as an attribute."""
    found = [  # goodput is the share of the bucket "productive"
        labelled_gauge(
            "ml.step.share", "1", "share of the step's wall time per bucket", semconv.BUCKET, anatomy.shares, time_ns
        )
    ]
    if anatomy.busy:
        busy = {scrub_value(role): share for role, share in anatomy.busy.items()}
        found.append(
            labelled_gauge("ml.role.busy", "1", "mean busy share of the role's ranks", semconv.ROLE, busy, time_ns)
        )
    if anatomy.stragglers:
        numbers = {scrub_value(p): lane_number(r) for p, (r, _) in anatomy.stragglers.items()}
        ranks = {p: float(n) for p, n in numbers.items() if n is not None}
        lags = {scrub_value(p): lag for p, (_, lag) in anatomy.stragglers.items()}
        if ranks:
            found.append(
                labelled_gauge("ml.phase.straggler_rank", "1", "the rank busy longest", semconv.PHASE, ranks, time_ns)
            )
        found.append(
            labelled_gauge(
                "ml.phase.straggler_lag", "s", "how much longer than the median rank", semconv.PHASE, lags, time_ns
            )
        )
    return found
