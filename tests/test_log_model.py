"""A model-based test of the one reliability layer between ``log()`` and a tracker: the tracker's
log (``delivery/spool.py`` appends, ``delivery/reader.py`` reads from a position) under a
tracker that fails, lands part of a group, or whose reader is killed in the middle of an export,
followed by ``otel-tracking replay``'s reader on what is left.

Invariants, at every moment and at the end:
- nothing lost: every step appended is delivered, or past the log's position (counted spooled),
  or set aside in ``<log>.in-doubt`` (a replay killed with it on its way);
- the counts come from the log: delivered + spooled + dropped == appended, for the live run,
  and only what a full disk cut short is dropped (that record alone);
- at most once where promised: replay never delivers a point twice, and the live reader delivers
  a point twice only when it was killed with that point's record on its way (at least once).

The tracker is a scripted exporter (a stand-in that can fail on command); the real trackers go
through the same reader in tests/test_bridge_process.py and tests/test_link_invariant.py."""

from __future__ import annotations

import errno
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from opentelemetry.sdk.resources import Resource

from otel_tracking.config.policy import Policy
from otel_tracking.delivery import spool as spool_module
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.position import IN_DOUBT
from otel_tracking.delivery.reader import LogReader, pending_items
from otel_tracking.delivery.spool import Damaged, LogWriter, Spool, read_spool
from otel_tracking.delivery.tracker_logs import count_from_log
from otel_tracking.exporters._base import SinkParts
from otel_tracking.signals.steps import StepBatch

# A killed reader's thread ends with Killed, on purpose: pytest need not warn about each.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")

RESOURCE = Resource({})
KEYS = ("a", "b", "c")
POLICY = Policy(max_attempts=2, backoff_s=0.001, backoff_max_s=0.001, probe_interval_s=0.001)


class Killed(BaseException):
    """A kill in the middle of an export: the reader's thread ends there, as its process would."""


