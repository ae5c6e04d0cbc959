"""A sink's log on disk: how records are appended to it, what a record looks like, and how it is
read back.

One append-only log per sink (and rank, and attempt) in the run's spool directory, readable by its
owner only: a header record naming the sink and run (how replay rebuilds the sink), then one record
a line, ``<crc32 of the JSON, 8 hex digits> <JSON>``.  Nothing ever rewrites, renames or truncates a
log: its reader reads it from a position kept beside it (``delivery/position.py``) and removes it
once every record is delivered and no writer holds it.

An ML tracker's every record goes to its log, which *is* the hand-over from the training process
(:class:`LogWriter`, below) to the tracker's reader (``delivery/reader.py``, in the bridge process
or here); an OTel exporter's queue (``engine.py``) writes what its backend cannot take to its own.

A record cut short (a kill or a full disk in the middle of a write) has no end of line.  The writer
ends that line with ``TORN_END`` before its next record, so that a record cut just before its end
of line never reads as whole (it was counted dropped), and the reader, should a record have been glued to a
torn one all the same (by a writer of an older release), finds the whole record after the torn
bytes: only the torn record is lost, and it is counted.

The writer of trackers' logs, :class:`LogWriter`, appends every record once to the log of each
sink it is for, on one thread, so that the disk never reaches ``log()``:

    log() --append()--> [records waiting] --otel-tracking-log-writer--> <sink>.jsonl, one per sink
                                                                         (read by its LogReader,
                                                                          delivery/reader.py)

``append()`` puts the record in line; it is encoded once (``codec``: about 10 us for a step of 200
numbers) into the framed line the thread appends to each of its sinks' logs (:class:`Spool`,
0600).  Nothing waits for a tracker: the log is the record, and the sink's reader delivers from it.

Who encodes depends on the pace of ``log()``, because the two threads share one GIL.  Paced (the
thread's last wait gathered one record: a training step every few milliseconds or slower), the
thread encodes, after ``log()`` returned; the call only puts the record in line.  In a burst,
``append()`` encodes and the thread only joins lines and writes: a writer thread that runs Python
code takes the GIL from the training thread at each of the training thread's system calls (its
file sink's write), which cost a burst of log() calls a tenth of a millisecond each.  The thread
also waits ``LINGER_S`` (2 ms) after a first record for those behind it, and ``BURST_LINGER_S``
(50 ms) while that wait keeps gathering more than one (``log()`` in a burst), so that a burst goes
out in one ``write`` per log, not one per record and log, and the thread wakes, and takes the GIL,
a few times a second at most.  Bounded in memory: past ``capacity`` records waiting (a disk slower than
the training loop for that long), ``append()`` writes what waits itself, in order, before it
returns: the training loop then goes at the disk's pace, never at a tracker's.

Bounded on disk: a log is cut into parts of ``PART_BYTES`` (:func:`next_part`); its reader
removes a part once it delivered all of it.  A sink whose parts on disk reach ``max_bytes``
(``OTEL_TRACKING_SPOOL_MAX_MB``: its tracker has taken nothing for that long) gets no more records
until its reader catches up: each one is counted ``dropped``, with one warning, never silently.  A
record that cannot be written (a full disk) is dropped and counted the same way.
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
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from otel_tracking.config.destinations import destination
from otel_tracking.config.paths import path_part
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.codec import DECODERS, ENCODERS, step_record_json
from otel_tracking.signals.steps import StepBatch

logger = logging.getLogger("otel_tracking")

# How long a writer opening a log waits while a replay removes it (replay holds its exclusive lock
# for the few system calls of checking the log is delivered and unlinking it).
_LOCK_WAIT_S = 2.0


class Spool:
    """One sink's log, opened (and its header written) on the first record.  Each ``append`` is one
    ``write`` to a file opened for appending, so records never interleave, even should a second
    process append to the same log, and a header another process wrote first is not written again
    (should both see an empty file, the reader skips the second header).

    A writer holds a shared ``flock`` on the log for as long as it has it open: replay removes a
    log only under an exclusive one, so never while a writer could still append to it."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._fd: int | None = None
        self._at_line_start = False  # whether the log is known to end with a whole record
        self._lock = threading.Lock()

    def write(self, kind: str, payload: Any) -> None:
        self.append(record_line(kind, payload))

    def append(self, lines: bytes) -> None:
        """Records, framed already (:func:`record_line`), appended in one ``write``.  A write that
        fails part of the way raises :class:`PartlyWritten`, saying how much of ``lines`` is in."""
        with self._lock:
            if self._fd is None:
                self._fd = self._open()
            prefix, heading = b"", False
            # The log's end is looked at only when it is opened and after a write of ours failed:
            # an empty log gets its header first, and a record cut short before (a kill, a full
            # disk) never has the next one glued to it.
            if not self._at_line_start:
                size = os.fstat(self._fd).st_size
                if size == 0:
                    # The nonce tells this log from one made at the same path after it was removed.
                    first = {**self.header, "log": os.urandom(8).hex()}
                    prefix, heading = frame(json.dumps({"header": first})), True
                elif os.pread(self._fd, 1, size - 1) != b"\n":
                    prefix = TORN_END
            self._at_line_start = False
            try:
                _write_all(self._fd, prefix + lines)
            except PartlyWritten as error:
                if heading and error.written < len(prefix):
                    # A header cut short: the log holds nothing else, so it starts again empty
                    # (a log without its header could not be replayed).
                    with contextlib.suppress(OSError):
                        if os.fstat(self._fd).st_size == error.written:
                            os.ftruncate(self._fd, 0)
                error.written = max(0, error.written - len(prefix))
                raise
            self._at_line_start = True

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


