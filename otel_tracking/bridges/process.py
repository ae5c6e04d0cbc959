"""The ML trackers in a process of their own, so that their work never pauses the training loop.

Trackers' SDKs are heavy guests: wandb, SwanLab, ClearML and MLflow bring large heaps (every full
garbage collection walks them, pausing every thread) and busy threads of their own (every write
the training loop makes hands the GIL to them for up to a switch interval).  In one process that
costs ``log()`` tens of milliseconds at the 99th percentile with every local backend on; from a
child process it costs nothing but handing the step over.

    training process                                        bridge process (nice +10)
    log() -> LogWriter --> <spool>/wandb.jsonl  ----------> LogReader -> Sink -> wandb
                       '-> <spool>/mlflow.jsonl ----------> LogReader -> Sink -> MLflow
            (one thread: each record encoded once,          (from the log's position, .pos beside
             appended to the log of each tracker             it: retried, degraded, bulk; the
             it is for)                                       position moves as the tracker takes it)

The log is the hand-over: the training process appends each record once to each of its trackers'
logs (``delivery/spool.py``) and waits for nobody; the child reads each log from its position
(``delivery/reader.py``, the reader ``otel-tracking replay`` runs too).  If the child dies, nothing
is to be saved: what it had not delivered is in the log, past its position, where replay finds it
(a record the child was delivering when it died may arrive twice; nothing is lost).  The counts
come from the log and its position (:func:`~otel_tracking.delivery.reader.pending_items`).  The
pipes carry only the start and the requests: ``Open``, ``Flush``, ``Finish`` and their answers
(``wire.py``).  The child ignores SIGINT and SIGTERM (the training process finishes the run and
then tells it to finish) and finishes on its own when the training process is gone.

Opening a tracker can take long (SDK imports) or hang (a proxy that never answers, and MLflow's
client waits 120 s a request).  So the child opens each tracker on a thread of its own and reports
each outcome as it comes; ``Tracking()`` waits ``OTEL_TRACKING_START_TIMEOUT`` for them.  A tracker
that fails by then raises there, as in one process; one still opening goes on in the background,
its records waiting in its log: its reader starts once it opens, or they stay for replay, with a
warning, if it fails.  A child that dies within the window (killed, a tracker SDK crashing at its
import) is one warning: training goes on and its trackers' logs wait for replay.  A watchdog thread
ends the child once the training process is gone, whatever the child is doing.

This module is the training process's side; the child is ``child.py`` and the messages between
them are listed in ``wire.py``.

``OTEL_TRACKING_BRIDGE_PROCESS=false`` runs the trackers in the training process instead (for
trackers' console capture of the training process's own output, see docs/architecture/bridge-process.md).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from otel_tracking.bridges.wire import (
    GRACE_S,
    OPENING,
    Failed,
    Finish,
    Finished,
    Flush,
    Flushed,
    Open,
    Opened,
    Progress,
    Stuck,
    TrackerInfo,
    write_frame,
)
from otel_tracking.config.run_config import RunConfig
from otel_tracking.config.settings import ConfigError, Settings
from otel_tracking.delivery.engine import HURRY, Policy
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.spool import LogWriter, Spool
from otel_tracking.delivery.tracker_logs import close_log, count_from_log, logs_settings, writer_for
from otel_tracking.exporters._base import SinkParts
from otel_tracking.signals.redact import scrub_text

logger = logging.getLogger("otel_tracking")


class BridgeProcess:
    """The training process's side: starts the child, appends what its trackers get to their logs."""

    def __init__(self, settings: Settings) -> None:
        self.settings = logs_settings(settings)  # the logs are the hand-over: they need a directory
        self.sinks: dict[str, RemoteSink] = {}
        self.writer: LogWriter | None = None  # once open() has made the remote sinks
        self._send_lock = threading.Lock()  # one writer on the pipe (it may block: never under another lock)
        self._requests = 0  # flush() requests sent, to match each answer to its own
        self._replies: queue.Queue[Any] = queue.Queue()
        self._dead = False
        self._finished = False
        self._finished_ok = False  # the child answered "finished": its exit is not a death
        self._write_closed = False  # the pipe to the child is closing: a writer waiting for room gives up
        self._last_progress = 0.0  # monotonic time the child last said a tracker took something
        self._stats: dict[str, dict[str, int]] = {}
        self._unended: list[str] = []  # trackers whose backend run nobody ended (Finished says)
        # The start window: the child's "opened"/"failed" outcomes, until open() stops waiting.
        self._opening = threading.Condition()
        self._outcomes: dict[str, Opened | Failed] = {}
        self._window_open = True
        self._gone_early = False  # the child exited while open() was waiting
        to_child_r, self._to_child_w = os.pipe()
        self._from_child_r, from_child_w = os.pipe()
        out = _fileno(sys.stdout)
        err = _fileno(sys.stderr)
        env = dict(os.environ)
        # The child imports otel_tracking the way this process did (a checkout on sys.path, too).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["PYTHONUNBUFFERED"] = "1"  # the backends' messages appear when they happen, not at exit
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "otel_tracking.bridges.child",
                str(to_child_r),
                str(from_child_w),
                str(os.getpid()),  # the child's watchdog compares its parent with this
            ],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,  # a Ctrl-C or a scheduler's group signal reaches the training process only
        )
        os.close(to_child_r)
        os.close(from_child_w)
        # Written without blocking (wire.write_frame): no request waits on a child that stopped
        # reading beyond its own deadline.
        os.set_blocking(self._to_child_w, False)
        self._from_child = Connection(self._from_child_r, writable=False)
        self._reader: threading.Thread | None = None

    # --- start -----------------------------------------------------------------------------------

    def open(self, names: Sequence[str], config: RunConfig) -> list[RemoteSink]:
        """Have the child open the named trackers (each on its own thread) and wait for them up to
        the start window; their remote sinks, in order.  A tracker that fails within the window
        raises here, as it would in one process; one still opening after it opens in the
        background (one warning names it) and its records wait for it in its log."""
        settings = replace(self.settings, env=dict(self.settings.env))
        # sys.argv too, scrubbed: trackers record the training script (MLflow's source tags), and
        # Hydra overrides can carry a token.
        opening = Open(
            settings,
            replace(config, recorded=_picklable(config.recorded)),
            list(names),
            [scrub_text(arg) for arg in sys.argv],
        )
        deadline = time.monotonic() + settings.start_timeout_s
        try:
            self._send(opening, max(settings.start_timeout_s, GRACE_S))
        except Stuck:  # it reads nothing: it is as good as gone
            self.process.kill()
        except OSError:  # it died before it read anything
            pass
        self._reader = threading.Thread(target=self._read_loop, name="otel-tracking-bridges-replies", daemon=True)
        self._reader.start()
        outcomes, gone = self._wait_for_outcomes(names, deadline)
        failed = [outcome for name in names if isinstance(outcome := outcomes.get(name), Failed)]
        if failed:
            self._abort()
            raise _error_from(failed[0])
        still_opening = [name for name in names if name not in outcomes]
        if gone:
            self._gone_while_opening(names)
            still_opening = []
        if still_opening:
            logger.warning(
                "otel-tracking: %s still opening after %g s (OTEL_TRACKING_START_TIMEOUT); training goes on. "
                "%s in the background; what is logged meanwhile waits for it, and is spooled (with a "
                "warning) if it fails",
                ", ".join(still_opening),
                settings.start_timeout_s,
                "It opens" if len(still_opening) == 1 else "They open",
            )
        self.writer = writer_for([self.sinks[name] for name in names], self.settings)
        for name in names:  # what the run hands them goes to their logs, once for all of them
            self.sinks[name].transport = self.writer
        return [self.sinks[name] for name in names]

    def _wait_for_outcomes(self, names: Sequence[str], deadline: float) -> tuple[dict[str, Opened | Failed], bool]:
        """Wait until every tracker opened, one failed, the child is gone, or ``deadline``; then close
        the window: every tracker gets its remote sink now, and later outcomes are the reader's to
        handle.  (outcomes within the window, whether the child is gone)."""
        with self._opening:
            while not (
                self._gone_early
                or len(self._outcomes) == len(names)
                or any(isinstance(outcome, Failed) for outcome in self._outcomes.values())
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._opening.wait(remaining)
            self._window_open = False
            outcomes = dict(self._outcomes)
            for name in names:
                outcome = outcomes.get(name)
                info = outcome.info if isinstance(outcome, Opened) else OPENING
                self.sinks[name] = RemoteSink(self, name, info)
            return outcomes, self._gone_early

    def _gone_while_opening(self, names: Sequence[str]) -> None:
        """The child died before the trackers opened (killed, or a tracker's SDK crashed in native
        code at its import): training goes on, and what is logged for them waits in their logs
        for ``otel-tracking replay``, which opens them then."""
        self._reap(timeout_s=5.0)
        self._dead = True
        logger.warning(
            "otel-tracking: the bridge process exited (code %s) while it opened %s; training goes on, and "
            "what is logged for %s is spooled: deliver it with `otel-tracking replay %s`",
            self.process.returncode,
            ", ".join(names),
            "it" if len(names) == 1 else "them",
            self.settings.spool_dir,
        )
        for name in names:
            self.sinks[name].where = "the bridge process exited before it opened: spooled"

    def _abort(self) -> None:
        """A tracker failed to open: the child ends the runs that did open (as failed) and exits."""
        self._request(Finish(1, 0.0), Finished, GRACE_S)
        self._reap(timeout_s=5.0)

    # --- the training thread's side --------------------------------------------------------------

    def wait_handed(self, timeout_s: float) -> bool:
        """Wait until every item so far is in the logs; False on timeout."""
        return self.writer is None or self.writer.flush(timeout_s)

    # --- the reader thread: outcomes, progress and replies ----------------------------------------

    def _read_loop(self) -> None:
        while True:
            message = self._read()
            if message is None:
                with contextlib.suppress(OSError):
                    self._from_child.close()
                with self._opening:  # while open() waits, it reports the exit itself
                    self._gone_early = self._window_open
                    self._opening.notify_all()
                if not self._finished_ok:
                    self._child_gone(warn=not self._gone_early)
                self._replies.put(None)
                return
            if isinstance(message, (Opened, Failed)):
                self._outcome(message)
                continue
            if isinstance(message, Progress):  # a tracker took something: the child is delivering
                self._last_progress = time.monotonic()
                continue
            if isinstance(message, Finished):
                self._finished_ok = True
            self._replies.put(message)

    def _outcome(self, outcome: Opened | Failed) -> None:
        """A tracker opened or failed: open() takes it while it waits; after that, the remote sink."""
        name = outcome.name
        with self._opening:
            if self._window_open:
                self._outcomes[name] = outcome
                self._opening.notify_all()
                return
        sink = self.sinks[name]
        if isinstance(outcome, Opened):
            sink.opened_late(outcome.info)
        else:
            sink.failed_late(f"{outcome.type_name}: {outcome.message}")

    def _child_gone(self, warn: bool = True) -> None:
        """The child died: its trackers' records wait in their logs, past their positions; said once."""
        if self._dead:
            return
        self._dead = True
        if warn:
            logger.warning(
                "otel-tracking: the bridge process is gone (exit code %s); what it had not delivered, and "
                "everything after, is kept in the spool for `otel-tracking replay %s`",
                self.process.poll(),
                self.settings.spool_dir,
            )

    def _send(self, message: Any, timeout_s: float | None = None) -> None:
        """One message on the pipe.  With ``timeout_s``, a child that does not read makes this raise
        :class:`~otel_tracking.bridges.wire.Stuck` within it (whether another writer holds the pipe or the
        pipe is full); without, it waits until the pipe closes.  A message cut short by the deadline
        leaves a stream the child cannot read: the child is stopped."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._send_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise Stuck(torn=False)
        try:
            if self._write_closed:
                raise BrokenPipeError("the pipe to the bridge process is closed")
            write_frame(self._to_child_w, data, deadline, cancelled=lambda: self._write_closed)
        except Stuck as stuck:
            if stuck.torn:
                self.process.kill()
            raise
        finally:
            self._send_lock.release()

    def _read(self) -> Any:
        """The child's next message; None once it is gone."""
        try:
            return pickle.loads(self._from_child.recv_bytes())
        except (OSError, EOFError):
            return None

    def _receive(self, expected: type, timeout_s: float, request: int | None = None) -> Any:
        """The child's reply of the ``expected`` kind, to ``request`` when the reply carries one (the
        reader thread passes replies on; one to an earlier request that timed out is skipped); None
        when the child is gone or late."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if reply is None:
                return None
            if isinstance(reply, expected) and (request is None or getattr(reply, "request", None) == request):
                return reply

    def _request(
        self, message: Any, expected: type, timeout_s: float, request: int | None = None, while_busy: bool = False
    ) -> Any:
        """Send ``message``, wait for its reply; ``while_busy``: for as long as the child says its
        trackers take something (each Progress moves the deadline)."""
        if self._dead:
            return None
        try:
            self._send(message, timeout_s)
        except Stuck:
            return None  # the caller stops the child (it does not read)
        except (OSError, EOFError):
            self._child_gone()
            return None
        if not while_busy:
            return self._receive(expected, timeout_s, request)
        started = time.monotonic()
        while True:
            window = max(started, self._last_progress) + timeout_s - time.monotonic()
            if window <= 0:
                return None
            reply = self._receive(expected, min(window, 1.0), request)
            if reply is not None or self._dead or self.process.poll() is not None or HURRY.is_set():
                return reply

    # --- the end ---------------------------------------------------------------------------------

    def flush(self, timeout_s: float) -> bool:
        """Wait until what was logged so far is in the logs and the child's trackers took it (or
        are failing, its records kept in their logs)."""
        deadline = time.monotonic() + timeout_s
        if not self.wait_handed(timeout_s):
            return False
        self._requests += 1  # numbered: a late answer to an earlier flush() never answers this one
        request = self._requests
        message = Flush(max(0.0, deadline - time.monotonic()), request)
        reply: Flushed | None = self._request(message, Flushed, timeout_s + GRACE_S, request)
        return reply is not None and reply.ok

    def finish(self, exit_code: int, timeout_s: float) -> None:
        """Write the rest, have the child deliver it while its trackers make progress (``timeout_s``
        is the bound for one that delivers nothing) and close every backend, then count each
        tracker's records from its log and position; once."""
        if self._finished:
            return
        self._finished = True
        if self.writer is not None:
            self.writer.close(timeout_s)
        finished: Finished | None = self._request(
            Finish(exit_code, timeout_s), Finished, timeout_s + GRACE_S, while_busy=True
        )
        if finished is not None:
            self._stats, self._unended = finished.counts, list(finished.unended)
            # Every backend is finished: the child's interpreter teardown (seconds, for MLflow's
            # imports) is none of the training loop's business.  Reap it in the background.
            self._close()
            threading.Thread(target=self.process.wait, name="otel-tracking-reaper", daemon=True).start()
        else:
            if not self._dead and not HURRY.is_set():
                logger.warning(
                    "otel-tracking: the bridge process made no progress for %.0f s while it finished; stopping it",
                    timeout_s + GRACE_S,
                )
            self._reap(timeout_s=GRACE_S)
            if self._reader is not None:
                self._reader.join(GRACE_S)
            self._child_gone()
            self._unended = list(self.sinks)  # no tracker ended its backend's run: replay will
        self._settle_logs(exit_code)

    def _settle_logs(self, exit_code: int) -> None:
        """Each tracker's counts from its log (and the export attempts the child saw); a log
        delivered in full is removed, one whose backend run nobody ended gets an end record."""
        if self.writer is None:
            return
        for name, sink in self.sinks.items():
            count_from_log(sink, self.writer, self._stats.get(name))
            close_log(name, self.writer, ended=name not in self._unended, exit_code=exit_code)

    def _close(self) -> None:
        # Only the sending end: the reader thread closes its own end when the child has gone (closing
        # a descriptor another thread is reading could hand its number to a file opened meanwhile).
        # A writer waiting for room sees _write_closed within a poll slice and lets go of the pipe.
        self._write_closed = True
        if self._send_lock.acquire(timeout=5.0):
            try:
                if self._to_child_w >= 0:
                    with contextlib.suppress(OSError):
                        os.close(self._to_child_w)
                    self._to_child_w = -1
            finally:
                self._send_lock.release()
        if self._reader is None:
            with contextlib.suppress(OSError):
                self._from_child.close()

    def _reap(self, timeout_s: float) -> None:
        self._close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class RemoteSink(Sink):
    """A tracker running in the bridge process, as the training process's run sees it: what it
    gets goes to its log (the link's writer); counts come from that log at the end."""

    def __init__(self, link: BridgeProcess, name: str, info: TrackerInfo) -> None:
        # Its exporters are in the child: what it takes is what the child said its tracker takes.
        super().__init__(name, SinkParts(where=info.where, resume=info.resume), named_events_only=True)
        self.info = info
        self.link = link
        self.owner = link  # its flush and finish are the bridge process's
        if _writes_nothing(info):  # opened within the start window, unreachable
            self.info = _spooled_by_child(info)
            self.where = self.info.where
            _say_spooled(name, f"it opened with nothing to write to: {info.where}", link.settings.spool_dir)

    def start(
        self,
        spool: Spool | None,
        policy: Policy | None = None,
        *,
        done: Callable[[Any, str], None] | None = None,
        held: bool = False,
        progressed: Callable[[], None] | None = None,
    ) -> None:
        return None  # its log is the link's (made in open(), whether or not the run can spool)

    def takes(self, kind: str) -> bool:
        return bool(getattr(self.info, kind))

    def opened_late(self, info: TrackerInfo) -> None:
        """The tracker opened after the start window: its reader delivers what waited in its log."""
        if _writes_nothing(info):  # MLflow not reachable, after its attempts
            self.failed_late(f"it opened with nothing to write to: {info.where}")
            return
        self.info = info
        self.resume = info.resume
        # The run's record first: once the sink says where it writes, a job killed can resume into it.
        if self.on_resume is not None:
            self.on_resume(self.name, self.resume)
        self.where = info.where
        if self.link.writer is not None:  # a log not begun yet names the run replay goes on into
            self.link.writer.logs[self.name].header["resume"] = info.resume
        logger.info("otel-tracking: %s opened: %s", self.name, self.where)

    def failed_late(self, error: str) -> None:
        """The tracker failed after the start window: its log keeps everything for replay (its
        ``info`` stays as it was, taking every kind, so that nothing logged for it goes nowhere)."""
        self.where = f"did not open ({error}): spooled"
        _say_spooled(self.name, error, self.link.settings.spool_dir)


