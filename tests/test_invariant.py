"""The never-lose promise as an invariant, checked by a model-based test.

For a sink's worker, at every moment: handed = delivered + in flight + queued + spooled + dropped
(counted), and once it is stopped and its spool replayed, every item handed arrived, was dropped
(counted, only when the spool itself cannot be written), or both arrived and was spooled (an
export that hung past the finish deadline and then succeeded: at least once, counted once).

Hypothesis drives a real ``Sink`` + ``SinkQueue`` + ``Spool`` with injected faults: an exporter that
succeeds, fails, raises or hangs (until released), queue sizes from 1, one to three attempts,
with and without an export interval, flushes and a stop at random deadlines, a spool that can or
cannot be written.  The exporter is
the only stand-in: it is where faults are injected.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.delivery.engine import Policy
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.spool import Damaged, Spool, read_spool
from otel_tracking.exporters._base import SinkParts

_tracer = TracerProvider().get_tracer("invariant")


class FaultyExporter(SpanExporter):
    def __init__(self) -> None:
        self.mode = "ok"
        self.release = threading.Event()
        self.received: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        mode = self.mode
        if mode == "hang":
            self.release.wait(30)  # until the test releases it: then it succeeds, late
        elif mode == "fail":
            return SpanExportResult.FAILURE
        elif mode == "raise":
            raise ConnectionError("injected")
        self.received.extend(span.name for span in spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class DeliveryMachine(RuleBasedStateMachine):
    @initialize(
        queue_size=st.integers(1, 6),
        attempts=st.integers(1, 3),
        spool_writable=st.booleans(),
        interval=st.sampled_from([0.0, 0.02]),
    )
    def start(self, queue_size: int, attempts: int, spool_writable: bool, interval: float = 0.0) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="invariant-"))
        if spool_writable:
            path = self.root / "spool" / "t.jsonl"
        else:
            (self.root / "not-a-dir").write_text("")
            path = self.root / "not-a-dir" / "t.jsonl"  # mkdir fails: every spool write fails
        self.spool_writable = spool_writable
        self.exporter = FaultyExporter()
        self.sink = Sink("t", SinkParts(spans=self.exporter))
        policy = Policy(
            queue_size=queue_size,
            max_attempts=attempts,
            backoff_s=0.001,
            backoff_max_s=0.002,
            probe_interval_s=0.01,
            export_interval_s=interval,
        )
        self.sink.start(Spool(path, {"sink": "t"}), policy)
        self.queue = self.sink.queue
        assert self.queue is not None
        self.spool_path = path
        self.names: list[str] = []
        self.stopped = False

    @rule(n=st.integers(1, 4))
    def submit(self, n: int) -> None:
        for _ in range(n):
            name = f"s{len(self.names)}"
            span = _tracer.start_span(name)
            span.end()
            self.names.append(name)
            self.sink.export_spans([span])

    @rule(mode=st.sampled_from(["ok", "fail", "raise", "hang"]))
    def set_mode(self, mode: str) -> None:
        if self.exporter.mode == "hang" and mode != "hang":
            self.exporter.release.set()  # the hung export returns (late)
            self.exporter.release = threading.Event()
        self.exporter.mode = mode

    @rule(timeout=st.floats(0, 0.05))
    def flush(self, timeout: float) -> None:
        self.queue.flush(timeout)

    @precondition(lambda self: not self.stopped)
    @rule(deadline=st.floats(0, 0.1))
    def stop(self, deadline: float) -> None:
        self.sink.finish(0, timeout_s=deadline)
        self.stopped = True

    @invariant()
    def every_item_is_somewhere(self) -> None:
        ledger = self.queue.snapshot()
        assert ledger.handed == len(self.names)
        assert ledger.balanced(), ledger
        assert min(ledger.queued, ledger.in_flight, ledger.delivered, ledger.spooled, ledger.dropped) >= 0, ledger

    def teardown(self) -> None:
        try:
            if not self.stopped:
                self.sink.finish(0, timeout_s=0.05)
            self.exporter.mode = "ok"
            self.exporter.release.set()
            self.queue._thread.join(30)
            ledger = self.queue.snapshot()
            assert not self.queue._thread.is_alive()
            assert ledger.queued == ledger.in_flight == 0 and ledger.balanced(), ledger
            stats = self.sink.stats
            assert (stats.delivered, stats.spooled, stats.dropped) == (ledger.delivered, ledger.spooled, ledger.dropped)
            spooled: list[str] = []
            if self.spool_path.exists():
                _, records = read_spool(self.spool_path)
                for record in records:
                    assert not isinstance(record, Damaged), record
                    spooled.extend(span.name for span in record[1])
            assert len(spooled) == ledger.spooled
            if self.spool_writable:
                assert ledger.dropped == 0
            # After replay (the spool's items delivered), every item arrived at least once, or was
            # counted dropped (one given up while its export hung may still have arrived, late).
            arrived = Counter(self.exporter.received) + Counter(spooled)
            missing = [name for name in self.names if not arrived[name]]
            assert len(missing) <= ledger.dropped, (missing, ledger)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


TestDeliveryInvariant = DeliveryMachine.TestCase
TestDeliveryInvariant.settings = settings(
    max_examples=40,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_machine_catches_an_uncounted_loss(monkeypatch: Any) -> None:
    """The invariant can fail: a worker that forgets an item it could not deliver is caught."""
    from otel_tracking.delivery import engine as delivery

    monkeypatch.setattr(delivery, "set_aside", lambda *args, **kwargs: None)
    machine = DeliveryMachine()
    machine.start(queue_size=1, attempts=1, spool_writable=True)
    machine.set_mode("fail")
    machine.submit(2)
    machine.stop(0.05)
    try:
        machine.every_item_is_somewhere()
    except AssertionError:
        return
    finally:
        machine.exporter.release.set()
        shutil.rmtree(machine.root, ignore_errors=True)
    raise AssertionError("a lost item went unnoticed")
