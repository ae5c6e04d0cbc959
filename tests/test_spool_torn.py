"""A record cut short in a spool log (a kill or a full disk in the middle of a write) costs that
record only: the record appended after it, glued to it on one line, was lost too (both failed their
checksum).  The reader finds the whole record after the torn bytes, and the writer starts a record
on a line of its own when the log does not end in one."""

from __future__ import annotations

import errno
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource

from otel_tracking.delivery import spool as spool_module
from otel_tracking.delivery.codec import ENCODERS
from otel_tracking.delivery.spool import TORN_END, Damaged, Spool, frame, read_spool
from otel_tracking.signals.steps import StepBatch, step_batch_of

_HEADER = {"sink": "tensorboard", "project": "p", "experiment": "e", "run_id": "r1", "pid": 1}


def _batch(step: int) -> StepBatch:
    # A text value with what looks like a record's start in it: the reader must not be fooled.
    return StepBatch(Resource.create({}), step, {"loss": step / 10}, {"note": "0badf00d {"}, 1 + step)


def _line(step: int) -> bytes:
    return frame(json.dumps({"kind": "metrics", "data": ENCODERS["metrics"](_batch(step))}, default=str))


def _steps(path: Path) -> tuple[list[int], int]:
    """(the steps read back, in order; the damaged records)."""
    _, records = read_spool(path)
    steps, damaged = [], 0
    for record in records:
        if isinstance(record, Damaged):
            damaged += 1
        else:
            batch = step_batch_of(record[1])
            assert batch is not None
            steps.append(batch.step)
    return steps, damaged


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(0.01, 0.99), st.booleans()), min_size=1, max_size=12))
def test_only_the_torn_record_is_lost_whoever_appends_after_it(records: list[tuple[bool, float, bool]]) -> None:
    """Model: records appended in turn, each whole or cut short at any byte (``torn``); the record
    after a torn one is appended either by this release's writer or glued straight on (a writer
    that does not look, as an older release's).  Read back: every whole record, in order, and one
    damaged record for the torn ones (one for each, or for a run of them glued together)."""
    with tempfile.TemporaryDirectory() as directory:
        _torn_and_whole(Path(directory) / "tensorboard.jsonl", records)


def _torn_and_whole(path: Path, records: list[tuple[bool, float, bool]]) -> None:
    spool = Spool(path, _HEADER)
    spool.write("metrics", _batch(-1))  # the header, and a first record
    spool.close()
    expected, torn = [-1], 0
    for step, (cut_short, where, by_writer) in enumerate(records):
        if cut_short:
            line = _line(step)
            with open(path, "ab") as f:
                f.write(line[: max(1, int(len(line) * where))])
            torn += 1
            continue
        if by_writer:
            spool = Spool(path, _HEADER)
            spool.write("metrics", _batch(step))
            spool.close()
        else:
            with open(path, "ab") as f:
                f.write(_line(step))
        expected.append(step)
    steps, damaged = _steps(path)
    assert steps == expected
    # Each torn record is counted; torn records glued to each other make one damaged line.
    assert (damaged > 0) == (torn > 0) and damaged <= torn


def test_the_writer_starts_its_record_on_a_line_of_its_own_after_a_torn_one(isolated: Path) -> None:
    path = isolated / "spool" / "tensorboard.jsonl"
    spool = Spool(path, _HEADER)
    spool.write("metrics", _batch(0))
    spool.close()
    with open(path, "ab") as f:  # a writer of the log killed in the middle of its record
        f.write(_line(1)[:30])
    spool = Spool(path, _HEADER)  # the next writer to open it
    spool.write("metrics", _batch(2))
    spool.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines[-2] == _line(1)[:30] + TORN_END and lines[-1] == _line(2)
    assert _steps(path) == ([0, 2], 1)


def test_a_record_cut_just_before_its_end_of_line_stays_damaged(isolated: Path) -> None:
    """A full disk that left all of a record but its end of line: the writer counted it dropped,
    so the next writer's record must not make it whole (it would be delivered as well)."""
    path = isolated / "spool" / "tensorboard.jsonl"
    spool = Spool(path, _HEADER)
    spool.write("metrics", _batch(0))
    spool.close()
    with open(path, "ab") as f:
        f.write(_line(1)[:-1])
    spool = Spool(path, _HEADER)
    spool.write("metrics", _batch(2))
    spool.close()
    assert _steps(path) == ([0, 2], 1)


def test_after_its_own_write_was_cut_short_the_writer_starts_a_new_line(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer looks at the log's end only when it opens it and after a write of its own failed
    (a full disk): then the next record is not glued to the one cut short."""
    path = isolated / "spool" / "tensorboard.jsonl"
    spool = Spool(path, _HEADER)
    spool.write("metrics", _batch(0))
    real = spool_module._write_all

    def full(fd: int, data: bytes) -> None:
        real(fd, data[:30])
        raise spool_module.PartlyWritten(30, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(spool_module, "_write_all", full)
    with pytest.raises(spool_module.PartlyWritten) as cut:
        spool.write("metrics", _batch(1))
    assert cut.value.written == 30 and cut.value.errno == errno.ENOSPC
    monkeypatch.setattr(spool_module, "_write_all", real)
    spool.write("metrics", _batch(2))  # the disk has room again
    spool.close()
    assert _steps(path) == ([0, 2], 1)
