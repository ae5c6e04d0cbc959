"""Where the replay of one spool log stands: ``<log>.pos`` beside it, a small JSON file replaced
atomically (written aside, then renamed over the old one) each time it changes.

A spool log is append-only (``delivery/spool.py``); its reader keeps a position:

- ``offset``: the first record not dealt with; every record before it was delivered, skipped as
  damaged, or set aside in doubt.  The next replay reads from there.
- ``handed``: where the last record handed to the sink ends.  A record between ``offset`` and
  ``handed`` is *on its way* unless ``after`` says otherwise: if the replay is killed now, nobody
  knows whether it arrived, so the next replay does not deliver it again but copies it to
  ``<log>.in-doubt`` (a spool log of its own, with the same header: replay it by name to deliver
  it anyway) and says so.  That is the at-most-once promise.
- ``after``: what became of records past ``offset`` that are settled while one before them is not
  (a group of steps of which a later one landed while an earlier one did not): ``landed``, ``kept``
  (not delivered: the next replay delivers it), ``rest`` (partly delivered, the part left), or
  ``way`` (that part on its way).
- ``resume``: the backend run replay delivered into, when the log names none (the tracker never
  opened during the run): the next replay of the log goes on into the same run.

The position names its log (inode and header): a log removed and made anew at the same path does
not inherit it.  No fsync: the position survives the process (Ctrl-C, SIGTERM, SIGKILL), not a
crash of the machine, after which the last records may be delivered again.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_tracking.delivery.spool import Damaged, read_frames, read_header

IN_DOUBT = ".in-doubt"  # beside the log: records a killed replay had on their way
POSITION = ".pos"
LEGACY_POSITION = ".position"  # an older release's position (with its ``.retry`` file)
LEGACY_RETRY = ".retry"


class DamagedPosition(Exception):
    """A position file that cannot be read: replaying its log from the start could deliver
    records twice, so it is not replayed until someone decides."""


def log_id(log: Path, header_line: bytes) -> str:
    """What tells this log from another at the same path: its inode and its header line (a
    writer of this release puts a random nonce in it)."""
    return f"{os.stat(log).st_ino}:{zlib.crc32(header_line):08x}"


@dataclass
class Settled:
    """A record past ``offset`` that ``after`` describes: where it ends and what became of it."""

    end: int
    state: str  # "landed", "kept", "rest" (part left) or "way" (that part on its way)
    rest: dict[str, Any] | None = None  # {"kind", "data"}: the part left, as the spool encodes it


@dataclass
class LogPosition:
    path: Path  # the position file
    log: str  # log_id() of the log it belongs to
    offset: int
    handed: int
    after: dict[int, Settled] = field(default_factory=dict)
    resume: dict[str, Any] | None = None
    resumed: bool = False  # an earlier replay left it (it says where it goes on)

    @classmethod
    def load(cls, log: Path, header_line: bytes) -> LogPosition:
        """The position an earlier replay left beside ``log``, or its start (just after the
        header).  :class:`DamagedPosition` when there is one that cannot be read."""
        path = log.with_name(log.name + POSITION)
        me = log_id(log, header_line)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(path, me, len(header_line), len(header_line))
        try:
            saved = json.loads(text)
            if saved["log"] != me:  # left by a log removed since: not this one's
                return cls(path, me, len(header_line), len(header_line))
            after = {int(start): Settled(int(end), str(state), rest) for start, end, state, rest in saved["after"]}
            return cls(path, me, int(saved["offset"]), int(saved["handed"]), after, saved.get("resume"), True)
        except (ValueError, KeyError, TypeError) as error:
            raise DamagedPosition(f"{path} cannot be read ({type(error).__name__})") from error

    def save(self) -> None:
        saved = {
            "log": self.log,
            "offset": self.offset,
            "handed": self.handed,
            "after": [[start, s.end, s.state, s.rest] for start, s in sorted(self.after.items())],
            "resume": self.resume,
        }
        aside = self.path.with_name(self.path.name + ".new")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            data = json.dumps(saved, separators=(",", ":")).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(aside, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self.path.with_name(self.path.name + ".new").unlink(missing_ok=True)  # a save a kill cut short

    def set_aside_in_doubt(self, log: Path, header_line: bytes) -> int:
        """Copy the records a killed replay had on its way to ``<log>.in-doubt``, count them as
        dealt with, and save: how many.  (Killed between the copy and the save, the next replay
        copies them again: a record may then be twice in that file, never delivered twice.)"""
        doubt: list[bytes] = []
        if self.handed > self.offset:
            _, frames = read_frames(log, self.offset)
            for f in frames:
                if f.start >= self.handed:
                    break
                settled = self.after.get(f.start)
                if isinstance(f.item, Damaged) or (settled is not None and settled.state != "way"):
                    continue
                if settled is not None and settled.rest is not None:  # a part on its way
                    doubt.append(_framed(settled.rest))
                else:
                    with open(log, "rb") as source:
                        source.seek(f.start)
                        doubt.append(source.read(f.end - f.start))
                self.after[f.start] = Settled(f.end, "landed")
        if not doubt:
            return 0
        n = len(doubt)
        path = log.with_name(log.name + IN_DOUBT)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            if os.fstat(fd).st_size == 0:
                doubt.insert(0, header_line)
            data = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in doubt)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        self.compact()
        self.save()
        return n

    def compact(self) -> None:
        """Move ``offset`` past the records right after it that are dealt with."""
        while (settled := self.after.get(self.offset)) is not None and settled.state == "landed":
            del self.after[self.offset]
            self.offset = settled.end
        self.handed = max(self.handed, self.offset)


def _framed(encoded: dict[str, Any]) -> bytes:
    from otel_tracking.delivery.spool import frame

    return frame(json.dumps(encoded, default=str))


def migrate_legacy(logs: Iterable[Path]) -> None:
    """Turn the position an older release's replay left (``<log>.position``: inode, offset,
    length of its ``.retry`` file, in flight, where that flight ended) into this release's: the
    ``.retry`` file is cut to what that replay had written to it (the rest would be written twice),
    and is replayed as a log of its own, before its log (``replay.spool_files``)."""
    for log in logs:
        legacy = log.with_name(log.name + LEGACY_POSITION)
        if not legacy.exists():
            continue
        try:
            inode_s, offset_s, retry_s, flight_s, *end = legacy.read_text().split()
            header, header_line = read_header(log)
            if int(inode_s) == os.stat(log).st_ino and header:
                offset, in_flight = int(offset_s), flight_s == "1"
                flight_end = int(end[0]) if end and int(end[0]) else _end_of_record_at(log, offset)
                handed = flight_end if in_flight else offset
                retry = log.with_name(log.name + LEGACY_RETRY)
                if retry.exists():
                    os.truncate(retry, int(retry_s))
                position = LogPosition(log.with_name(log.name + POSITION), log_id(log, header_line), offset, handed)
                position.save()
        except (OSError, ValueError):  # torn, or its log gone: nothing to carry over
            pass
        legacy.unlink(missing_ok=True)


def _end_of_record_at(log: Path, offset: int) -> int:
    with open(log, "rb") as f:
        f.seek(offset)
        for line in iter(f.readline, b""):
            offset += len(line)
            if line.strip():
                break
    return offset
