"""Step anatomy: where each step of the driver went, as numbers the trackers show at that step.

The driver's step is one trace (``step_roots.py``).  While it runs, :class:`StepAnatomy` keeps
what it needs of that trace: each driver phase's name and interval (``trace_state``, verl's
``marked_timer``), and each *call* a phase handed to a rank: a verl worker-group call per rank
(``verl/returns.py`` stamps when each rank's result was ready, on the driver's clock, so no two
hosts' clocks are compared) or a lane span inside a phase (``trace_state(..., state_lane_id=n)``),
summed as each ends (:class:`_Calls`).  When the step is over, :meth:`StepAnatomy.step_ended`
turns them into:

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

import bisect
import heapq
import re
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
    """The phases and calls of each step in progress, by the trace id of its root; then its numbers.

    Each call is summed into its step's :class:`_Calls` as it ends, on the thread that sees it end
    (the returns watcher, a lane's thread), so that measuring a step on the training loop's path
    costs per phase and role, not per rank."""

    FORGOTTEN = 1024  # how many measured traces are remembered, so that their late phases are dropped

    def __init__(self, buckets: Mapping[str, str] | None = None) -> None:
        self.buckets = {**DEFAULT_BUCKETS, **(buckets or {})}
        self._lock = threading.Lock()
        self._phases: dict[int, list[Phase]] = {}
        self._calls: dict[int, _Calls] = {}
        # Traces measured already (a phase still open when its step was measured ends later): what
        # they are told afterwards is dropped, not kept for ever.
        self._measured: dict[int, None] = {}
        # The calls of steps measured, freed by the next thread that tells of a call: freeing a
        # step's calls costs per call (milliseconds at 1,024 ranks), not the training loop's to pay.
        self._spent: list[_Calls] = []

    def phase_ended(self, trace_id: int, phase: Phase) -> None:
        with self._lock:
            if trace_id not in self._measured:
                self._phases.setdefault(trace_id, []).append(phase)

    def call_ended(self, trace_id: int, call: Call) -> None:
        with self._lock:
            spent, self._spent = self._spent, []
            if trace_id not in self._measured:
                calls = self._calls.get(trace_id)
                if calls is None:
                    calls = self._calls[trace_id] = _Calls()
                calls.add(call)
        del spent  # here, outside the lock

    def step_ended(self, step: int | None, traces: Iterable[StepTrace]) -> Anatomy | None:
        """The numbers of the step whose roots are ``traces``; None for a step with no phase, or
        never logged (``step`` None)."""
        traces = list(traces)
        # The calls still out first (verl/returns.py): those that ended were told already
        late = [call for trace in traces for source in _sources for call in source(trace.trace_id)]
        phases: list[Phase] = []
        calls = _Calls()
        with self._lock:
            for trace in traces:
                phases += self._phases.pop(trace.trace_id, [])
                calls = calls.merged(self._calls.pop(trace.trace_id, None))
                self._measured[trace.trace_id] = None
            while len(self._measured) > self.FORGOTTEN:
                del self._measured[next(iter(self._measured))]
        for call in late:
            calls.add(call)
        try:
            if step is None or not phases or not traces:
                return None
            start_ns, end_ns = min(t.start_ns for t in traces), max(t.end_ns for t in traces)
            if any(t.first for t in traces):  # the run's set-up before the first phase belongs to no step
                start_ns = max(start_ns, min(p.start_ns for p in phases))
            if end_ns <= start_ns:
                return None
            return _step_numbers(step, start_ns, end_ns, phases, calls, self.buckets)
        finally:
            with self._lock:
                if calls.count:
                    self._spent.append(calls)
                spent = self._spent[:-2] if len(self._spent) > 2 else []  # nobody else told of a call
                del self._spent[: len(spent)]
            del spent


def measure(
    step: int, start_ns: int, end_ns: int, phases: list[Phase], calls: list[Call], buckets: Mapping[str, str]
) -> Anatomy:
    """The numbers of a step from ``start_ns`` to ``end_ns`` with these phases and calls."""
    summed = _Calls()
    for call in calls:
        summed.add(call)
    return _step_numbers(step, start_ns, end_ns, phases, summed, buckets)


def _step_numbers(
    step: int, start_ns: int, end_ns: int, phases: list[Phase], calls: _Calls, buckets: Mapping[str, str]
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
    calls.measure_into(anatomy, start_ns, end_ns)
    return anatomy


_Key = tuple[str | None, int | str]  # (role, rank): a rank of a worker role, or a lane (role None)
_Span = tuple[int, int, int]  # (start ns, end ns, the call's number in its step): one call's interval


class _Calls:
    """One step's calls, summed as they end: each rank's busy time (the union of its calls'
    intervals) per role and per phase, and per phase the ranks in busy order (for the straggler
    and the median).  Adding a call costs per call of that rank, not per rank.

    A call is counted as far as it lies inside the step's interval, known only when the step is
    measured: the calls that stick out of it are found then (two heaps, by end and by start) and
    only their ranks are counted again."""

    def __init__(self) -> None:
        self.count = 0
        self.spans: dict[_Key, list[_Span]] = {}  # each rank's calls, all phases
        self.busy: dict[_Key, int] = {}  # the union's length, not clipped to the step
        self.role_busy: dict[str, int] = {}  # summed over the role's ranks
        self.role_keys: dict[str, int] = {}  # how many ranks of the role were called
        self.role_ranks: dict[str, dict[int, int]] = {}  # the role's size, as each call says it -> calls
        self.phases: dict[str, _PhaseCalls] = {}
        self.calls: list[tuple[Call, _Key]] = []  # by number
        self.latest: list[tuple[int, int]] = []  # heap of (-end, number)
        self.earliest: list[tuple[int, int]] = []  # heap of (start, number)

    def add(self, call: Call) -> None:
        if call.end_ns <= call.start_ns:
            return  # no time in any step
        number, key = self.count, (call.role, call.rank)
        self.count += 1
        self.calls.append((call, key))
        heapq.heappush(self.latest, (-call.end_ns, number))
        heapq.heappush(self.earliest, (call.start_ns, number))
        spans = self.spans.setdefault(key, [])
        if not spans and call.role is not None:
            self.role_keys[call.role] = self.role_keys.get(call.role, 0) + 1
        spans.append((call.start_ns, call.end_ns, number))
        busy = _covered(spans)
        if call.role is not None:
            self.role_busy[call.role] = self.role_busy.get(call.role, 0) + busy - self.busy.get(key, 0)
            sizes = self.role_ranks.setdefault(call.role, {})
            sizes[call.ranks] = sizes.get(call.ranks, 0) + 1
        self.busy[key] = busy
        phase = self.phases.get(call.phase)
        if phase is None:
            phase = self.phases[call.phase] = _PhaseCalls()
        phase.add(key, (call.start_ns, call.end_ns, number))

    def merged(self, other: _Calls | None) -> _Calls:
        """These calls and ``other``'s (a step with two roots), in that order."""
        if other is None:
            return self
        if not self.count:
            return other
        for call, _ in other.calls:
            self.add(call)
        return self

    def measure_into(self, anatomy: Anatomy, start_ns: int, end_ns: int) -> None:
        """Busy shares and stragglers of the calls, each clipped to ``start_ns``..``end_ns``."""
        wall_ns = end_ns - start_ns
        out = set()  # the calls that stick out of the step
        while self.latest and -self.latest[0][0] > end_ns:
            out.add(heapq.heappop(self.latest)[1])
        while self.earliest and self.earliest[0][0] < start_ns:
            out.add(heapq.heappop(self.earliest)[1])
        role_busy, role_keys = dict(self.role_busy), dict(self.role_keys)
        sizes = {role: dict(counts) for role, counts in self.role_ranks.items()}
        # Per phase and rank, its calls that stick out: only the time they spend outside is taken off
        sticking: dict[str, dict[_Key, list[_Span]]] = {}
        by_rank: dict[_Key, list[_Span]] = {}
        for number in out:
            call, key = self.calls[number]
            span = (call.start_ns, call.end_ns, number)
            sticking.setdefault(call.phase, {}).setdefault(key, []).append(span)
            by_rank.setdefault(key, []).append(span)
            if call.role is not None and min(call.end_ns, end_ns) <= max(call.start_ns, start_ns):
                sizes[call.role][call.ranks] -= 1  # wholly outside: its size says nothing
        for key, spans in by_rank.items():
            role = key[0]
            if role is not None:
                outside = _outside(spans, start_ns, end_ns)
                role_busy[role] -= outside
                if outside == self.busy[key]:  # no time inside: not a rank called in the step
                    role_keys[role] -= 1
        for role, counts in sizes.items():
            said = [size for size, calls in counts.items() if calls > 0]
            if said:
                anatomy.busy[role] = role_busy[role] / max(max(said), role_keys[role]) / wall_ns
        for name, phase in self.phases.items():
            found = phase.straggler(sticking.get(name, {}), start_ns, end_ns)
            if found is not None:
                number, lag_ns = found
                anatomy.stragglers[name] = (self.calls[number][1][1], lag_ns / 1e9)


class _PhaseCalls:
    """The calls one phase handed out, per rank, and its ranks ordered by busy time: entries
    ``(busy ns, str(rank), -number of its first call)``, so that the last is the rank busy longest
    (ties: the higher rank as text, then the rank called first)."""

    def __init__(self) -> None:
        self.spans: dict[_Key, list[_Span]] = {}
        self.entry: dict[_Key, tuple[int, str, int]] = {}
        self.order: list[tuple[int, str, int]] = []

    def add(self, key: _Key, span: _Span) -> None:
        spans = self.spans.setdefault(key, [])
        spans.append(span)
        old = self.entry.get(key)
        if old is not None:
            del self.order[bisect.bisect_left(self.order, old)]
        first = old[2] if old is not None else -span[2]
        self.entry[key] = entry = (_covered(spans), str(key[1]), first)
        bisect.insort(self.order, entry)

    def straggler(self, sticking: dict[_Key, list[_Span]], start_ns: int, end_ns: int) -> tuple[int, float] | None:
        """(the number of a call of the rank busy longest, how much longer than the median in ns),
        the ranks' calls in ``sticking`` counted inside ``start_ns``..``end_ns`` only; None for
        fewer than two ranks.  Changes the order: once per step."""
        order = self.order
        for key, spans in sticking.items():
            busy, rank, first = self.entry[key]
            del order[bisect.bisect_left(order, (busy, rank, first))]
            busy -= _outside(spans, start_ns, end_ns)
            if busy <= 0:
                continue
            if any(n == -first and min(hi, end_ns) <= max(lo, start_ns) for lo, hi, n in spans):
                first = -_first_inside(self.spans[key], start_ns, end_ns)  # its first call: wholly outside
            bisect.insort(order, (busy, rank, first))
        if len(order) < 2:
            return None
        half = len(order) // 2
        median = order[half][0] if len(order) % 2 else (order[half - 1][0] + order[half][0]) / 2
        return -order[-1][2], order[-1][0] - median


def _outside(spans: list[_Span], start_ns: int, end_ns: int) -> int:
    """How long ``spans`` cover outside ``start_ns``..``end_ns``."""
    if len(spans) == 1:  # most ranks: one call sticking out
        lo, hi, _ = spans[0]
        return max(0, hi - max(lo, end_ns)) + max(0, min(hi, start_ns) - lo)
    after = [(max(lo, end_ns), hi, n) for lo, hi, n in spans if hi > end_ns]
    before = [(lo, min(hi, start_ns), n) for lo, hi, n in spans if lo < start_ns]
    return _covered(after) + _covered(before)


def _first_inside(spans: list[_Span], start_ns: int, end_ns: int) -> int:
    """The number of the first of ``spans`` with time inside ``start_ns``..``end_ns``."""
    return min(n for lo, hi, n in spans if min(hi, end_ns) > max(lo, start_ns))


def _covered(spans: Iterable[tuple[int, int, int]]) -> int:
    """How long the union of the intervals lasts (a rank's overlapping calls count once)."""
    total, reach = 0, None
    for lo, hi, _ in sorted(spans):
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
