"""Never break training: faults injected into our side of every wrapper (the span, the carrier,
the context) never reach verl's code, and verl's own exceptions come out unchanged.

Model-based (hypothesis): a random program of ``marked_timer`` / ``simple_timer`` phases, nested,
some raising verl's own error, run under random faults in our layer; what verl computes
(``timing_raw``'s keys, which exception escapes) must be what uninstrumented verl computes, and
each broken place is reported once.  Runs in a process of its own (the patches are per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    r"""
    import json, logging, sys
    from hypothesis import given, settings, strategies as st, HealthCheck

    from otel_tracking.verl import install
    assert install("test") is True and install("again") is False  # idempotent

    import otel_tracking.api.spans as spans
    from verl.utils.profiler import performance
    from verl.utils.profiler.performance import marked_timer, simple_timer
    from verl.single_controller.base.decorator import Dispatch, register
    import verl.single_controller.base.decorator as decorator
    from otel_tracking.verl import timers, dispatch

    timer = performance._timer
    timers.patch(performance)  # a second application changes nothing
    assert performance._timer is timer

    reported = []
    class Catch(logging.Handler):
        def emit(self, record):
            reported.append(record.getMessage())
    logging.getLogger("otel_tracking.verl").addHandler(Catch())

    class VerlError(Exception):
        pass

    real_start, real_end = spans.trace_state._start, spans.trace_state._end

    def faulty(fault):
        def start(self):
            if fault == "open":
                raise RuntimeError("open broke")
            return real_start(self)
        def end(self, *exc):
            if fault == "close":
                raise RuntimeError("close broke")
            return real_end(self, *exc)
        return start, end

    program = st.recursive(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["marked", "simple"]), st.booleans(), st.just(())),
        lambda inner: st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["marked", "simple"]),
                                st.booleans(), st.lists(inner, max_size=3).map(tuple)),
        max_leaves=8,
    )

    def run(node, timing, use):
        name, kind, raises, children = node
        cm = (marked_timer if kind == "marked" else simple_timer)(name, timing)
        with cm:
            for child in children:
                try:
                    run(child, timing, use)
                except VerlError:
                    pass
            if raises:
                raise VerlError(name)

    def outcome(node, timer_fn):
        performance._timer = timer_fn
        timing = {}
        try:
            run(node, timing, timer_fn)
            escaped = None
        except VerlError as exc:
            escaped = str(exc)
        return sorted(timing), escaped

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(program, st.sampled_from([None, "open", "close"]))
    def same_as_verl(node, fault):
        spans.trace_state._start, spans.trace_state._end = faulty(fault)
        try:
            ours = outcome(node, timer)
            theirs = outcome(node, performance.verl_timer)
        finally:
            spans.trace_state._start, spans.trace_state._end = real_start, real_end
            performance._timer = timer
        assert ours == theirs, (node, fault, ours, theirs)

    same_as_verl()
    # Every fault was reported, once for the place (not once per span).
    assert len([m for m in reported if "marked_timer span failed" in m and "broke" in m]) == 1, reported

    # The worker side: a carrier that is not one, or a context layer that breaks, never stops a call.
    class W:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def f(self, x):
            return x + 1
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        async def g(self, x):
            return x + 2
    import asyncio, inspect
    assert "_otel_context" in inspect.signature(W.f).parameters
    assert W().f(1, _otel_context=42) == 2 and W().f(1) == 2
    assert asyncio.run(W().g(1, _otel_context={"traceparent": "garbage"})) == 3
    real_attach = dispatch._attach
    dispatch._attach = lambda *a: (_ for _ in ()).throw(RuntimeError("attach broke"))
    assert W().f(5, _otel_context={}) == 6
    dispatch._attach = real_attach
    # verl's own error from the method comes out as it is
    class E:
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def f(self):
            raise VerlError("mine")
    try:
        E().f(_otel_context={})
    except VerlError as exc:
        assert str(exc) == "mine"
    else:
        raise AssertionError("verl's error vanished")
    print("ok")
    """
)


def test_faults_in_our_layer_never_reach_verl(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_TRACKING_SPOOL_DIR=str(tmp_path / "spool"))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-5000:]
