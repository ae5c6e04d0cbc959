"""What the stall watcher costs a process where nothing is stuck (issue 32's bound: under 0.2% of a
core, and no measurable time added to a span).

    python bench/bench_stalls.py                 # prints a table; --out FILE writes it as markdown too

1. **Idle CPU.** A child process opens a run (file sink), opens ``--spans`` phases in as many
   threads and leaves them open for ``--seconds``, the main thread asleep: its CPU time (user +
   system, ``time.process_time``) with the watcher on (``OTEL_TRACKING_STALL_AFTER`` unset: the learned
   bound) and off (``=0``), as a share of one core.  The difference is the watcher's.
2. **Per span.** ``trace_state`` enter and exit in a loop, watcher on and off, beside the SDK's own
   ``start_span``/``end`` on a bare ``TracerProvider``; the best of five runs of ``--n`` spans.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

IDLE = textwrap.dedent(
    """
    import json, sys, threading, time
    from otel_tracking import Tracking, trace_state

    spans, seconds = int(sys.argv[1]), float(sys.argv[2])
    t = Tracking("bench", "stalls", default_backend=["file"])
    release = threading.Event()

    def phase(i):
        with trace_state(f"phase_{i}", step=1):
            release.wait()

    threads = [threading.Thread(target=phase, args=(i,)) for i in range(spans)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # settled
    before, started = time.process_time(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = time.process_time(), time.monotonic() - started
    release.set()
    for thread in threads:
        thread.join()
    t.finish()
    print(json.dumps({"cpu_s": after - before, "elapsed_s": elapsed}))
    """
)

PER_SPAN = textwrap.dedent(
    """
    import json, sys, time
    n, which = int(sys.argv[1]), sys.argv[2]
    if which == "sdk":
        from opentelemetry.sdk.trace import TracerProvider
        tracer = TracerProvider().get_tracer("bench")
        def one():
            tracer.start_span("update").end()
    else:
        from otel_tracking import Tracking, trace_state
        t = Tracking("bench", "stalls", default_backend=["file"])
        t.log({"x": 1.0}, 1)
        def one():
            with trace_state("update"):
                pass
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            one()
        best = min(best, (time.perf_counter() - started) / n)
    print(json.dumps({"per_span_us": best * 1e6}))
    """
)


def _run(script: str, args: list[str], stall_after: str | None, root: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(VERL_FILE_LOGGER_ROOT=str(root), OTEL_TRACKING_SPOOL_DIR=str(root / "spool"))
    if stall_after is not None:
        env["OTEL_TRACKING_STALL_AFTER"] = stall_after
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        idle = {
            name: _run(IDLE, [str(args.spans), str(args.seconds)], after, root)
            for name, after in (("on", None), ("off", "0"))
        }
        spans = {
            name: _run(PER_SPAN, [str(args.n), which], after, root)
            for name, which, after in (("on", "ours", None), ("off", "ours", "0"), ("sdk", "sdk", None))
        }
    share = {name: 100 * r["cpu_s"] / r["elapsed_s"] for name, r in idle.items()}
    lines = [
        f"# Stall watcher cost ({platform.python_version()}, {os.cpu_count()} cores)",
        "",
        f"Idle: {args.spans} phases open for {args.seconds:g} s, main thread asleep (CPU time / wall time, one core):",
        "",
        "| watcher | CPU, % of a core |",
        "|---|---|",
        f"| on (learned bound) | {share['on']:.4f} |",
        f"| off (`OTEL_TRACKING_STALL_AFTER=0`) | {share['off']:.4f} |",
        f"| **the watcher's share** | **{share['on'] - share['off']:.4f}** |",
        "",
        f"Per span (`trace_state` enter and exit, best of 5 x {args.n}):",
        "",
        "| | µs per span | vs the SDK alone |",
        "|---|---|---|",
    ]
    sdk = spans["sdk"]["per_span_us"]
    for name, label in (("on", "trace_state, watcher on"), ("off", "trace_state, watcher off"), ("sdk", "SDK span")):
        us = spans[name]["per_span_us"]
        lines.append(f"| {label} | {us:.2f} | {us / sdk:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
