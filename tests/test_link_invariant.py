"""A model-based test of the hand-over to the bridge process under faults: whatever happens to the
bridge process (killed, stopped and continued), whatever the writer's bound and flush deadlines,
``log()`` never raises or drops, and after ``finish()`` and ``otel-tracking replay`` TensorBoard,
read back with its own reader, holds every logged step (at least once: what the child was
delivering when it died is delivered again).  At every moment the writer has every logged step
(appended, none dropped); after ``finish()`` each step is counted once for TensorBoard (delivered,
or spooled: past the position of its log).  This one drives the real child process on the real
log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from otel_tracking import Tracking

pytestmark = pytest.mark.backend


def _tensorboard_steps(directory: Path) -> set[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: set[int] = set()
    for run in {p.parent for p in directory.rglob("events.out.tfevents.*")}:
        accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "loss" in accumulator.Tags()["scalars"]:
            steps.update(event.step for event in accumulator.Scalars("loss"))
    return steps


class LinkUnderFaults(RuleBasedStateMachine):
    @initialize(queue_size=st.sampled_from([1, 3, 1000]))  # the writer's bound
    def start(self, queue_size: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="link-"))
        self.saved = dict(os.environ)
        os.environ.update(
            TENSORBOARD_DIR=str(self.root / "tb"),
            OTEL_TRACKING_SPOOL_DIR=str(self.root / "spool"),
            OTEL_TRACKING_QUEUE_SIZE=str(queue_size),
            OTEL_TRACKING_FINISH_TIMEOUT="3",
            OTEL_TRACKING_START_TIMEOUT="60",  # TensorBoard opens before the first fault
        )
        self.tracking = Tracking("link", "run", default_backend=["tensorboard"])
        self.link: Any = self.tracking.logger["tensorboard"].link
        self.logged: list[int] = []
        self.killed = self.stopped = False

    @rule(count=st.integers(1, 25))
    def log(self, count: int) -> None:
        for _ in range(count):
            step = len(self.logged)
            self.tracking.log({"loss": float(step)}, step)  # never raises, never blocks
            self.logged.append(step)

    @precondition(lambda self: not self.killed)
    @rule()
    def kill_child(self) -> None:
        self.link.process.send_signal(signal.SIGKILL)
        self.link.process.wait()
        self.killed = True

    @precondition(lambda self: not self.killed and not self.stopped)
    @rule()
    def stop_child(self) -> None:  # a child that neither reads nor answers
        self.link.process.send_signal(signal.SIGSTOP)
        self.stopped = True

    @precondition(lambda self: not self.killed and self.stopped)
    @rule()
    def continue_child(self) -> None:
        self.link.process.send_signal(signal.SIGCONT)
        self.stopped = False

    @rule(timeout_s=st.sampled_from([0.0, 0.2]))
    def flush(self, timeout_s: float) -> None:
        self.tracking.flush(timeout_s=timeout_s)  # bounded whatever the child does; True or False

    @invariant()
    def nothing_dropped(self) -> None:
        if hasattr(self, "tracking"):
            assert self.tracking.logger["tensorboard"].stats.dropped == 0

    @invariant()
    def every_step_is_appended(self) -> None:
        if hasattr(self, "tracking"):
            writer = self.link.writer
            assert writer.appended["tensorboard"] == len(self.logged) and not writer.dropped["tensorboard"]

    def teardown(self) -> None:
        if not hasattr(self, "tracking"):
            return
        try:
            if self.stopped:  # finish() copes with a stopped child too (test_bridge_process); here
                # the child may finish its share after its stop, which the deadline may cut short
                self.link.process.send_signal(signal.SIGCONT)
            stats = self.tracking.finish()
            assert stats["tensorboard"]["dropped"] == 0, stats
            counted = stats["tensorboard"]["delivered"] + stats["tensorboard"]["spooled"]
            assert counted == len(self.logged), (stats, len(self.logged))  # each step once
            replay = subprocess.run(
                [sys.executable, "-m", "otel_tracking", "replay", str(self.root / "spool")],
                capture_output=True,
                text=True,
                timeout=300,
            )
            # (1 with no spool dir: nothing was spooled, and the path does not exist)
            assert replay.returncode == 0 or not (self.root / "spool").exists(), replay.stderr
            missing = set(self.logged) - _tensorboard_steps(self.root / "tb")
            assert not missing, (sorted(missing), stats, replay.stderr[-2000:])
        finally:
            os.environ.clear()
            os.environ.update(self.saved)


LinkUnderFaults.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_link_loses_nothing_under_faults = LinkUnderFaults.TestCase
