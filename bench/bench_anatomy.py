"""What the step anatomy costs the training loop: a step of five phases (``step`` enclosing
``gen`` with four lanes, ``old_log_prob``, ``update_actor``) and one ``log()`` of 30 metrics, with
``OTEL_TRACKING_ANATOMY=1`` and ``=0``, each in a process of its own, alternating rounds; file and
console sinks (bench_log.py's case a).  The anatomy's work happens when a step's root ends (at the
next step's first phase), so both are timed: ``log()`` alone and the whole step's own overhead
(the loop does no work of its own).

    python bench/bench_anatomy.py [--steps 2000] [--rounds 3]

Writes bench/results/<UTC date>-anatomy.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

ONE_RUN = """
import json, sys, time
from otel_tracking import Tracking, trace_state
steps = int(sys.argv[1])
t = Tracking("bench", "anatomy", default_backend=["file", "console"])
metrics = {f"actor/metric_{i}": float(i) for i in range(30)}
log_s, step_s = [], []
for step in range(1, steps + 1):
    started = time.perf_counter()
    with trace_state("step"):
        with trace_state("gen"):
            for lane in range(4):
                with trace_state("generate", state_lane_id=lane):
                    pass
        with trace_state("old_log_prob"):
            pass
        with trace_state("update_actor"):
            pass
    before = time.perf_counter()
    t.log(metrics, step)
    done = time.perf_counter()
    log_s.append(done - before)
    step_s.append(done - started)
t.finish()
print(json.dumps({"log": log_s, "step": step_s}))
"""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one(anatomy: str, steps: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
        env.update(OTEL_TRACKING_ANATOMY=anatomy, OTEL_TRACKING_SPOOL_DIR=str(Path(tmp) / "spool"))
        done = subprocess.run(
            [sys.executable, "-c", ONE_RUN, str(steps)], env=env, cwd=tmp, capture_output=True, text=True, check=True
        )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows: dict[str, dict[str, list[float]]] = {
        name: {"log": [], "log99": [], "step": [], "step99": []} for name in ("off", "on")
    }
    for _ in range(args.rounds):
        for name, value in (("off", "0"), ("on", "1")):
            got = one(value, args.steps)
            for key in ("log", "step"):
                rows[name][key].append(percentile(got[key], 0.5) * 1e6)
                rows[name][f"{key}99"].append(percentile(got[key], 0.99) * 1e6)
    table = {name: {key: statistics.median(values) for key, values in row.items()} for name, row in rows.items()}
    lines = [
        f"# bench_anatomy ({time.strftime('%Y-%m-%d', time.gmtime())})",
        "",
        f"`python bench/bench_anatomy.py --steps {args.steps} --rounds {args.rounds}`, load average {load:.2f} at the "
        "start; µs, the median over rounds of each round's percentile.",
        "",
        "| anatomy | log() p50 | log() p99 | step p50 | step p99 |",
        "|---|---|---|---|---|",
    ]
    for name in ("off", "on"):
        t = table[name]
        lines.append(f"| {name} | {t['log']:.1f} | {t['log99']:.1f} | {t['step']:.1f} | {t['step99']:.1f} |")
    off, on = table["off"], table["on"]
    lines.append(
        f"| **on/off** | **{on['log'] / off['log']:.2f}x** | **{on['log99'] / off['log99']:.2f}x** "
        f"| **{on['step'] / off['step']:.2f}x** | **{on['step99'] / off['step99']:.2f}x** |"
    )
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{time.strftime('%Y-%m-%d', time.gmtime())}-anatomy"
    stem.with_suffix(".json").write_text(json.dumps({"load": load, "steps": args.steps, "table": table}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
