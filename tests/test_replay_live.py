"""`otel-tracking replay` beside a job that still spools: a process appending to a sink's spool log
while replay runs, any number of times, and replays killed at any moment.  Replay renamed the log
(``*.replayed``) or swapped a ``.retry`` file over it while the writer kept appending through its
open handle: what it appended then sat in a file no replay reads.  Now replay is a reader with a
position: every whole record arrives once (at most once, even when replay is killed: one it had on
its way is set aside in ``*.in-doubt``), and nothing is left in a file no replay reads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider

from otel_tracking.delivery.codec import ENCODERS
from otel_tracking.delivery.spool import Damaged, Spool, frame, read_spool
from tests.otlp_receiver import HttpReceiver

LEFT = 75  # replay's exit code when something is left for a later replay

# A writer process: appends one TensorBoard step at a time to the sink's spool log, as the bridge
# process does when the tracker cannot take it, until its stdin closes; prints how many it wrote.
# It closes the log every 10 steps and opens it again: a new writer opening it while a replay runs.
_WRITER = """
import select, sys, time
from pathlib import Path
from opentelemetry.sdk.resources import Resource
from otel_tracking.delivery.spool import Spool
from otel_tracking.signals.steps import StepBatch

path, tb = Path(sys.argv[1]), sys.argv[2]
header = {"sink": "tensorboard", "project": "p", "experiment": "e", "run_id": "r1", "pid": 1,
          "destination": {"TENSORBOARD_DIR": tb}}
spool = Spool(path, header)
resource = Resource.create({})
step = 0
while True:
    spool.write("metrics", StepBatch(resource, step, {"loss": step / 10}, {}, time.time_ns()))
    step += 1
    if step % 10 == 0:  # a writer that opens the log while replay runs (as the training process
        spool.close()  # does when it takes over from a bridge process that died)
        if select.select([sys.stdin], [], [], 0.05)[0]:
            break
        spool = Spool(path, header)
    if step == 1:
        print("started", flush=True)
    if select.select([sys.stdin], [], [], 0.002)[0]:  # paced; stops when the test closes stdin
        break
spool.close()
print(step, flush=True)
"""


def _replay(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_replay_beside_a_writer_process_delivers_every_step_once_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Four replays while a writer process appends (opening the log again and again), then one
    after it ended: TensorBoard holds every step the writer wrote, once; the spool directory is
    empty; a replay that met the writer says so with exit code 75, the last one exits 0."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    run = tmp_path / "spool" / "p" / "e-r1"
    path = run / "tensorboard.jsonl"
    env = {**os.environ, "OTEL_TRACKING_SPOOL_DIR": str(tmp_path / "spool")}
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(tb)],
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdin is not None
    assert writer.stdout.readline() == "started\n"
    beside: list[subprocess.CompletedProcess[str]] = []
    try:
        for _ in range(4):
            beside.append(_replay(run, env))
    finally:
        writer.stdin.close()
        written = int(writer.stdout.read().split()[-1])
        assert writer.wait(timeout=60) == 0
    final = _replay(run, env)

    accumulator = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    accumulator.Reload()
    steps = sorted(event.step for event in accumulator.Scalars("loss"))
    assert written > 100
    assert steps == list(range(written)), f"{len(steps)} points for {written} steps written"
    assert list(run.iterdir()) == [], "nothing left in a file no replay reads"
    for done in beside:  # each delivered what was there; one that met the writer said the rest waits
        assert done.returncode in (0, LEFT), done.stderr
        assert (done.returncode == LEFT) == ("a running process still writes it" in done.stderr), done.stderr
    assert final.returncode == 0, final.stderr


# --- the model ----------------------------------------------------------------------------------

_tracer = TracerProvider().get_tracer("live")


def _span(name: str) -> Any:
    span = _tracer.start_span(name)
    span.end()
    return span


def _line(name: str) -> bytes:
    return frame(json.dumps({"kind": "spans", "data": ENCODERS["spans"]([_span(name)])}, default=str))


class _Log:
    """The spool log of the model: a live writer (this process, holding it open as a running job
    does) and raw appends (a writer killed mid-record, an older release's writer gluing a record to
    a torn one), with the names of the whole records and of the torn ones."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.spool: Spool | None = None
        self.whole: list[str] = []
        self.torn: list[str] = []

    def append(self, n: int) -> None:
        if self.spool is None:
            self.spool = Spool(self.path, {"sink": "otlp-traces", "project": "p", "experiment": "e", "run_id": "r1"})
        for _ in range(n):
            name = f"w{len(self.whole) + len(self.torn)}"
            self.spool.write("spans", [_span(name)])
            self.whole.append(name)

    def tear(self, where: float, glue: bool) -> None:
        """A record cut short (its writer killed), and with ``glue`` a whole record appended
        straight after it, on the same line."""
        self.append(0 if self.path.exists() else 1)  # a log with its header first
        name = f"w{len(self.whole) + len(self.torn)}"
        line = _line(name)
        data = line[: max(1, int(len(line) * where))]
        self.torn.append(name)
        if glue:
            glued = f"w{len(self.whole) + len(self.torn)}"
            data += _line(glued)
            self.whole.append(glued)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()
            self.spool = None


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 30)),
        st.tuples(st.just("tear"), st.floats(0.05, 0.95), st.booleans()),
        st.tuples(st.just("close")),
        # replay, appending meanwhile, killed once k more records arrived (None: runs to its end)
        st.tuples(st.just("replay"), st.integers(0, 20), st.none() | st.integers(0, 15)),
    ),
    min_size=2,
    max_size=6,
)