def _writes_nothing(info: TrackerInfo) -> bool:
    return not (info.metrics or info.spans or info.logs)


def _spooled_by_child(info: TrackerInfo) -> TrackerInfo:
    """What a tracker that opened with nothing to write to takes: everything, which waits in its
    log (the child reads none of it), so each item is counted and kept for replay."""
    return replace(OPENING, where=f"{info.where}: spooled", resume=info.resume)


def _say_spooled(name: str, error: str, spool_dir: Any) -> None:
    logger.warning(
        "otel-tracking: %s did not open (%s); what was logged for it, and everything after, is "
        "spooled: deliver it later with `otel-tracking replay %s`",
        name,
        error,
        spool_dir,
    )


def start_bridges(names: Sequence[str], settings: Settings, config: RunConfig) -> list[RemoteSink]:
    link = BridgeProcess(settings)
    try:
        return link.open(names, config)
    except BaseException:
        link._reap(timeout_s=5.0)
        raise


# --- encoding --------------------------------------------------------------------------------------


def _picklable(config: Any) -> Any:
    try:
        pickle.dumps(config)
        return config
    except Exception:  # an object in the config that cannot cross: the trackers get its text, as in JSON
        return json.loads(json.dumps(config, default=str))


_ERRORS: dict[str, type[Exception]] = {
    "ConfigError": ConfigError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "OSError": OSError,
    "PermissionError": PermissionError,
    "FileNotFoundError": FileNotFoundError,
}


def _error_from(failed: Failed) -> Exception:
    """The child's error as itself, so that a user's ``except`` does not depend on where the
    trackers run: our own types, else the original class (a tracker's, e.g. wandb's UsageError),
    imported here only now that Tracking() fails; a RuntimeError naming it when it cannot be."""
    kind = _ERRORS.get(failed.type_name)
    if kind is not None:
        return kind(failed.message)
    try:
        found: Any = importlib.import_module(failed.module)
        for part in failed.qualname.split("."):
            found = getattr(found, part)
        if isinstance(found, type) and issubclass(found, Exception):
            return found(failed.message)
    except Exception:  # not importable here, or a constructor that wants other arguments
        pass
    return RuntimeError(f"{failed.type_name}: {failed.message}")


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except Exception:  # captured or replaced streams: the child writes where this process's fd does
        return None


# --- the child -------------------------------------------------------------------------------------
