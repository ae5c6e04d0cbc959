"""Where each step went (issue 33), on verl's own classes switched on from outside: 4 actor ranks
of a real ``RayWorkerGroup`` where rank 3's ``update_actor`` takes 0.6 s and the others' 0.2 s, a
0.3 s ``gen`` on the driver and 0.3 s of every step in no phase (``run_anatomy.py``).  The file
sink gets each step's anatomy at that step (in its events file; its metrics file keeps verl's one
line per step); the worker spans still arrive under their phase."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from otel_tracking.exporters.file import read_anatomy
from tests.otlp_receiver import HttpReceiver, wait_for

HERE = Path(__file__).resolve().parent
UPDATE_S = (0.2, 0.2, 0.2, 0.6)
STEPS = 3


def test_each_steps_anatomy_names_the_straggler_and_agrees_with_the_loops_timings(cluster: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "RAY_ADDRESS", "LOOP_"))}
    with HttpReceiver() as receiver:
        env.update(
            PYTHONPATH=os.pathsep.join((str(HERE), str(HERE.parent.parent))),  # this checkout's code
            VERL_FILE_LOGGER_PATH=str(tmp_path / "metrics.jsonl"),
            OTEL_TRACKING_SPOOL_DIR=str(tmp_path / "spool"),
            OTEL_TRACKING_VERL="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            LOOP_UPDATE_S=",".join(map(str, UPDATE_S)),
        )
        command = [
            sys.executable,
            str(HERE / "run_anatomy.py"),
            "--address",
            cluster,
            "--out",
            str(tmp_path / "r.json"),
        ]
        done = subprocess.run(
            [*command, "--steps", str(STEPS)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-4000:]

        def worker_spans() -> list[dict[str, Any]] | None:
            spans = receiver.received.spans()
            updates = [s for s in spans if s["name"] == "actor_update"]
            return spans if len(updates) >= 4 * (STEPS + 1) else None

        spans = wait_for(worker_spans, timeout_s=120, what="every rank's actor_update span")
        # the workers export only over OTLP: what arrived, as a collector's file exporter writes it
        receiver.received.write_traces_as_otlp_json(tmp_path / "workers.otlp.jsonl")
    own = json.loads((tmp_path / "r.json").read_text())["own"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1)), lines  # verl's one line per step
    anatomy = read_anatomy(tmp_path / "metrics.jsonl")  # beside it, in the events file
    assert sorted(anatomy) == list(range(1, STEPS + 1)), anatomy  # each step, at that step

    for step, timings in enumerate(own, start=1):
        got = anatomy[step]
        # the straggler of update_actor: rank 3, 0.4 s behind the median rank
        assert got["anatomy/update_actor/straggler_rank"] == 3, got
        assert abs(got["anatomy/update_actor/straggler_lag_s"] - 0.4) <= 0.15, got
        # goodput: gen and update_actor are productive; the rest of the step's wall time is not
        wall_s = timings["wall_s"]
        assert abs(got["anatomy/step_s"] - wall_s) <= 0.08 * wall_s, (got, timings)
        goodput = (timings["gen"] + timings["update_actor"]) / wall_s
        assert abs(got["anatomy/goodput"] - goodput) <= 0.08, (got, timings)
        assert abs(got["anatomy/idle_frac"] - (1 - goodput)) <= 0.08, (got, timings)
        # the actor role's busy share: the mean over its 4 ranks of the time each took in update_actor
        assert [round(s, 1) for s in timings["ranks_s"]] == list(UPDATE_S), timings
        assert abs(got["anatomy/actor/busy_frac"] - statistics.mean(timings["ranks_s"]) / wall_s) <= 0.08, (
            got,
            timings,
        )
        total = sum(got[f"anatomy/{k}"] for k in ("goodput", "overhead_frac", "wasted_frac", "idle_frac"))
        assert abs(total - 1) < 1e-3, got

    # every worker span still arrives under its phase: each rank's actor_update of each step under
    # the driver's update_actor (the warm-up call before the first step was sent under no phase)
    by_id = {s["span_id"]: s for s in spans}
    updates = [s for s in spans if s["name"] == "actor_update"]
    under = [s for s in updates if by_id.get(s["parent_span_id"], {}).get("name") == "update_actor"]
    assert sorted(s["resource"]["ml.rank"] for s in under) == sorted(list(range(4)) * STEPS), updates
    for span in under:
        parent = by_id[span["parent_span_id"]]
        assert parent["resource"]["process.pid"] != span["resource"]["process.pid"]
        assert parent["trace_id"] == span["trace_id"]  # one trace per step

    # the picture of step 2: the driver's phases on top, a lane per rank, rank 3 the straggler
    timeline = [sys.executable, "-m", "otel_tracking", "timeline", "metrics.events.jsonl", "workers.otlp.jsonl"]
    drawn = subprocess.run(
        [*timeline, "--steps", "2", "--out", "step2"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert drawn.returncode == 0, drawn.stderr
    lag = re.search(r"straggler: step 2 update_actor: actor rank 3 / lane rank_3, \+([\d.]+) s", drawn.stdout)
    assert lag and abs(float(lag.group(1)) - 0.4) <= 0.15, drawn.stdout
    rank_lanes = [f"actor rank {r} / lane rank_{r}" for r in range(4)]
    trace = json.loads((tmp_path / "step2.json").read_text())
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(threads.values()) == {"driver", *rank_lanes}, threads
    complete = [e for e in events if e["ph"] == "X"]
    by_name = {e["name"]: e for e in complete if threads[(e["pid"], e["tid"])] == "driver"}
    assert {"ml.step", "step", "gen", "update_actor"} <= set(by_name)
    phase = by_name["update_actor"]
    for event in (e for e in complete if e["name"] == "actor_update"):  # nested in time under their phase
        assert phase["ts"] <= event["ts"] and event["ts"] + event["dur"] <= phase["ts"] + phase["dur"] + 1000
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (tmp_path / "step2.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    lanes = re.findall(r'<text class="lane"[^>]*>([^<]*)</text>', dom)
    assert lanes == ["driver", *rank_lanes], lanes
    assert "straggler actor rank 3 / lane rank_3" in dom
