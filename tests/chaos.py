"""Process-level chaos: SIGKILL the training process or the bridge process at a random step, the
bridge process while it starts (0.3 s after it appears), or a tracker SDK that crashes in native code
as the bridge process imports it; with real MLflow (sqlite) and TensorBoard, then `otel-tracking
replay`; check what every backend holds.

The rule being checked: every step whose ``log()`` returned (the file sink has it: it is written
inline) is in MLflow exactly once per (key, step), with its value, and in TensorBoard at least once;
steps never handed over (after a SIGKILL of the training process) are not expected anywhere.

    python -m tests.chaos --runs 20          # outside CI: repeat, print the counts (every fault in turn)
    tests/test_chaos.py                      # inside CI: a few fixed seeds, and each start fault once
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS = 60
# Who is hurt: the training process or the bridge process at a random step (the victims a seed
# picks), the bridge process 0.3 s into its start, or a tracker SDK crashing at its import.
AT_A_STEP = ("training", "bridge")
AT_THE_START = ("bridge-at-start", "sdk-import-crash")
VICTIMS = AT_A_STEP + AT_THE_START
# The crashing SDK: a package named like MLflow's ahead of it on the path (the training process never
# imports a tracker SDK; the bridge process, which takes its path, does).
CRASHING_SDK = "import ctypes\nctypes.string_at(0)  # SIGSEGV, in C\n"

TRAINING = textwrap.dedent(
    """
    import sys, time
    from otel_tracking import Tracking, trace_state

    t = Tracking("chaos", "run", default_backend=["file", "mlflow", "tensorboard"])
    link = t.logger["mlflow"].link
    print("bridge", link.process.pid, flush=True)
    for step in range(int(sys.argv[1])):
        with trace_state("rollout", step=step):
            t.log({"loss": 1.0 / (step + 1), "x": float(step)}, step)
        # "handed": the step left this process (written to the pipe). A SIGKILL loses what is still
        # in its memory, so the check holds the trackers to the steps handed over before the kill.
        assert link.wait_handed(60)
        print("logged", step, flush=True)
        time.sleep(0.01)
    t.finish()
    print("finished", flush=True)
    """
)


def _value(key: str, step: int) -> float:
    return 1.0 / (step + 1) if key == "loss" else float(step)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie child of a dead parent is reaped by init; treat "Z" as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"process {pid} still runs {timeout_s:.0f} s after its parent died")
        time.sleep(0.05)


def _wait_child(parent: int, timeout_s: float) -> set[int]:
    """The child processes of ``parent``, once it has one."""
    from tests.servers import live_children

    deadline = time.monotonic() + timeout_s
    while not (children := live_children(parent)):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {parent} started no bridge process within {timeout_s:.0f} s")
        time.sleep(0.01)
    return children


def run_once(seed: int, root: Path, victim: str | None = None) -> dict[str, Any]:
    """One run: hurt ``victim`` (one of VICTIMS; by default the seed picks 'training' or 'bridge',
    killed after a random step), replay, read back."""
    rng = random.Random(seed)
    picked = rng.choice(list(AT_A_STEP))
    victim = victim or picked
    kill_after = rng.randrange(2, STEPS - 5)
    root.mkdir(parents=True, exist_ok=True)
    path = str(REPO)
    if victim == "sdk-import-crash":
        (root / "crashing-sdk" / "mlflow").mkdir(parents=True, exist_ok=True)
        (root / "crashing-sdk" / "mlflow" / "__init__.py").write_text(CRASHING_SDK)
        path = os.pathsep.join([str(root / "crashing-sdk"), path])
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLFLOW_", "TENSORBOARD_"))},
        "PYTHONPATH": path,
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "TENSORBOARD_DIR": str(root / "tb"),
        "OTEL_TRACKING_SPOOL_DIR": str(root / "spool"),
        "OTEL_TRACKING_FINISH_TIMEOUT": "60",
        # Tracking() waits until MLflow has opened: a kill in the middle of MLflow creating its
        # sqlite schema (seconds on a loaded machine) leaves a database MLflow itself cannot open
        # again ("table ... already exists"), which is MLflow's failure, not the one tested here.
        "OTEL_TRACKING_START_TIMEOUT": "120",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINING, str(STEPS)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    bridge = 0
    if victim == "bridge-at-start":
        children = _wait_child(process.pid, 120)
        time.sleep(0.3)  # the fault's timing: the bridge process is starting, no tracker is open
        for pid in children:
            os.kill(pid, signal.SIGKILL)
    read = []
    for line in process.stdout:
        read.append(line)
        if line.startswith("bridge "):
            bridge = int(line.split()[1])
        elif line.startswith("logged ") and int(line.split()[1]) >= kill_after and victim in AT_A_STEP:
            os.kill(process.pid if victim == "training" else bridge, signal.SIGKILL)
            break
    out, err = process.communicate(timeout=300)
    out = "".join(read) + out
    if victim != "training":  # training goes on without its bridge process, and finishes
        assert process.returncode == 0 and "finished" in out, err
    if victim in AT_THE_START:
        assert err.count("the bridge process exited") == 1, err  # one warning, no error
    _wait_gone(bridge, 120)  # after the training process's death, it delivers what it had, then exits
    replay = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(root / "spool")],
        cwd=root,
        env={**env, "PYTHONPATH": str(REPO)},  # the real SDKs
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A killed training process had handed over the steps up to kill_after (and maybe more); a
    # killed bridge process leaves the training process alive to spool everything it logged.
    handed = kill_after if victim == "training" else None
    result = check(root, env, handed)
    return {"seed": seed, "victim": victim, "kill_after": kill_after, **result, "replay": replay.returncode}


def check(root: Path, env: dict[str, str], handed: int | None = None) -> dict[str, Any]:
    """What the backends hold, against the steps whose log() returned (the file sink's), or only
    those up to ``handed`` (the steps the killed training process had handed over)."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = (root / "chaos" / "run.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(len(steps))), "the file sink holds every step whose log() returned"
    if handed is not None:
        assert len(steps) > handed, "the file sink holds every step handed over"
        steps = steps[: handed + 1]

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    (experiment,) = [e for e in client.search_experiments() if e.name == "chaos"]
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "replay reattached to the same MLflow run"
    run_id = runs[0].info.run_id
    mlflow_points = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in ("loss", "x")
    }
    missing = duplicated = wrong = 0
    for key, points in mlflow_points.items():
        by_step: dict[int, list[float]] = {}
        for step, value in points:
            by_step.setdefault(step, []).append(value)
        for step in steps:
            values = by_step.get(step, [])
            missing += not values
            duplicated += len(values) > 1
            wrong += any(abs(v - _value(key, step)) > 1e-9 for v in values)

    accumulator = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    tb_steps = {event.step for event in accumulator.Scalars("loss")} if "loss" in tags else set()
    return {
        "logged": len(steps),
        "mlflow_missing": missing,
        "mlflow_duplicated": duplicated,
        "mlflow_wrong": wrong,
        "tensorboard_missing": len(set(steps) - tb_steps),
        "mlflow_status": runs[0].info.status,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    args = parser.parse_args()
    totals = {"runs": 0, "logged": 0, "mlflow_missing": 0, "mlflow_duplicated": 0, "tensorboard_missing": 0}
    for seed in range(args.seed, args.seed + args.runs):
        with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:  # every fault in turn; the seed times it
            result = run_once(seed, Path(tmp), VICTIMS[seed % len(VICTIMS)])
        print(json.dumps(result), flush=True)
        totals["runs"] += 1
        for key in ("logged", "mlflow_missing", "mlflow_duplicated", "tensorboard_missing"):
            totals[key] += result[key]
    print(json.dumps({"totals": totals}))
    return 0 if not (totals["mlflow_missing"] or totals["mlflow_duplicated"] or totals["tensorboard_missing"]) else 1


if __name__ == "__main__":
    sys.exit(main())
