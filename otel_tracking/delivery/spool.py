"""The spool: what a sink cannot deliver, kept on disk for ``otel-tracking replay``.

One append-only file per sink (and rank, and attempt) in the run's spool directory, whichever
process writes it, readable by its owner only: a header record naming the sink and run (how replay
rebuilds the sink), then one record a line, ``<crc32 of the JSON, 8 hex digits> <JSON>``. A record
cut short (a kill or a full disk in the middle of a write) or damaged is detected by
:func:`read_spool`, which skips it and goes on with the next line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from otel_tracking.config.destinations import destination
from otel_tracking.config.paths import path_part
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.codec import DECODERS, ENCODERS

logger = logging.getLogger("otel_tracking")


class Spool:
    """One sink's spool file, opened (and its header written) on the first record.  Two processes
    may append to one sink's file (the bridge process, and the training process when the bridge
    process is gone): each record is one ``write`` to a file opened for appending, so records never
    interleave, and a header the other process wrote first is not written again (should both see
    an empty file, the reader skips the second header)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._fd: int | None = None
        self._lock = threading.Lock()

    def write(self, kind: str, payload: Any) -> None:
        line = frame(json.dumps({"kind": kind, "data": ENCODERS[kind](payload)}, default=str)).encode()
        with self._lock:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                # Shared while open: replay takes it exclusively and leaves a file in use alone.
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                self._fd = fd
                if os.fstat(fd).st_size == 0:
                    line = frame(json.dumps({"header": self.header})).encode() + line
            _write_all(self._fd, line)

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


def _write_all(fd: int, data: bytes) -> None:
    """``data`` appended in one ``write`` (a short write, only on a full disk, goes on after it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def frame(text: str) -> str:
    """One spool record: its checksum, then the JSON text, on one line."""
    return f"{zlib.crc32(text.encode()):08x} {text}\n"


class Damaged(NamedTuple):
    """A spool record that could not be read: where, and why."""

    path: Path
    offset: int  # byte offset of the record's line
    reason: str


SpoolItem = tuple[str, Any]


def read_spool(path: Path) -> tuple[dict[str, Any], Iterator[SpoolItem | Damaged]]:
    """(header, records): the records one at a time as ``(kind, decoded payload)``, or
    :class:`Damaged` for one that is cut short, fails its checksum or does not decode.  Streams:
    the file is never loaded whole.  Lines without a checksum (files written before the framing)
    are read as plain JSON."""
    header, records = read_spool_from(path)
    return header, (record for _, record in records)


def read_spool_from(
    path: Path, start: int | None = None
) -> tuple[dict[str, Any], Iterator[tuple[int, SpoolItem | Damaged]]]:
    """:func:`read_spool` from byte offset ``start`` (a record's first byte; default: the first
    record after the header), each record with the offset just past it: where a reader that has
    dealt with it goes on (replay's progress)."""
    handle = open(path, "rb")  # noqa: SIM115 - closed by the generator
    first = handle.readline()
    header: dict[str, Any] = {}
    entry = unframe(first)
    if isinstance(entry, dict) and "header" in entry:
        header = entry["header"]
    else:
        handle.seek(0)
    if start is not None:
        handle.seek(start)

    def records() -> Iterator[tuple[int, SpoolItem | Damaged]]:
        with handle:
            offset = handle.tell()
            for line in iter(handle.readline, b""):
                at, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                entry = unframe(line)
                if isinstance(entry, str):
                    yield offset, Damaged(path, at, entry)
                    continue
                if "header" in entry:  # a second writer's, written while the file looked empty to both
                    continue
                try:
                    yield offset, (entry["kind"], DECODERS[entry["kind"]](entry["data"]))
                except Exception as error:  # a record that parses but does not decode
                    yield offset, Damaged(path, at, f"undecodable {type(error).__name__}: {error}")

    return header, records()


def unframe(line: bytes) -> dict[str, Any] | str:
    """The JSON object of one record, or why it cannot be read."""
    if not line.endswith(b"\n"):
        return "cut short (no end of line)"
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
