"""Time to land: from the first ``log()`` to everything readable through the tracker's own reader.

    python bench/bench_land.py                          # MLflow, burst and paced, 3 rounds each
    python bench/bench_land.py --trackers mlflow,tensorboard --rounds 5
    python bench/bench_land.py --trackers swanlab,clearml --label land-sc

Trackers: mlflow, tensorboard, wandb, trackio, swanlab, clearml.

For each tracker, in one run and alternating round by round: the tracker's own client doing the
work, and ``Tracking([tracker])`` doing the same.  Two workloads:

  burst  --steps steps of --metrics metrics logged back to back, then the end call
  paced  --paced-steps steps, one every --pace-ms (a training step's compute), then the end call

The clock starts at the first ``log()`` (the run is open before: ``Tracking()``, the bridge
process opening the tracker, and the tracker's own ``start_run``/``init`` are outside it) and
stops once the end call has returned *and* every (key, step, value) is readable through the
tracker's reader (MLflow: ``get_metric_history`` of every key; read until complete, the reading
time counted only while something is still missing).  A round that does not find every point
exactly once fails the run.  Each side first runs one unmeasured round of 5 steps.

MLflow runs against a real ``mlflow server`` (sqlite store, --mlflow-workers workers, loopback).
Its own client is the asynchronous one (``mlflow.log_metrics(..., synchronous=False)`` then
``mlflow.end_run()``): it merges queued calls into requests of up to 1,000 metrics.

The other trackers write local files, read back with their own readers (each class says how):

  tensorboard  ``EventFileWriter``, one event per step, ``close()``; ``EventAccumulator``
  wandb        ``wandb.init(mode="offline")``, ``run.log``, ``run.finish()``; the run's ``.wandb`` file
  trackio      ``trackio.init(embed=False)``, ``trackio.log``, ``trackio.finish()``; ``SQLiteStorage``
  swanlab      ``swanlab.init(mode="offline", log_dir=<abs>, reinit=True)``, ``swanlab.log``,
               ``swanlab.finish()``; the run's ``.swanlab`` record log (``tests/readers_swanlab.py``)
  clearml      ``Task.set_offline(True)``, ``Task.init``, ``logger.report_scalar(title, series, value,
               iteration)`` per value (a key split as our exporter splits it), ``task.close()``; the
               offline session's ``metrics.jsonl`` (``tests/readers_clearml.py``)

Results: bench/results/<date>-<--label>.json and .md (load average before and after noted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

# the same environment helper and verl-style workload as the log() benchmark
from bench.bench_log import env, workload  # noqa: E402 - the checkout's bench/ is importable once REPO is on the path


def play(data: list[dict[str, float]], log: Callable[[dict[str, float], int], None], pace_s: float) -> float:
    """Log every step (paced: one every ``pace_s``, counted from the first); the first log()'s time."""
    start = time.perf_counter()
    for step, values in enumerate(data):
        if pace_s:
            # Pacing stands for a training step's compute: wait until the step's slot, not for an event.
            delay = start + step * pace_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        log(values, step)
    return start