# What ends a line cut short before the next record: not JSON, so the torn record stays damaged
# even when all that was cut off was its end of line.
TORN_END = b"#\n"


class PartlyWritten(OSError):
    """A write that failed (a full disk) after ``written`` bytes of the records handed to it."""

    def __init__(self, written: int, error: OSError) -> None:
        super().__init__(error.errno, error.strerror)
        self.written = written


def _write_all(fd: int, data: bytes) -> None:
    """``data`` appended in one ``write`` (a short write, only on a full disk, goes on after it)."""
    view, done = memoryview(data), 0
    while done < len(data):
        try:
            done += os.write(fd, view[done:])
        except OSError as error:
            raise PartlyWritten(done, error) from error


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
    if kind == "step":
        return frame(step_record_json(payload))
    return frame(json.dumps({"kind": kind, "data": ENCODERS[kind](payload)}, default=str))


def frame(text: str | bytes) -> bytes:
    """One log record as written: the checksum of its JSON text, then the text, on one line."""
    body = text.encode() if isinstance(text, str) else text
    return b"%08x %b\n" % (zlib.crc32(body), body)


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


# --- the writer of trackers' logs -------------------------------------------------------------------


def item_count(kind: str, payload: Any) -> int:
    """Items in one record, as the counts see them: a log() call is one, spans and log records
    one each."""
    return len(payload) if kind in ("spans", "logs") else 1


CAPACITY = 10_000  # records waiting for the writer thread before append() writes them itself
MAX_BYTES = 1 << 30  # a sink's parts on disk, at most (OTEL_TRACKING_SPOOL_MAX_MB)
LINGER_S = 0.002  # how long the thread waits after a first record for those behind it
BURST_LINGER_S = 0.05  # ... while log() comes in a burst (each wake of the thread takes the GIL)
_WRITE_BYTES = 1 << 20  # at most this much in one write


