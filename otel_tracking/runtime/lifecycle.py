"""How a process's runs end when the program does not end them: at interpreter exit, and on SIGTERM.

A run that was not finished is finished at interpreter exit by a hook that runs before every
``atexit`` hook (``threading``'s exit hook, which runs when the main thread ends, before
``atexit``): the hooks that backends register (``wandb.init``'s, the OTel SDK's) run later
whatever their registration order, so our exporters flush into backends that are still open.
SIGTERM becomes ``SystemExit(143)`` and, if the main thread is stuck in native code, a watcher
ends the process after a grace period, unless the application owns SIGTERM (its own handler,
installed before or after ``Tracking()``): then its handler decides, and the watcher only flushes
the runs so that their data is delivered or spooled.  A forked child carries none of this (see
``_after_fork_in_child``).  The exit code each run ends with comes from here too.

The runs themselves are ``run.py``'s: it hands its ``finish_open_runs`` to the two installers.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from otel_tracking.delivery.engine import HURRY

logger = logging.getLogger("otel_tracking")

# Finish this process's open runs with an exit code (None: exit_code_now()), each within at most
# a timeout (None: its own finish timeout).
FinishOpenRuns = Callable[[int | None, float | None], None]
_finish_open_runs: FinishOpenRuns = lambda exit_code, max_timeout_s: None  # noqa: E731 - until a run installs


def _at_exit() -> None:
    global _interpreter_exiting
    _interpreter_exiting = True
    # threading's exit hooks run when the main thread ends, before the interpreter joins the
    # non-daemon threads: one of them may still be training.  Then the runs end at ``atexit``
    # time instead, after those threads are joined, and still before the backends' own hooks
    # (``atexit`` runs the last registered first, and this is registered last).
    if any(
        thread.is_alive() and not thread.daemon and thread is not threading.current_thread()
        for thread in threading.enumerate()
    ):
        atexit.register(_finish_open_runs, None, None)
        return
    _finish_open_runs(None, None)


# 128 + signal after SIGTERM: the exit code an unfinished run gets at interpreter exit (else
# exit_code_now() says).
_exit_code_at_exit = 0


_exit_hook_pid: int | None = None


def finish_at_exit(finish_open_runs: FinishOpenRuns) -> None:
    """Once per process: at interpreter exit, ``finish_open_runs()`` (every run still open, newest
    first), before any ``atexit`` hook; when non-daemon threads still run as the main thread
    ends, after they were joined (``_at_exit``)."""
    global _exit_hook_pid, _finish_open_runs
    if _exit_hook_pid == os.getpid():
        return
    _exit_hook_pid = os.getpid()
    _finish_open_runs = finish_open_runs
    register = getattr(threading, "_register_atexit", None)  # private, but stable since 3.9
    try:
        if register is None:
            raise RuntimeError("no threading exit hook")
        register(_at_exit)
    except RuntimeError:
        atexit.register(_at_exit)


def exit_code_for(error: BaseException | None) -> int:
    """The exit code a run ended by ``error`` gets, as the shell would show it: 0 for none, 130
    for Ctrl-C (``KeyboardInterrupt``: 128 + SIGINT), ``SystemExit``'s own code (143 after our
    SIGTERM handler), 1 for any other exception."""
    if error is None:
        return 0
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(error, SystemExit):
        code = error.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def exit_code_now() -> int:
    """The exit code of a process whose interpreter is exiting: 128 + signal after SIGTERM; else
    what ended the main program, which Python keeps in ``sys.last_value`` when an exception was
    uncaught (Ctrl-C: 130; any other: 1; an interactive session's last error does not count)."""
    if _exit_code_at_exit:
        return _exit_code_at_exit
    if hasattr(sys, "ps1"):
        return 0
    error = getattr(sys, "last_value", None)
    return exit_code_for(error) if isinstance(error, BaseException) else 0


# Flush this process's open runs (each sink's queue delivered, or spooled after its attempts),
# waiting at most the given seconds.
FlushOpenRuns = Callable[[float], None]
_flush_open_runs: FlushOpenRuns = lambda timeout_s: None  # noqa: E731 - until a run installs

_sigterm_installed = False
_sigterm_previous: Any = signal.SIG_DFL  # what SIGTERM did before ours, restored in a forked child


def _on_sigterm(signum: int, frame: Any) -> None:
    global _exit_code_at_exit
    _exit_code_at_exit = 128 + signum
    _main_thread_unwinds.set()
    if _finishing_in_main_thread:
        # finish() is draining (a slow endpoint): unwinding now would leave its queues unspooled
        # and print no summary.  Every drain stops waiting instead, what is left is spooled, and
        # finish() raises SystemExit(143) once it is done (``sigterm_during_finish``).
        HURRY.set()
        return
    raise SystemExit(128 + signum)


_finishing_in_main_thread = False


@contextlib.contextmanager
def finishing() -> Iterator[None]:
    """Around a run's ``finish()``: in the main thread, SIGTERM hurries it instead of unwinding it."""
    global _finishing_in_main_thread
    if threading.current_thread() is not threading.main_thread() or _finishing_in_main_thread:
        yield
        return
    _finishing_in_main_thread = True
    try:
        yield
    finally:
        _finishing_in_main_thread = False


def sigterm_during_finish() -> bool:
    """SIGTERM came while a run finished; the caller of ``finish()`` ends with ``SystemExit(143)``
    unless the interpreter is exiting already (then the exit code stays the program's)."""
    return HURRY.is_set() and not _interpreter_exiting


_interpreter_exiting = False


def finish_on_sigterm(finish_open_runs: FinishOpenRuns, flush_open_runs: FlushOpenRuns) -> None:
    """SIGTERM (what a scheduler sends before it kills a job) ends the process through ``SystemExit``
    instead of killing it on the spot: the main thread unwinds (``with Tracking(...)`` blocks and
    open ``trace_state`` spans end, holding no lock), then the exit hook above finishes every open
    run with exit code 128 + SIGTERM, flushed.

    An application that handles SIGTERM itself (a "checkpoint, then exit" handler, installed
    before ``Tracking()`` or after it) keeps the decision: no handler of ours is installed over
    one of its own, and when it replaced ours, the watcher below never ends the process; on
    SIGTERM it only flushes the open runs, so their data is delivered or spooled whatever the
    application does next.  One that ignores SIGTERM is left alone.  Only the main thread can
    install handlers."""
    global _sigterm_installed, _finish_open_runs, _flush_open_runs, _sigterm_previous
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return
    _finish_open_runs, _flush_open_runs = finish_open_runs, flush_open_runs
    _sigterm_previous = previous
    if not callable(previous):  # SIG_DFL (or None: installed outside Python): ours
        signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm_installed = True
    _watch_sigterm()


# A main thread blocked in native code (a hung NCCL collective) runs no Python signal handler until
# that call returns, so the handler above would make SIGTERM weaker than it is without us.  Python's
# C-level handler still writes the signal number to the wakeup fd at once: a watcher thread reads it
# and, if the process has not ended SIGTERM_GRACE_S later, finishes the open runs briefly (the file
# sink is already on disk; queued items are spooled; the bridge process delivers what it holds)
# and ends the process with 128 + SIGTERM.  When the handler did run (the usual case), the clean
# path above finishes the runs, bounded by their own finish timeout, and the watcher does nothing.
SIGTERM_GRACE_S = 3.0
_main_thread_unwinds = threading.Event()  # the Python handler ran: the normal, clean path is under way


_wakeup_pipe: tuple[int, int] | None = None  # (read, write) of the watcher's wakeup fd


def _watch_sigterm() -> None:
    global _wakeup_pipe
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread after all
        os.close(read_fd)
        os.close(write_fd)
        return
    if previous != -1:  # someone else's wakeup fd (asyncio's): theirs stays, no watcher
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _wakeup_pipe = (read_fd, write_fd)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data:
                continue
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                timer = threading.Timer(SIGTERM_GRACE_S, _end_after_sigterm)
                timer.daemon = True
                timer.start()
            else:  # the application's handler decides; our data is made safe meanwhile
                threading.Thread(
                    target=_flush_open_runs, args=(SIGTERM_FLUSH_S,), name="otel-tracking-sigterm-flush", daemon=True
                ).start()

    threading.Thread(target=watch, name="otel-tracking-sigterm", daemon=True).start()


SIGTERM_FLUSH_S = 10.0  # how long the flush on an application-handled SIGTERM waits, at most


def _after_fork_in_child() -> None:
    """A forked child (a ``multiprocessing`` worker, a DataLoader worker, a Pool) is not the
    training process: it must not write the parent's wakeup pipe (a SIGTERM to the child would
    reach the parent's watcher, which would end the parent), nor turn SIGTERM into ``SystemExit``
    where the parent's program had the default.  Its inherited copy of the pipe is closed, the
    wakeup fd and SIGTERM's disposition are what they were before ``Tracking()``; the runs it
    inherited are the parent's, which the exit hook leaves alone (``run.py`` checks the pid)."""
    global _wakeup_pipe, _sigterm_installed, _exit_code_at_exit, _main_thread_unwinds
    if _wakeup_pipe is not None:
        read_fd, write_fd = _wakeup_pipe
        _wakeup_pipe = None
        try:
            current = signal.set_wakeup_fd(-1)
            if current != write_fd:  # someone else's since: theirs stays
                signal.set_wakeup_fd(current)
        except ValueError:  # (not the main thread: the wakeup fd stays set, so the pipe stays open)
            pass
        else:
            for fd in (read_fd, write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
    if _sigterm_installed:
        with contextlib.suppress(ValueError, TypeError):
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, _sigterm_previous)
    _sigterm_installed = False
    _exit_code_at_exit = 0
    _main_thread_unwinds = threading.Event()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _end_after_sigterm() -> None:
    """The main thread did not unwind within the grace period: finish what can be finished in a
    bounded time, then end the process as SIGTERM would have."""
    if _main_thread_unwinds.is_set():
        return
    code = 128 + signal.SIGTERM
    logger.warning("otel-tracking: SIGTERM, and the main thread is blocked; ending the process (exit %d)", code)
    finisher = threading.Thread(target=_finish_open_runs, args=(code, 1.0), daemon=True)
    finisher.start()
    finisher.join(SIGTERM_GRACE_S)
    os._exit(code)
