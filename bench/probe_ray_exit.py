"""What Ray does to an actor's process when the driver ends it: which Python code still runs.

    python bench/probe_ray_exit.py                    # every case, about a minute
    python bench/probe_ray_exit.py shutdown kill      # some cases only

Each case is a driver of its own (this file run with ``--driver CASE``) on a fresh local cluster
(``ray.init(num_cpus=2)``) with two probe actors.  Each actor registers everything a library could
hope to run at the end (an ``atexit`` hook, ``threading``'s exit hook, a ``multiprocessing``
finalizer, a SIGTERM handler chained before Ray's) and a heartbeat thread writing every 10 ms;
each writes one line per event to a shared file (``O_APPEND``, unbuffered).  The driver then:

  shutdown    ``ray.shutdown()``
  exit        returns from its script (Ray's own ``atexit`` hook calls ``ray.shutdown()``)
  kill        ``ray.kill(actor)``
  terminate   ``actor.__ray_terminate__.remote()`` (a graceful exit)
  dropped     drops its last handles to the actors (Ray ends an actor nobody can call)
  async       ``ray.shutdown()`` with async actors (their methods run in a thread of their own)

In every other case the driver holds the handles until the end (as a module-level
``workers = [...]`` does).

The table says, per case, what ran in each actor and how long it was still alive (its last
heartbeat) after the driver's call started.  Ray's own reason for the exit is in the workers'
``python-core-worker-*.log`` of the session (``/tmp/ray/session_latest/logs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("shutdown", "exit", "kill", "terminate", "dropped", "async")
_handles: list[Any] = []  # the driver's actor handles, held as a script's globals are
HOOKS = ("sigterm", "threading-exit-hook", "mp-finalize", "atexit")


def note(log: str, what: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{time.time():.4f} {os.getpid()} {what}\n".encode())
    finally:
        os.close(fd)


def install_probes(log: str) -> None:
    """Everything that could run at the end, each writing a line when it does."""
    import atexit
    import multiprocessing.util
    import signal
    import threading

    atexit.register(note, log, "atexit")
    threading._register_atexit(note, log, "threading-exit-hook")  # type: ignore[attr-defined]
    multiprocessing.util.Finalize(None, note, args=(log, "mp-finalize"), exitpriority=100)
    try:
        ray_handler = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            note(log, "sigterm")
            if callable(ray_handler):
                ray_handler(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: an async actor's methods
        note(log, "no-signal-handler")

    def beat() -> None:
        while True:
            note(log, "beat")
            time.sleep(0.01)

    threading.Thread(target=beat, daemon=True).start()


def driver(case: str, log: str) -> None:
    import ray

    @ray.remote
    class Probe:
        def __init__(self) -> None:
            install_probes(log)

        def pid(self) -> int:
            return os.getpid()

    @ray.remote
    class AsyncProbe:
        async def setup(self) -> int:
            install_probes(log)
            return os.getpid()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    if case == "async":
        actors = [AsyncProbe.remote() for _ in range(2)]
        ray.get([a.setup.remote() for a in actors])
    else:
        actors = [Probe.remote() for _ in range(2)]
        ray.get([a.pid.remote() for a in actors])
    _handles.extend(actors)
    del actors
    time.sleep(0.5)  # heartbeats under way
    note(log, "driver-call")
    if case in ("shutdown", "async"):
        ray.shutdown()
    elif case == "kill":
        for actor in _handles:
            ray.kill(actor)
    elif case == "terminate":
        for actor in _handles:
            actor.__ray_terminate__.remote()
    elif case == "dropped":
        _handles.clear()
    note(log, "driver-returned")
    if case in ("kill", "terminate", "dropped"):
        time.sleep(3.0)  # the actors are gone or not by then; the cluster goes after
        ray.shutdown()


def run_case(case: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="probe-ray-exit-") as tmp:
        log = str(Path(tmp) / "events.log")
        done = subprocess.run(
            [sys.executable, __file__, "--driver", case, log], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise RuntimeError(f"{case}: driver exited {done.returncode}: {done.stderr[-2000:]}")
        time.sleep(2.0)  # a process still unwinding after the driver is gone writes its last lines
        events = [line.split(" ", 2) for line in Path(log).read_text().splitlines()]
    driver_pid = {pid for _, pid, what in events if what == "driver-call"}
    call = next(float(t) for t, _, what in events if what == "driver-call")
    returned = next(float(t) for t, _, what in events if what == "driver-returned")
    actors: dict[str, dict[str, Any]] = {}
    for t, pid, what in events:
        if pid in driver_pid:
            continue
        actor = actors.setdefault(pid, {"ran": [], "last_beat_ms": None})
        if what == "beat":
            actor["last_beat_ms"] = (float(t) - call) * 1e3
        elif what not in actor["ran"]:
            actor["ran"].append(what)
    return {"case": case, "driver_call_ms": (returned - call) * 1e3, "actors": actors}


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | driver's call took (ms) | actor | ran at the end | alive after the driver's call started (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for i, actor in enumerate(r["actors"].values()):
            ran = ", ".join(actor["ran"]) or "nothing"
            beat = actor["last_beat_ms"]
            lines.append(
                f"| {r['case'] if i == 0 else ''} | {r['driver_call_ms']:.0f} | {i} | {ran} | "
                f"{'?' if beat is None else f'{beat:.0f}'} |"
            )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--driver":
        driver(sys.argv[2], sys.argv[3])
        return 0
    cases = sys.argv[1:] or list(CASES)
    unknown = set(cases) - set(CASES)
    if unknown:
        print(f"unknown case(s): {', '.join(sorted(unknown))}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    import ray

    print(f"Ray {ray.__version__}, Python {sys.version.split()[0]}")
    results = [run_case(case) for case in cases]
    print(render(results))
    print(json.dumps(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