class LogWriter:
    """Appends records to sinks' logs (``logs``: each sink's :class:`Spool`) on a thread of its
    own (or, past ``capacity`` records waiting, on the caller's: see :meth:`append`)."""

    def __init__(
        self,
        logs: Mapping[str, Spool],
        capacity: int = CAPACITY,
        max_bytes: int = MAX_BYTES,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.logs = dict(logs)  # each sink's part being written
        self.parts: dict[str, list[Path]] = {name: [log.path] for name, log in self.logs.items()}
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.part_bytes = part_bytes
        self._part_size = dict.fromkeys(self.logs, 0)  # bytes this writer put in each sink's part
        self._on_disk = dict.fromkeys(self.logs, 0)  # ... and in all its parts (less those removed)
        self._full: set[str] = set()  # sinks at max_bytes (said once each)
        self.appended: dict[str, int] = defaultdict(int)  # items handed, per sink
        self.dropped: dict[str, int] = defaultdict(int)  # items that could not be written, per sink (under _cond)
        # (sinks, kind, payload, its framed line or None while not encoded yet, items)
        self._waiting: deque[tuple[Sequence[str], str, Any, bytes | None, int]] = deque()
        self._burst = False  # the thread's last wait gathered more than one record: log() encodes
        self._cond = threading.Condition()
        self._one_writer = threading.Lock()  # the thread, or append() past capacity: records stay in order
        self._handed = 0  # records handed to append(), and of those written (or dropped)
        self._done = 0
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="otel-tracking-log-writer", daemon=True)
        self._thread.start()

    def submit(self, names: Sequence[str], kind: str, payload: Any) -> None:
        """A sink's transport (``pipeline.export_to``): one item for the logs of ``names``.  A
        log() call goes in as its values (a ``step`` record), not as OTel metric data."""
        self.append(names, "step" if kind == "metrics" and isinstance(payload, StepBatch) else kind, payload)

    def append(self, names: Sequence[str], kind: str, payload: Any) -> None:
        """Put one record in line for the logs of ``names``; never waits for a tracker, nor (below
        ``capacity`` records waiting) for the disk.  While ``log()`` comes in a burst the record is
        encoded here; else the thread encodes it (see the module's notes)."""
        items = item_count(kind, payload)
        line = self._encode(names, kind, payload, items) if self._burst else None
        with self._cond:
            self._handed += 1
            for name in names:
                self.appended[name] += items
            if line is not None and not line:  # could not be encoded (counted dropped)
                self._done += 1
                return
            self._waiting.append((names, kind, payload, line, items))
            waiting = len(self._waiting)
            if waiting == 1:
                self._cond.notify_all()
        if waiting > self.capacity:
            self._write_waiting()

    def _encode(self, names: Sequence[str], kind: str, payload: Any, items: int) -> bytes:
        """The record's line, encoded once for every sink it is for; empty (and counted dropped
        for each sink) when it cannot be encoded."""
        try:
            return record_line(kind, payload)
        except Exception:
            logger.exception("otel-tracking: a %s record could not be encoded; dropped", kind)
            for name in names:
                self._drop(name, items)
            return b""

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting and self._closed:
                    return
                if not self._closed:  # what comes behind goes out together (flush() and close() end the wait)
                    self._cond.wait(BURST_LINGER_S if self._burst else LINGER_S)
                # More than one record in the wait: log() is called faster than every LINGER_S (a
                # burst), so the thread wakes less often while it lasts; else a record is written soon.
                self._burst = len(self._waiting) > 1
            self._write_waiting()

    def _write_waiting(self) -> None:
        with self._one_writer:
            self._write_batch()

    def _write_batch(self) -> None:
        """What waits, written (under ``_one_writer``): each log gets what waits for it in few
        writes, not a write per record."""
        with self._cond:
            batch = list(self._waiting)
            self._waiting.clear()
        lines: dict[str, list[tuple[bytes, int]]] = defaultdict(list)
        for names, kind, payload, line, items in batch:
            if line is None:
                line = self._encode(names, kind, payload, items)
                if not line:
                    continue
            for name in names:
                lines[name].append((line, items))
        for name, records in lines.items():
            self._write(name, records)
        with self._cond:
            self._done += len(batch)
            self._cond.notify_all()

    def _write(self, name: str, records: Sequence[tuple[bytes, int]]) -> None:
        """A sink's records (each line with its item count), in order, in writes of up to
        ``_WRITE_BYTES`` that stay within the sink's bound and its part."""
        chunk: list[tuple[bytes, int]] = []
        size = 0
        for line, items in records:
            if self._on_disk[name] + size + len(line) > self.max_bytes:
                self._write_chunk(name, chunk)
                chunk, size = [], 0
                if not self._room(name, len(line)):
                    self._drop(name, items)
                    continue
            chunk.append((line, items))
            size += len(line)
            if size >= _WRITE_BYTES or self._part_size[name] + size >= self.part_bytes:
                self._write_chunk(name, chunk)
                chunk, size = [], 0
        self._write_chunk(name, chunk)

    def _write_chunk(self, name: str, chunk: Sequence[tuple[bytes, int]]) -> None:
        if not chunk:
            return
        data = b"".join(line for line, _ in chunk)
        try:
            self.logs[name].append(data)
            written = len(data)
        except OSError as error:
            written = error.written if isinstance(error, PartlyWritten) else 0
            whole = 0  # the records wholly written are in the log; the others are dropped
            for line, items in chunk:
                if whole + len(line) <= written:
                    whole += len(line)
                else:
                    self._drop(name, items)
            written = whole
            if not self._warned:
                self._warned = True
                logger.warning(
                    "otel-tracking: %s cannot be written (%s); what cannot be written is dropped and counted",
                    self.logs[name].path,
                    error.strerror or type(error).__name__,
                )
        self._part_size[name] += written
        self._on_disk[name] += written
        if self._part_size[name] >= self.part_bytes:
            self._next_part(name)

    def _drop(self, name: str, items: int) -> None:
        with self._cond:
            self.dropped[name] += items

    def _next_part(self, name: str) -> None:
        """Go on in the next part of a sink's log (this one is whole: its reader may remove it)."""
        current = self.logs[name]
        current.close()
        self.logs[name] = Spool(next_part(current.path), dict(current.header))
        self.parts[name].append(self.logs[name].path)
        self._part_size[name] = 0

    def _room(self, name: str, size: int) -> bool:
        """Whether a sink at its bound has room again (its reader removed parts it delivered)."""
        self.parts[name] = [path for path in self.parts[name] if path.exists() or path == self.logs[name].path]
        self._on_disk[name] = sum(_size_of(path) for path in self.parts[name])
        if self._on_disk[name] + size <= self.max_bytes:
            self._full.discard(name)
            return True
        if name not in self._full:
            self._full.add(name)
            logger.warning(
                "otel-tracking: %s has %d MB in the spool that its tracker has not taken "
                "(OTEL_TRACKING_SPOOL_MAX_MB); what is logged for it is dropped, and counted, until it catches up",
                name,
                self.max_bytes >> 20,
            )
        return False

    def flush(self, timeout_s: float) -> bool:
        """Wait until every record appended so far is written (or counted dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._handed
            self._cond.notify_all()
            while self._done < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def end(self, name: str, exit_code: int) -> None:
        """The last record of a sink's log when no tracker ended the backend's run: replay ends it
        so.  (After :meth:`close`.)"""
        try:
            self.logs[name].end(exit_code)
        except OSError as error:
            logger.warning("otel-tracking: %s: could not record the run's end: %s", self.logs[name].path, error)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what waits (within ``timeout_s``; what is left then is written here), end the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._write_waiting()
        for log in self.logs.values():
            log.close()


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


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