class ScriptedTracker:
    """A step exporter with a bulk path (like MLflow's): each call takes the next outcome of
    ``script`` ("ok", "fail", "half": the first half of the points land, "kill"), "ok" once the
    script is used up."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.down = False  # refuses everything (the run ends with records left in its log)
        self.arrived: list[tuple[str, int]] = []  # (key, step) in the order they landed
        self.lock = threading.Lock()

    def _outcome(self) -> str:
        with self.lock:
            if self.down:
                return "fail"
            return self.script.pop(0) if self.script else "ok"

    def export_records(self, records: list[Any]) -> bool:
        return self.export_many(records, lambda: None)[0] is None

    def export_many(self, records: list[Any], progress: Any) -> list[Any]:
        outcome = self._outcome()
        if outcome == "kill":
            raise Killed()
        if outcome == "fail":
            raise ConnectionError("the tracker refused")
        rests: list[Any] = []
        for record in records:
            keys = sorted(record.scalars)
            landing = keys if outcome == "ok" else keys[: len(keys) // 2]
            with self.lock:
                self.arrived.extend((key, record.step) for key in landing)
            left = {key: record.scalars[key] for key in keys if key not in landing}
            rests.append(None if not left else type(record)(record.step, left, {}, record.time_unix_nano))
            outcome = "ok" if outcome == "half" else outcome
        return rests

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True

    def shutdown(self) -> None:
        return None


class TheLog(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="log-model-"))
        self.tracker = ScriptedTracker()
        self.sink = Sink("model", SinkParts(metrics=self.tracker))
        self.spool = Spool(self.dir / "model.jsonl", {"sink": "model", "project": "p", "experiment": "e"})
        self.writer = LogWriter({"model": self.spool}, capacity=4, part_bytes=2_000)
        self.logged = 0
        self.kills = 0
        self.fills = 0
        self.reader = self._reader()

    def _reader(self) -> LogReader:
        reader = LogReader(self.spool.path, self.sink, POLICY, RESOURCE, follow=True)
        reader.start()
        return reader

    @rule(n=st.integers(1, 6))
    def log(self, n: int) -> None:
        for _ in range(n):
            step = self.logged
            self.writer.append(["model"], "step", StepBatch(RESOURCE, step, dict.fromkeys(KEYS, float(step)), {}, 0))
            self.logged += 1

    @rule()
    def a_step_that_cannot_be_encoded(self) -> None:
        """(log() checks every value first; should the codec refuse one all the same, that step
        alone is dropped and counted, and the steps after it go on.)"""
        self.writer.append(["model"], "step", StepBatch(RESOURCE, self.logged, dict.fromkeys(KEYS, object()), {}, 0))
        self.logged += 1

    @rule(burst=st.booleans())
    def the_pace_changes(self, burst: bool) -> None:
        """In a burst log() encodes each record, else the writer's thread does (until the
        thread's next wait says which it is)."""
        self.writer._burst = burst

    @rule(outcomes=st.lists(st.sampled_from(["ok", "fail", "half", "kill"]), max_size=4))
    def tracker_will(self, outcomes: list[str]) -> None:
        with self.tracker.lock:
            self.tracker.script.extend(outcomes)

    @rule()
    def tracker_goes_down(self) -> None:
        self.tracker.down = True

    @rule()
    def tracker_comes_back(self) -> None:
        self.tracker.down = False

    @rule()
    def wait_a_little(self) -> None:
        self.writer.flush(5)
        path = self.writer.logs["model"].path
        self.reader.caught_up(path, path.stat().st_size if path.exists() else 0, 0.2)

    @rule(after=st.integers(0, 1_500), n=st.integers(0, 5))
    def the_disk_fills(self, after: int, n: int) -> None:
        """The writer's next write stops after ``after`` bytes (a full disk), in the middle of a
        write of ``n`` steps or more: a record cut short there is dropped and counted with those
        after it in that write, and the records before it are kept."""
        capacity, self.writer.capacity = self.writer.capacity, 1_000
        with self.writer._one_writer:  # the steps wait, to be written together
            self.log(n)
        self.writer.capacity = capacity
        real = spool_module._write_all

        def fills(fd: int, data: bytes) -> None:
            spool_module._write_all = real  # once
            if after >= len(data):
                return real(fd, data)
            real(fd, data[:after])
            raise spool_module.PartlyWritten(after, OSError(errno.ENOSPC, "No space left on device"))

        spool_module._write_all = fills
        self.fills += 1
        self.writer.flush(5)
        spool_module._write_all = real

    @rule()
    def a_killed_reader_is_started_again(self) -> None:
        if self.reader.done:  # its thread died in the middle of an export
            self.kills += 1
            self.reader = self._reader()

    @invariant()
    def no_point_arrives_twice_unless_a_reader_was_killed(self) -> None:
        if not hasattr(self, "tracker"):
            return
        with self.tracker.lock:
            arrived = Counter(self.tracker.arrived)
        assert self.kills or max(arrived.values(), default=1) == 1, arrived.most_common(3)

    def teardown(self) -> None:
        if not hasattr(self, "tracker"):
            return
        try:
            self.writer.close(5)
            # (a tracker that is up takes everything once its script is used up; one that is down
            # makes no progress, and the drain gives up on it: what is left is spooled)
            self.reader.drain(0.5, since=time.monotonic())
            self.reader.stop()
            with self.tracker.lock:
                self.tracker.script.clear()
                self.tracker.down = False
            count_from_log(self.sink, self.writer)
            stats = self.sink.stats
            assert stats.delivered + stats.spooled + stats.dropped == self.logged, stats
            assert stats.dropped == self.writer.dropped["model"]
            left = sum(pending_items(part) for part in self.writer.parts["model"] if part.exists())
            assert stats.spooled == left, (stats, left)
            live = Counter(self.tracker.arrived)
            if not self.kills:
                assert max(live.values(), default=1) == 1, "delivered twice without a kill"

            # What is left is replay's: its reader, at most once, on each part that is left.
            before = len(self.tracker.arrived)
            for part in self.writer.parts["model"]:
                if part.exists() and pending_items(part):
                    replay = LogReader(part, self.sink, POLICY, RESOURCE, follow=False, at_most_once=True)
                    assert replay.run() == "delivered"
            replayed = Counter(self.tracker.arrived[before:])
            assert max(replayed.values(), default=1) == 1, "replay delivered a point twice"
            everything = Counter(self.tracker.arrived)
            missing = [step for step in range(self.logged) if not all(everything[(key, step)] for key in KEYS)]
            # only the steps a full disk cut short (or the codec refused) are missing, each counted dropped
            assert len(missing) == stats.dropped, ("lost", missing, stats, self.kills)
            for step in missing:
                assert not any(everything[(key, step)] for key in KEYS), ("part of a dropped step", step)
            assert not any(self.dir.glob(f"*{IN_DOUBT}")), "the live reader sets nothing aside"
            damaged = 0
            for part in self.writer.parts["model"]:
                if part.exists():
                    _, records = read_spool(part)
                    damaged += sum(isinstance(r, Damaged) for r in records)
                    assert all(isinstance(r, Damaged) or r[0] in ("step", "end") for r in records)
            assert damaged <= self.fills, "a damaged record where no write was cut short"
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


TheLog.TestCase.settings = settings(
    max_examples=60, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_the_log_loses_nothing_and_delivers_in_order = TheLog.TestCase
