"""The carriers of instrumented calls, made once per context and read once per carrier
(``otel_tracking/verl/carriers.py``): reused only where that cannot change what a call carries.
Light: no verl, runs in any venv."""

from __future__ import annotations

from pathlib import Path

from opentelemetry import trace

from otel_tracking import Tracking, trace_state
from otel_tracking.signals.carrier import step_from
from otel_tracking.verl.carriers import context_of, current_carrier


def named_span(carrier: dict[str, str]) -> str:
    return format(trace.get_current_span(context_of(carrier)).get_span_context().span_id, "016x")


def test_one_carrier_per_phase_and_each_names_its_own(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend=[])
    try:
        with trace_state("gen") as gen:
            first = current_carrier()
            assert current_carrier() is first  # the same context: made once
            assert named_span(first) == format(gen.get_span_context().span_id, "016x")
            with trace_state("inner") as inner:
                assert named_span(current_carrier()) == format(inner.get_span_context().span_id, "016x")
            assert current_carrier() == first  # back in gen (made again: one context is kept)
        with trace_state("update_actor") as update:
            assert named_span(current_carrier()) == format(update.get_span_context().span_id, "016x")
    finally:
        tracking.finish()


def test_outside_any_span_the_carrier_follows_the_steps(isolated: Path) -> None:
    """There it names the step's root, which changes with every ``log()`` while the current
    context does not: never reused."""
    tracking = Tracking("proj", "exp", default_backend=[])
    try:
        tracking.log({"loss": 1.0}, step=1)
        step2 = current_carrier()
        tracking.log({"loss": 0.5}, step=2)
        step3 = current_carrier()
        assert (step_from(context_of(step2)), step_from(context_of(step3))) == (2, 3)
        assert named_span(step2) != named_span(step3)
    finally:
        tracking.finish()


def test_each_distinct_carrier_is_read_once(isolated: Path) -> None:
    tracking = Tracking("proj", "exp", default_backend=[])
    try:
        with trace_state("a"):
            a = dict(current_carrier())
        with trace_state("b"):
            b = dict(current_carrier())
        assert context_of(a) is context_of(dict(a))  # read once, by its contents
        assert named_span(a) != named_span(b)
        assert context_of(b) is not context_of(a)
    finally:
        tracking.finish()
