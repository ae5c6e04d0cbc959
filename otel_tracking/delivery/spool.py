"""The spool: what a sink cannot deliver, kept on disk for ``otel-tracking replay``.

One append-only log per sink (and rank, and attempt) in the run's spool directory, whichever
process writes it, readable by its owner only: a header record naming the sink and run (how replay
rebuilds the sink), then one record a line, ``<crc32 of the JSON, 8 hex digits> <JSON>``.  Nothing
ever rewrites, renames or truncates a log: replay reads it from a position kept beside it
(``delivery/position.py``) and removes it once every record is delivered and no writer holds it.

A record cut short (a kill or a full disk in the middle of a write) has no end of line.  The writer
starts its next record on a line of its own, and the reader, should a record have been glued to a
torn one all the same (by a writer of an older release), finds the whole record after the torn
bytes: only the torn record is lost, and it is counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from otel_tracking.config.destinations import destination
from otel_tracking.config.paths import path_part
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.codec import DECODERS, ENCODERS

logger = logging.getLogger("otel_tracking")

# How long a writer opening a log waits while a replay removes it (replay holds its exclusive lock
# for the few system calls of checking the log is delivered and unlinking it).
_LOCK_WAIT_S = 2.0


class Spool:
    """One sink's spool log, opened (and its header written) on the first record.  Two processes
    may append to one sink's log (the bridge process, and the training process when the bridge
    process is gone): each record is one ``write`` to a file opened for appending, so records never
    interleave, and a header the other process wrote first is not written again (should both see
    an empty file, the reader skips the second header).

    A writer holds a shared ``flock`` on the log for as long as it has it open: replay removes a
    log only under an exclusive one, so never while a writer could still append to it."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._fd: int | None = None
        self._lock = threading.Lock()

    def write(self, kind: str, payload: Any) -> None:
        self.append(record_line(kind, payload))

    def append(self, line: bytes) -> None:
        """One record, framed already (:func:`record_line`), appended in one ``write``."""
        with self._lock:
            if self._fd is None:
                self._fd = self._open()
                if os.fstat(self._fd).st_size == 0:
                    # The nonce tells this log from one made at the same path after it was removed.
                    first = {**self.header, "log": os.urandom(8).hex()}
                    line = frame(json.dumps({"header": first})).encode() + line
            if not _ends_a_line(self._fd):  # a record cut short before: never glue this one to it
                line = b"\n" + line
            _write_all(self._fd, line)

    def _open(self) -> int:
        """The log, opened for appending and held shared: a log replay is removing right now (it
        holds it exclusively for an instant) is waited for and opened again, made anew."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        deadline = time.monotonic() + _LOCK_WAIT_S
        pause = 0.001
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)  # read: its last byte
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    continue
                logger.warning("otel-tracking: %s stays locked by a replay; writing to it without a lock", self.path)
                return fd
            except OSError:  # a file system without flock: nothing to coordinate with
                return fd
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            os.close(fd)  # removed (delivered) between the open and the lock: open the new one

    def end(self, exit_code: int) -> None:
        """The last record when the run ended without a tracker ending the backend's run (the
        bridge process died, or the backend never opened): replay ends that run with this code."""
        self.write("end", {"exit_code": exit_code})
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _ends_a_line(fd: int) -> bool:
    """Whether the file is empty or ends with an end of line (a record cut short does not)."""
    size = os.fstat(fd).st_size
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


def _write_all(fd: int, data: bytes) -> None:
    """``data`` appended in one ``write`` (a short write, only on a full disk, goes on after it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# A sink's log is cut into parts of about this size (``<sink>.jsonl``, ``<sink>.part2.jsonl``, ...):
# a part its reader delivered in full is removed while the run goes on, so a long run's disk use
# is what is not delivered yet, not all it ever logged.
PART_BYTES = 64 << 20
_PART = re.compile(r"\.part(\d+)(?=\.jsonl$)")


def part_of(path: Path) -> int:
    """Which part of its sink's log a file is: 1 for ``<sink>.jsonl``, n for ``<sink>.part<n>.jsonl``."""
    match = _PART.search(path.name)
    return int(match.group(1)) if match else 1


def next_part(path: Path) -> Path:
    """The file of the part after ``path``."""
    n = part_of(path)
    name = _PART.sub("", path.name).removesuffix(".jsonl")
    return path.with_name(f"{name}.part{n + 1}.jsonl")


def record_line(kind: str, payload: Any) -> bytes:
    """One record of ``kind`` as a log keeps it: a framed line."""
    return frame(json.dumps({"kind": kind, "data": ENCODERS[kind](payload)}, default=str)).encode()


def frame(text: str) -> str:
    """One spool record: its checksum, then the JSON text, on one line."""
    return f"{zlib.crc32(text.encode()):08x} {text}\n"


class Damaged(NamedTuple):
    """A spool record that could not be read: where, and why."""

    path: Path
    offset: int  # byte offset of the record's line
    reason: str


CUT_SHORT = "cut short (no end of line)"

SpoolItem = tuple[str, Any]


class Frame(NamedTuple):
    """One record of a log and where it lies: from ``start`` to ``end`` (the offset just past it,
    where a reader that has dealt with it goes on)."""

    start: int
    end: int
    item: SpoolItem | Damaged


def read_spool(path: Path) -> tuple[dict[str, Any], Iterator[SpoolItem | Damaged]]:
    """(header, records): the records one at a time as ``(kind, decoded payload)``, or
    :class:`Damaged` for one that is cut short, fails its checksum or does not decode.  Streams:
    the file is never loaded whole.  Lines without a checksum (files written before the framing)
    are read as plain JSON."""
    header, frames = read_frames(path)
    return header, (f.item for f in frames)


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    """The log's header and its line as written (empty when the first line is no header)."""
    with open(path, "rb") as f:
        first = f.readline()
    entry = unframe(first)
    if isinstance(entry, dict) and "header" in entry and isinstance(entry["header"], dict):
        return entry["header"], first
    return {}, b""


def read_frames(path: Path, start: int | None = None) -> tuple[dict[str, Any], Iterator[Frame]]:
    """:func:`read_spool` from byte offset ``start`` (a record's first byte; default: the first
    record after the header), each record with where it lies (:class:`Frame`)."""
    header, header_line = read_header(path)
    handle = open(path, "rb")  # noqa: SIM115 - closed by the generator
    handle.seek(len(header_line) if start is None else start)

    def frames() -> Iterator[Frame]:
        with handle:
            start = offset = handle.tell()  # blank lines belong to the record after them
            for line in iter(handle.readline, b""):
                at, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                for found in _frames_of(path, start, at, line):
                    yield found
                    start = offset  # (a second writer's header, no record, belongs to the next one too)

    return header, frames()


def _frames_of(path: Path, start: int, at: int, line: bytes) -> Iterator[Frame]:
    """The records of the line at ``at`` (``start``: where the blank lines before it begin): one,
    or (a torn record with the next one glued to it) the torn part, damaged, and the whole record
    found after it.  Frames are contiguous, so a reader's position always falls on one's start."""
    end = at + len(line)
    entry = unframe(line)
    if isinstance(entry, str) and entry != CUT_SHORT:
        found = _glued(line)
        if found is not None:
            cut, entry_after = found
            yield Frame(start, at + cut, Damaged(path, at, "cut short (the next record was appended to it)"))
            start, at, entry = at + cut, at + cut, entry_after
    if isinstance(entry, str):
        yield Frame(start, end, Damaged(path, at, entry))
        return
    if "header" in entry:  # a second writer's, written while the file looked empty to both
        return
    try:
        yield Frame(start, end, (entry["kind"], DECODERS[entry["kind"]](entry["data"])))
    except Exception as error:  # a record that parses but does not decode
        yield Frame(start, end, Damaged(path, at, f"undecodable {type(error).__name__}: {error}"))


_FRAME_START = re.compile(rb"[0-9a-f]{8} \{")


def _glued(line: bytes) -> tuple[int, dict[str, Any]] | None:
    """Where in a damaged line a whole record starts (one whose checksum holds up to the end of
    the line), and that record; None when there is none."""
    for match in _FRAME_START.finditer(line, 1):
        entry = unframe(line[match.start() :])
        if isinstance(entry, dict):
            return match.start(), entry
    return None


def unframe(line: bytes) -> dict[str, Any] | str:
    """The JSON object of one record, or why it cannot be read."""
    if not line.endswith(b"\n"):
        return CUT_SHORT
    text = line[:-1].decode("utf-8", errors="replace")
    if text.startswith("{"):  # unframed: written before records had checksums
        body = text
    else:
        checksum, _, body = text.partition(" ")
        if len(checksum) != 8 or f"{zlib.crc32(body.encode()):08x}" != checksum:
            return "checksum mismatch"
    try:
        entry = json.loads(body)
    except ValueError as error:
        return f"not JSON ({error})"
    return entry if isinstance(entry, dict) else "not a record"


# --- where spools live --------------------------------------------------------------------------


class SpooledSink(Protocol):
    """What :func:`sink_spool` reads of a sink (``pipeline.Sink``)."""

    name: str
    inline: bool
    resume: dict[str, Any] | None


def check_spool_dir(settings: Settings) -> Settings:
    """The settings with ``spool_writable`` said: the spool directory is made and a file written
    and removed there.  When that fails, one warning says what it costs (nothing can be spooled:
    what a backend cannot take is dropped, and counted; no reattach record).  ``Tracking()`` does
    this; a worker run (whose directory would be one per process) finds out when it first spools."""
    if settings.spool_writable is not None:
        return settings
    directory = settings.spool_dir
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = directory / f".probe.{os.getpid()}.{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        logger.warning(
            "otel-tracking: the spool directory %s cannot be written (%s; OTEL_TRACKING_SPOOL_DIR chooses it): "
            "what a backend cannot take in time is dropped instead of kept for `otel-tracking replay` (the "
            "summary at finish() counts it), and a restarted job cannot resume this run",
            directory,
            error.strerror or type(error).__name__,
        )
        return dataclasses.replace(settings, spool_writable=False)
    return dataclasses.replace(settings, spool_writable=True)


def sink_spool(sink: SpooledSink, settings: Settings, pid: int) -> Spool | None:
    """Where a queued sink keeps what it cannot deliver; the header tells replay how to rebuild it."""
    if sink.inline or settings.spool_writable is False:
        return None
    header = {
        "sink": sink.name,
        "project": settings.project,
        "experiment": settings.experiment,
        "run_id": settings.run_id,
        "resume": sink.resume,
        "pid": pid,
        "attempt": settings.attempt,
        # Where the tracker was configured to write, known before it opens (or if it never does).
        "destination": destination(sink.name, settings),
    }
    # Ranks of one job share a run id, and each has its own tracker runs: a file (and a header) each.
    name = path_part(sink.name if settings.rank is None else f"{sink.name}.rank{settings.rank}")
    # A resumed run has the run id, so the spool directory, of the attempt before it, whose spool
    # may wait there for replay: each attempt writes files of its own.
    if settings.attempt > 1:
        name = f"{name}.attempt{settings.attempt}"
    return Spool(settings.spool_dir / f"{name}.jsonl", header)