def opened(tracking: Any, timeout_s: float = 300.0) -> None:
    """Wait until the bridge process has opened every tracker: the tracker's own client has its
    run open (``start_run``, ``init``) before the clock starts too.  On a busy machine the open
    (importing the SDK at nice +10) can outlast ``Tracking()``'s start window."""
    deadline = time.monotonic() + timeout_s
    while any("opening" in where for where in tracking.where().values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still opening after {timeout_s} s: {tracking.where()}")
        time.sleep(0.1)  # polling a state the facade shows, not waiting for time to pass


# --- MLflow ------------------------------------------------------------------------------------


class Mlflow:
    name = "mlflow"

    def __init__(self, root: Path, workers: int) -> None:
        from tests.servers import MlflowServer

        self.server = MlflowServer(root / "mlflow-server", workers=workers).start(timeout_s=300)
        self.uri = self.server.uri
        self.count = 0

    def close(self) -> None:
        self.server.stop()

    def own(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        self.count += 1
        mlflow.set_experiment(f"own-{self.count}")
        run = mlflow.start_run()
        start = play(data, lambda values, step: mlflow.log_metrics(values, step=step, synchronous=False), pace_s)
        mlflow.end_run()
        return self.landed(start, run.info.run_id, data)

    def ours(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        from otel_tracking import Tracking

        self.count += 1
        with env(MLFLOW_TRACKING_URI=self.uri):
            tracking = Tracking(project_name=f"ours-{self.count}", experiment_name="land", default_backend=["mlflow"])
            opened(tracking)
            start = play(data, lambda values, step: tracking.log(values, step=step), pace_s)
            tracking.finish()
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri)
        experiment = client.get_experiment_by_name(f"ours-{self.count}")
        (run,) = client.search_runs([experiment.experiment_id])
        return self.landed(start, run.info.run_id, data)

    def landed(self, start: float, run_id: str, data: list[dict[str, float]]) -> tuple[float, int]:
        """(seconds from ``start`` until every point is readable, points read back); the points
        are checked exactly once each: a duplicate or a wrong value fails the round."""
        from mlflow.tracking import MlflowClient

        ended = time.perf_counter()
        client = MlflowClient(self.uri)
        expected = {(key, step): value for step, values in enumerate(data) for key, value in values.items()}
        keys = list(data[0])
        deadline, passes = ended + 120, 0
        while True:
            began, passes = time.perf_counter(), passes + 1
            seen: dict[tuple[str, int], list[float]] = {}
            for key in keys:
                for metric in client.get_metric_history(run_id, key):
                    seen.setdefault((metric.key, metric.step), []).append(metric.value)
            if len(seen) == len(expected) or time.perf_counter() > deadline:
                break
        wrong = [k for k, v in seen.items() if v != [expected.get(k)]]
        if wrong or len(seen) != len(expected):
            raise AssertionError(f"{len(seen)} of {len(expected)} points, {len(wrong)} wrong or repeated")
        # Complete at the first read: landed when the end call returned.  Else: when the read that
        # found it complete began.
        return (ended if passes == 1 else began) - start, len(seen)


def check(expected: dict[tuple[str, int], float], triples: list[tuple[str, int, Any]]) -> int:
    """Every (key, step, value) once: the points read back, or AssertionError."""
    seen: dict[tuple[str, int], list[float]] = {}
    for key, step, value in triples:
        seen.setdefault((key, step), []).append(value)
    wrong = [k for k, v in seen.items() if len(v) != 1 or abs(v[0] - expected.get(k, float("nan"))) > 1e-6]
    if wrong or len(seen) != len(expected):
        raise AssertionError(f"{len(seen)} of {len(expected)} points, {len(wrong)} wrong or repeated")
    return len(seen)


def expected_points(data: list[dict[str, float]]) -> dict[tuple[str, int], float]:
    return {(key, step): value for step, values in enumerate(data) for key, value in values.items()}


class Local:
    """A tracker that writes local files: the clock stops once the end call returned and the
    tracker's reader finds every point (polled until it does, for a tracker whose end call returns
    before its files are complete)."""

    name = ""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0

    def close(self) -> None:
        return None

    def read(self, where: Path) -> list[tuple[str, int, Any]]:  # pragma: no cover - per tracker
        raise NotImplementedError

    def landed(self, start: float, where: Path, data: list[dict[str, float]]) -> tuple[float, int]:
        ended = time.perf_counter()
        expected = expected_points(data)
        deadline, passes = ended + 120, 0
        while True:
            began, passes = time.perf_counter(), passes + 1
            try:
                return (ended if passes == 1 else began) - start, check(expected, self.read(where))
            except (AssertionError, OSError, StopIteration, ValueError):
                if time.perf_counter() > deadline:
                    raise

    def ours(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        from otel_tracking import Tracking

        self.count += 1
        where = self.root / f"ours-{self.count}"
        with env(**self.environment(where)):
            tracking = Tracking(project_name="land", experiment_name=f"ours-{self.count}", default_backend=[self.name])
            opened(tracking)
            start = play(data, lambda values, step: tracking.log(values, step=step), pace_s)
            tracking.finish()
        return self.landed(start, where, data)

    def environment(self, where: Path) -> dict[str, str]:  # pragma: no cover - per tracker
        raise NotImplementedError


class Tensorboard(Local):
    """Its own client: TensorBoard's ``EventFileWriter`` (torch's ``SummaryWriter`` writes through
    it), one event per step, closed at the end."""

    name = "tensorboard"

    def environment(self, where: Path) -> dict[str, str]:
        return {"TENSORBOARD_DIR": str(where)}

    def own(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.count += 1
        where = self.root / f"own-{self.count}"
        writer = EventFileWriter(str(where))

        def log(values: dict[str, float], step: int) -> None:
            summary = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
            )
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

        start = play(data, log, pace_s)
        writer.close()
        return self.landed(start, where, data)

    def read(self, where: Path) -> list[tuple[str, int, Any]]:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(where), size_guidance={"scalars": 0, "tensors": 0})
        accumulator.Reload()
        tags = accumulator.Tags()["scalars"]
        return [(tag, event.step, event.value) for tag in tags for event in accumulator.Scalars(tag)]


class Wandb(Local):
    """Its own client: ``wandb.init(mode="offline")``, ``run.log(values, step=...)``, ``run.finish()``;
    read back from the run's ``.wandb`` file (``tests/readers_wandb.py``)."""

    name = "wandb"

    def environment(self, where: Path) -> dict[str, str]:
        where.mkdir(parents=True, exist_ok=True)
        return {"WANDB_DIR": str(where)}

    def own(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        import wandb

        self.count += 1
        where = self.root / f"own-{self.count}"
        with env(**self.environment(where)):
            run = wandb.init(project="land", name=f"own-{self.count}", mode="offline", dir=str(where))
            start = play(data, lambda values, step: run.log(values, step=step), pace_s)
            run.finish()
        return self.landed(start, where, data)

    def read(self, where: Path) -> list[tuple[str, int, Any]]:
        from tests import readers_wandb

        files = readers_wandb.run_files(where)
        if len(files) != 1:
            raise AssertionError(f"{len(files)} runs in {where}")
        records = readers_wandb.read_records(files[0])
        if not any(r.WhichOneof("record_type") == "exit" for r in records):
            raise AssertionError("no exit record yet")
        return readers_wandb.load_run(files[0], timeout_s=1).triples()


class Trackio(Local):
    """Its own client: ``trackio.init(embed=False)``, ``trackio.log(values, step=...)``,
    ``trackio.finish()``; read back with its ``SQLiteStorage`` (under ``TRACKIO_DIR``, set for the
    whole bench before Trackio is imported)."""

    name = "trackio"

    def environment(self, where: Path) -> dict[str, str]:
        return {}

    def own(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        import trackio

        self.count += 1
        trackio.init(project="land", name=f"own-{self.count}", embed=False)
        start = play(data, lambda values, step: trackio.log(values, step=step), pace_s)
        trackio.finish()
        return self.landed(start, Path(f"own-{self.count}"), data)

    def ours(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        from otel_tracking import Tracking

        self.count += 1
        tracking = Tracking(project_name="land", experiment_name=f"ours-{self.count}", default_backend=["trackio"])
        opened(tracking)
        start = play(data, lambda values, step: tracking.log(values, step=step), pace_s)
        tracking.finish()
        return self.landed(start, Path(f"ours-{self.count}"), data)

    def read(self, where: Path) -> list[tuple[str, int, Any]]:
        from trackio.sqlite_storage import SQLiteStorage

        return [
            (key, row["step"], value)
            for row in SQLiteStorage.get_logs("land", str(where))
            for key, value in row.items()
            if key not in ("timestamp", "step")
        ]


class Swanlab(Local):
    """Its own client: ``swanlab.init(mode="offline", log_dir=<abs>, reinit=True)``,
    ``swanlab.log(values, step=...)``, ``swanlab.finish()``; read back from the run's ``.swanlab``
    record log (``tests/readers_swanlab.py``).  Ours writes under ``SWANLAB_LOG_DIR``."""

    name = "swanlab"

    def environment(self, where: Path) -> dict[str, str]:
        return {"SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(where)}

    def own(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        import swanlab

        self.count += 1
        where = self.root / f"own-{self.count}"
        swanlab.init(mode="offline", project="land", name=f"own-{self.count}", log_dir=str(where), reinit=True)
        start = play(data, lambda values, step: swanlab.log(values, step=step), pace_s)
        swanlab.finish()
        return self.landed(start, where, data)

    def read(self, where: Path) -> list[tuple[str, int, Any]]:
        from tests import readers_swanlab

        dirs = readers_swanlab.run_dirs(where)
        if len(dirs) != 1:
            raise AssertionError(f"{len(dirs)} runs in {where}")
        return readers_swanlab.read_run(dirs[0]).scalars


class Clearml(Local):
    """Its own client: ``Task.set_offline(True)``, ``Task.init(...)`` (no repository detection,
    resource monitor, stream or argparse hooks: ../shared/BACKENDS.md), one
    ``logger.report_scalar(title, series, value, iteration=step)`` per value, split as our exporter
    splits a key (``title_and_series``), then ``task.close()``; read back from the offline session's
    ``metrics.jsonl`` (``tests/readers_clearml.py``).  Ours writes its session under a ``HOME`` of
    its own (the bridge process is started with it); ``CLEARML_CONFIG_FILE`` (no reporting
    subprocess) is the bench's, for both."""

    name = "clearml"

    def environment(self, where: Path) -> dict[str, str]:
        where.mkdir(parents=True, exist_ok=True)
        return {"HOME": str(where), "CLEARML_OFFLINE_MODE": "1"}

    def own(self, data: list[dict[str, float]], pace_s: float) -> tuple[float, int]:
        from clearml import Task

        from otel_tracking.exporters.clearml import title_and_series

        self.count += 1
        Task.set_offline(True)
        task = Task.init(
            project_name="land",
            task_name=f"own-{self.count}",
            output_uri=False,
            auto_connect_frameworks={"detect_repository": False},
            auto_resource_monitoring=False,
            auto_connect_streams=False,
            auto_connect_arg_parser=False,
        )
        report = task.get_logger().report_scalar
        split = {key: title_and_series(key) for key in data[0]}

        def log(values: dict[str, float], step: int) -> None:
            for key, value in values.items():
                title, series = split[key]
                report(title, series, value, step)

        start = play(data, log, pace_s)
        folder = Path(task.get_offline_mode_folder())
        task.close()
        return self.landed(start, folder, data)

    def read(self, where: Path) -> list[tuple[str, int, Any]]:
        from tests import readers_clearml

        if not where.name.startswith("offline-"):  # ours: the one session under its HOME
            folders = readers_clearml.session_dirs(where)
            if len(folders) != 1:
                raise AssertionError(f"{len(folders)} ClearML sessions under {where}")
            where = folders[0]
        # Back from (title, series) to the key: the workload's keys all hold a '/', split at the first.
        return [
            (f"{title}/{series}" if title != series else title, step, value)
            for title, series, step, value in readers_clearml.read_session(where).user_scalars()
        ]


TRACKERS: dict[str, Callable[[Path, argparse.Namespace], Any]] = {
    "trackio": lambda root, args: Trackio(root),
    "mlflow": lambda root, args: Mlflow(root, args.mlflow_workers),
    "tensorboard": lambda root, args: Tensorboard(root),
    "wandb": lambda root, args: Wandb(root),
    "swanlab": lambda root, args: Swanlab(root),
    "clearml": lambda root, args: Clearml(root),
}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        for package in ("otel-tracking", "mlflow", "wandb", "tensorboard", "swanlab", "clearml", "trackio"):
            with contextlib.suppress(Exception):
                info[package] = version(package)
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"machine": machine(), "load_before": load(), "trackers": {}}
    workloads = {
        "burst": (workload(args.steps, args.metrics), 0.0),
        "paced": (workload(args.paced_steps, args.metrics), args.pace_ms / 1e3),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        from bench_log import local_backend_env

        base = {
            # MLflow's own HTTP retries stay at its default, for both sides alike.
            **{k: v for k, v in local_backend_env(root / "env").items() if k != "MLFLOW_HTTP_REQUEST_MAX_RETRIES"},
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "TRACKIO_DIR": str(root / "trackio"),
            "OTEL_TRACKING_SPOOL_DIR": str(root / "spool"),
            "OTEL_TRACKING_FINISH_TIMEOUT": "120",
        }
        with env(**base):
            for name in args.trackers.split(","):
                tracker = TRACKERS[name](root / name, args)
                results: dict[str, Any] = {}
                try:
                    # One unmeasured round of each side first: a client's first run in this process
                    # (MLflow's async logging starting, the first experiment on a fresh server)
                    # took up to 1.5x as long as its later ones, and the own client always went first.
                    for impl in ("own", "ours"):
                        getattr(tracker, impl)(workloads["burst"][0][:5], 0.0)
                    for label, (data, pace_s) in workloads.items():
                        times: dict[str, list[float]] = {"own": [], "ours": []}
                        points = 0
                        for round_ in range(args.rounds):
                            order = ("own", "ours") if round_ % 2 == 0 else ("ours", "own")
                            for impl in order:
                                seconds, points = getattr(tracker, impl)(data, pace_s)
                                times[impl].append(seconds)
                                print(f"{name} {label} {impl}: {seconds:.2f} s ({points} points)", file=sys.stderr)
                        own, ours = statistics.median(times["own"]), statistics.median(times["ours"])
                        results[label] = {
                            "steps": len(data),
                            "metrics": args.metrics,
                            "pace_ms": pace_s * 1e3,
                            "points": points,
                            "own_s": times["own"],
                            "ours_s": times["ours"],
                            "ratio": ours / own,
                        }
                finally:
                    tracker.close()
                report["trackers"][name] = results
    report["load_after"] = load()
    return report


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# Time to land: first log() to everything readable through the tracker's reader",
        "",
        f"machine: {m['cpus']} cpus, Python {m['python']}; load average {report['load_before']} before, "
        f"{report['load_after']} after",
        "",
        "| tracker | workload | points | own client s (median) | otel-tracking s (median) | ours/own | "
        "per round (alternating) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, results in report["trackers"].items():
        for label, r in results.items():
            what = f"{r['steps']} x {r['metrics']}" + (
                f", one step every {r['pace_ms']:.0f} ms" if r["pace_ms"] else ""
            )
            lines.append(
                f"| {name} {m.get(name, '')} | {label}: {what} | {r['points']} exactly once | "
                f"{statistics.median(r['own_s']):.2f} | {statistics.median(r['ours_s']):.2f} | **{r['ratio']:.2f}x** | "
                + ", ".join(f"{b / a:.2f}x" for a, b in zip(r["own_s"], r["ours_s"], strict=True))
                + " |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trackers", default="mlflow")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--metrics", type=int, default=200)
    parser.add_argument("--paced-steps", type=int, default=100)
    parser.add_argument("--pace-ms", type=float, default=50.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mlflow-workers", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--label", default="land")
    parser.add_argument("--render", type=Path, help="print the table of a saved results JSON and exit")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    report = run(args)
    text = render(report)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-{args.label}"
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / f"{name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