def _in_doubt(path: Path) -> list[str]:
    doubt = path.with_name(path.name + ".in-doubt")
    if not doubt.exists():
        return []
    _, records = read_spool(doubt)
    names = []
    for record in records:
        assert not isinstance(record, Damaged), record
        names += [span.name for span in record[1]]
    return names


@settings(max_examples=8, deadline=None)
@given(ops=_OPS)
@example(ops=[("append", 5), ("close",), ("replay", 20, None), ("replay", 0, None)])  # a writer opens it meanwhile
@example(ops=[("append", 3), ("tear", 0.5, True), ("append", 2)])  # a torn record, a whole one glued on
@example(ops=[("append", 40), ("replay", 5, 3), ("replay", 5, None)])  # killed with records on their way
@example(ops=[("append", 2), ("tear", 0.4, False), ("replay", 3, None), ("close",)])  # a torn tail, the writer on
def test_replays_beside_a_live_writer_deliver_every_whole_record_at_most_once_and_lose_none(ops: list[Any]) -> None:
    """Model: any interleaving of appends by a live writer, torn records (alone, or with a whole
    one glued on), the writer closing, and replays during which the writer appends, each killed
    (SIGKILL) once k more records arrived or left to run to its end; then the writer ends and
    replay runs until the spool is empty.  Invariant: no record arrives twice; every whole record
    arrived or was set aside in doubt (only a killed replay sets any aside); no torn record
    arrives; the log and its position are gone at the end."""
    with tempfile.TemporaryDirectory() as directory, HttpReceiver() as receiver:
        receiver.received.answer_after_s = 0.005  # a kill lands inside a request now and then
        root = Path(directory)
        log = _Log(root / "spool" / "p" / "e-r1" / "otlp-traces.jsonl")
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACKING_SPOOL_DIR": str(root)}
        killed = False

        def names() -> list[str]:
            return [span["name"] for span in receiver.received.spans()]

        for op in ops:
            if op[0] == "append":
                log.append(op[1])
            elif op[0] == "tear":
                log.tear(op[1], op[2])
            elif op[0] == "close":
                log.close()
            elif log.path.exists():
                _, meanwhile, kill_after = op
                target = len(names()) + (kill_after or 0)
                replay = subprocess.Popen(
                    [sys.executable, "-m", "otel_tracking", "replay", str(log.path)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                log.append(meanwhile)
                if kill_after is not None:
                    deadline = time.monotonic() + 60
                    while len(names()) < target and replay.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.001)
                    with contextlib.suppress(ProcessLookupError):
                        replay.send_signal(signal.SIGKILL)
                _, err = replay.communicate(timeout=120)
                killed |= replay.returncode == -signal.SIGKILL
                assert replay.returncode in (0, 1, LEFT, -signal.SIGKILL), err
        log.close()
        for _ in range(3):  # the first may set records aside (in doubt), the next ones deliver the rest
            if not log.path.exists():
                break
            final = _replay(log.path, env)
            assert final.returncode in (0, 1, LEFT), final.stderr
        arrived = names()
        doubt = _in_doubt(log.path)
        twice = sorted({name for name in arrived if arrived.count(name) > 1})
        assert not twice, f"delivered twice: {twice}"
        assert not set(log.torn) & set(arrived), "a torn record is never delivered"
        lost = set(log.whole) - set(arrived) - set(doubt)
        assert not lost, f"whole records neither delivered nor set aside: {sorted(lost)}"
        if not killed:
            assert doubt == [], "only a killed replay sets records aside"
        assert not log.path.exists() and not log.path.with_name(log.path.name + ".pos").exists()
        if log.path.parent.exists():
            leftovers = {p.name for p in log.path.parent.iterdir()} - {log.path.name + ".in-doubt"}
            assert not leftovers, f"left in files no replay reads: {leftovers}"


def test_a_writer_opening_the_log_while_replay_removes_it_writes_to_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replay removes a delivered log under an exclusive lock.  A writer that opened the old file
    in that instant waits for the lock, sees the file gone, and writes to a new log at the path
    (it wrote into the removed file, whose records no replay would read)."""
    import fcntl
    import threading

    from otel_tracking.delivery import spool as spool_module

    path = tmp_path / "spool" / "otlp-traces.jsonl"
    Spool(path, {"sink": "otlp-traces"}).end(0)  # a log, delivered in full
    replay_side = os.open(path, os.O_RDONLY)
    fcntl.flock(replay_side, fcntl.LOCK_EX)  # replay, about to remove it
    refused = threading.Event()
    real_flock = fcntl.flock

    def flock(fd: int, operation: int) -> None:  # the real lock; the test hears when it was refused
        try:
            real_flock(fd, operation)
        except BlockingIOError:
            refused.set()
            raise

    monkeypatch.setattr(spool_module.fcntl, "flock", flock)
    writer = Spool(path, {"sink": "otlp-traces", "project": "p", "experiment": "e", "run_id": "r1"})
    wrote = threading.Thread(target=writer.write, args=("spans", [_span("after")]))
    wrote.start()
    assert refused.wait(30), "the writer opened the old file and asked for its lock"
    os.unlink(path)
    os.close(replay_side)  # the lock goes with it
    wrote.join(30)
    writer.close()
    header, records = read_spool(path)
    assert header["sink"] == "otlp-traces"
    assert [span.name for _, spans in records for span in spans] == ["after"]
