"""Spans to timing scalars (``exporters/_base.py``): one value per key per step, whatever the lanes.

Four rollout workers each end a ``generate`` span in the same step; a tracker must get one
``timing_s/state/generate`` at that step (the phase's wall time, first start to last end) and one
``timing_s/state/generate/slowest`` (the longest lane), not four values of one key.  The model
test cuts a stream of real SDK spans into arbitrary export batches, with and without the driver's
root span per step, fails writes at arbitrary points with the delivery layer's retry of the same
batch, and checks what the backend kept against a model computed from the spans.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanContext

from otel_tracking.exporters._base import Event, StepRecord, TrackerContext, TrackerSession, TrackerSpanExporter

_ids = itertools.count(1)


def span(name: str, step: int | None, start_ns: int, end_ns: int) -> ReadableSpan:
    attributes = {} if step is None else {"ml.step": step}
    context = SpanContext(trace_id=1, span_id=next(_ids), is_remote=False)
    return ReadableSpan(name=name, context=context, attributes=attributes, start_time=start_ns, end_time=end_ns)


class Recording(TrackerSession):
    """A backend that keeps every (step, key, seconds) written, and fails the writes it is told to."""

    def __init__(self, fail_calls: frozenset[int] = frozenset()) -> None:
        self.written: list[tuple[int, str, float]] = []
        self.fail_calls = fail_calls
        self.calls = 0

    @classmethod
    def open(cls, context: TrackerContext) -> Recording:
        return cls()

    def write_step(self, record: StepRecord) -> bool:
        return True

    def write_timing(self, step: int, key: str, seconds: float) -> bool:
        self.calls += 1
        if self.calls in self.fail_calls:
            return False
        self.written.append((step, key, seconds))
        return True

    def write_event(self, event: Event) -> bool:
        return True

    def finish(self, exit_code: int = 0) -> None:
        return None


def export_with_retry(exporter: TrackerSpanExporter, batch: Sequence[Any]) -> None:
    """What the delivery layer does with a FAILURE: the same batch again."""
    for _ in range(50):
        if exporter.export(batch) == SpanExportResult.SUCCESS:
            return
    raise AssertionError("never delivered")


def test_four_lanes_of_one_step_are_one_value_per_key() -> None:
    session = Recording()
    exporter = TrackerSpanExporter(session)
    ms = 1_000_000
    lanes = [span("generate", 3, start * ms, end * ms) for start, end in ((0, 40), (1, 25), (2, 70), (5, 30))]
    for lane in lanes:  # one export per span, as the facade's span processor hands them over
        exporter.export([lane])
    exporter.export([span("reward", 3, 70 * ms, 80 * ms)])
    assert session.written == []  # the step is not over yet
    exporter.export([span("ml.step", 3, 0, 90 * ms)])
    assert session.written == [
        (3, "timing_s/state/generate", 0.070),
        (3, "timing_s/state/generate/slowest", 0.068),
        (3, "timing_s/state/reward", 0.010),  # one span: no /slowest key
    ]


def test_a_later_step_closes_a_step_without_root_and_finish_flushes_the_last() -> None:
    """A plain OTel setup has no ``ml.step`` root: the next step's first span ends a step, the
    exporter's shutdown the last one."""
    session = Recording()
    exporter = TrackerSpanExporter(session)
    exporter.export([span("update", 1, 0, 10)])
    exporter.export([span("update", 1, 20, 50)])
    exporter.export([span("update", 2, 60, 70)])
    assert session.written == [(1, "timing_s/state/update", 50e-9), (1, "timing_s/state/update/slowest", 30e-9)]
    exporter.shutdown()
    assert session.written[2:] == [(2, "timing_s/state/update", 10e-9)]


def test_spans_without_a_step_count_at_the_last_step_written() -> None:
    session = Recording()
    session.last_step = 7
    exporter = TrackerSpanExporter(session)
    exporter.export([span("plain", None, 0, 5), span("plain", None, 10, 20)])
    exporter.force_flush()
    assert [(s, k) for s, k, _ in session.written] == [(7, "timing_s/state/plain"), (7, "timing_s/state/plain/slowest")]


# --- the model ------------------------------------------------------------------------------------

lane_span = st.tuples(st.integers(0, 1000), st.integers(0, 1000))  # (start offset, duration)
phase = st.tuples(st.sampled_from(["generate", "reward", "update"]), st.lists(lane_span, min_size=1, max_size=4))
step_plan = st.lists(phase, min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(step_plan, min_size=1, max_size=6),
    roots=st.booleans(),
    cuts=st.sets(st.integers(1, 80)),
    fail_calls=st.frozensets(st.integers(1, 60), max_size=6),
    shuffle=st.randoms(use_true_random=False),
)
def test_one_value_per_key_and_step_whatever_the_batches_and_failures(
    steps: list[list[tuple[str, list[tuple[int, int]]]]],
    roots: bool,
    cuts: set[int],
    fail_calls: frozenset[int],
    shuffle: Any,
) -> None:
    stream: list[ReadableSpan] = []
    model: dict[tuple[int, str], float] = {}
    for step, phases in enumerate(steps, start=1):
        base = step * 10_000
        spans_of_step = []
        for name, lanes in phases:
            for start, duration in lanes:
                spans_of_step.append(span(name, step, base + start, base + start + duration))
        shuffle.shuffle(spans_of_step)  # lanes end in any order within their step
        stream += spans_of_step
        for name in {name for name, _ in phases}:
            mine = [s for s in spans_of_step if s.name == name]
            assert mine[0].end_time is not None
            model[(step, f"timing_s/state/{name}")] = (
                max(s.end_time for s in mine) - min(s.start_time for s in mine)  # type: ignore[type-var]
            ) / 1e9
            if len(mine) > 1:
                model[(step, f"timing_s/state/{name}/slowest")] = max(s.end_time - s.start_time for s in mine) / 1e9  # type: ignore[operator]
        if roots:
            stream.append(span("ml.step", step, base, base + 5_000))
    batches = [
        stream[a:b] for a, b in itertools.pairwise([0, *sorted(c for c in cuts if c < len(stream)), len(stream)])
    ]

    session = Recording(fail_calls)
    exporter = TrackerSpanExporter(session)
    for batch in batches:
        export_with_retry(exporter, batch)
    for _ in range(50):  # the flush at the end, retried like any other export
        if exporter.force_flush():
            break

    last: dict[tuple[int, str], float] = {}
    for step, key, seconds in session.written:
        last[(step, key)] = seconds
    assert last.keys() == model.keys()  # nothing lost, no key made up
    for where, seconds in model.items():
        assert abs(last[where] - seconds) < 1e-12, where
    if not fail_calls & set(range(1, session.calls + 1)):
        # no failure: exactly one value per key and step, in step order
        assert len(session.written) == len(model)
        assert [s for s, _, _ in session.written] == sorted(s for s, _, _ in session.written)


def test_the_first_steps_phases_take_their_roots_step() -> None:
    """Before the first log() a phase carries no ml.step: it waits for its trace's root, which
    says the step (1 here, not the last step written, 0)."""
    session = Recording()
    exporter = TrackerSpanExporter(session)
    exporter.export([span("rollout", None, 0, 10)])
    exporter.export([span("rollout", None, 5, 30)])
    assert session.written == []
    exporter.export([span("ml.step", 1, 0, 40)])
    assert session.written == [(1, "timing_s/state/rollout", 30e-9), (1, "timing_s/state/rollout/slowest", 25e-9)]
