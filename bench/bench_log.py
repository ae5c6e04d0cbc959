"""Side-by-side benchmark: the reference (verl's tracking.py) and otel-tracking doing the same work.

    python bench/bench_log.py                      # every case, writes bench/results/
    python bench/bench_log.py --cases a,b --steps 1000
    python bench/bench_log.py --cases a,c,f --checkouts before=../wt-before,after=. --checkout-rounds 2
    python bench/bench_log.py --cases c --checkouts before=../wt-before,after=. --checkout-rounds 4 --no-reference
    python bench/bench_log.py --cold-rounds 10 --writeback --checkouts before=../wt-before,after=.

Cases (200 metrics per step, verl-style keys, stdout to /dev/null so the terminal is not measured):

  a  file + console
  b  file + console + MLflow (local sqlite store)
  c  every local backend each implementation supports (the reference's TensorBoard needs torch,
     which is not installed: it runs without it)
  d  file + console + MLflow server behind a proxy that delays every request by 1 s
  e  file + console + MLflow server that goes down right after Tracking() was built
  f  every local backend, paced: --paced-steps steps, one every --pace-ms (a training step's
     compute), finish() right after the last log() with no drain: what ending a run costs when
     the backends keep up

For each: log() p50/p99, Tracking() construction time, drain time (ours: ``flush()`` until the
backends have taken the backlog a 1000-step burst leaves, up to 600 s, or 30 s against the slow or
stopped server of d and e; the reference has none, it paid inside log()), finish() time after
that, and the ratio ours/reference.
Every run is read back through the backends' own readers (the file sink line by line; MLflow's
metric history for sampled keys; in d and e after ``otel-tracking replay`` of what was spooled),
so a fast number cannot come from dropped data.  The reference blocks on a slow MLflow (one
request per log() call): in d and e it runs --slow-steps steps, not --steps.  Plus
``import otel_tracking`` time and RSS after 10k and 100k steps (file + console, in a subprocess).
Results: bench/results/<date>-log.json and .md (machine described), and bench/results/latest.md;
with ``--label L``, bench/results/<date>-L.json and .md only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OTEL_TRACKING_SHARED", REPO.parent / "shared"))
RESULTS = REPO / "bench" / "results"
# OTEL_TRACKING_BENCH_CHECKOUT: the otel-tracking checkout to measure (first on the path, and so in
# the bridge process's); the harness, the reference and the servers stay this one's.  Set by
# --checkouts, which runs each case once per checkout in a fresh interpreter.
CHECKOUT = Path(os.environ.get("OTEL_TRACKING_BENCH_CHECKOUT") or REPO).resolve()
sys.path.insert(0, str(REPO))
if CHECKOUT != REPO:
    sys.path.insert(0, str(CHECKOUT))


def workload(steps: int, metrics: int, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    groups = ["actor", "critic", "perf", "timing_s", "response_length", "val-core/openai/gsm8k"]
    keys = [f"{groups[i % len(groups)]}/metric_{i}" for i in range(metrics)]
    return [{key: rng.random() for key in keys} for _ in range(steps)]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reference_factory() -> Callable[..., Any]:
    """The reference's Tracking, found as the tests find it (tests/reference.py): shared/baseline
    beside the repository, else verl's own tracking.py from PyPI."""
    from tests import reference

    module, which = reference.load(SHARED)
    print(f"reference: {which}", file=sys.stderr)
    return module.Tracking


def ours_factory() -> Callable[..., Any]:
    import otel_tracking
    from otel_tracking import Tracking

    assert Path(otel_tracking.__file__).resolve().is_relative_to(CHECKOUT), (otel_tracking.__file__, CHECKOUT)
    return Tracking


# --- the backends' environments ----------------------------------------------------------------


def local_backend_env(root: Path) -> dict[str, str]:
    """Offline settings for every local backend, under ``root`` (see ../shared/BACKENDS.md)."""
    root.mkdir(parents=True, exist_ok=True)
    clearml_conf = root / "clearml.conf"
    clearml_conf.write_text("sdk {\n  development {\n    report_use_subprocess: false\n  }\n}\n")
    for sub in ("wandb/cache", "wandb/data", "wandb/config", "home", "swanlog", "tensorboard"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(root / "wandb"),
        "WANDB_CACHE_DIR": str(root / "wandb/cache"),
        "WANDB_DATA_DIR": str(root / "wandb/data"),
        "WANDB_CONFIG_DIR": str(root / "wandb/config"),
        "SWANLAB_MODE": "offline",
        "SWANLAB_LOG_DIR": str(root / "swanlog"),
        "CLEARML_CONFIG_FILE": str(clearml_conf),
        "CLEARML_OFFLINE_MODE": "1",
        "HOME": str(root / "home"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "OTEL_TRACKING_SPOOL_DIR": str(root / "spool"),
    }


@dataclass
class Case:
    title: str
    ours: list[str]
    reference: list[str]
    slow: bool = False  # the reference blocks per log(): fewer steps for it
    drain_s: float = 600.0  # how long flush() may wait for the backlog before finish()
    paced: bool = False  # --paced-steps steps, --pace-ms apart, finish() with no drain
    server: str | None = None  # None, "delayed" or "down"
    notes: list[str] = field(default_factory=list)


# every local backend each implementation supports (the reference's TensorBoard needs torch)
ALL_OURS = ["file", "console", "mlflow", "tensorboard", "wandb", "swanlab", "clearml", "trackio"]
ALL_REFERENCE = ["file", "console", "mlflow", "wandb", "swanlab", "clearml", "trackio"]

CASES = {
    "a": Case("file+console", ["file", "console"], ["file", "console"]),
    "b": Case("file+console+MLflow (sqlite)", ["file", "console", "mlflow"], ["file", "console", "mlflow"]),
    "c": Case(
        "all local backends",
        ALL_OURS,
        ALL_REFERENCE,
        notes=["the reference's TensorBoard adapter needs torch (not installed): it runs without tensorboard"],
    ),
    "d": Case(
        "MLflow behind a 1 s delay",
        ["file", "console", "mlflow"],
        ["file", "console", "mlflow"],
        slow=True,
        server="delayed",
        drain_s=30.0,
    ),
    "e": Case(
        "MLflow server down",
        ["file", "console", "mlflow"],
        ["file", "console", "mlflow"],
        slow=True,
        server="down",
        drain_s=30.0,
    ),
    "f": Case(
        "all local backends, paced",
        ALL_OURS,
        ALL_REFERENCE,
        drain_s=0.0,
        paced=True,
    ),
}


@dataclass
class Outcome:
    latencies: list[float]
    construct_s: float
    drain_s: float  # ours: flush() until the workers delivered the backlog (the reference has none)
    finish_s: float
    arrived: dict[str, Any]


def run_one(
    factory: Callable[..., Any],
    backends: list[str],
    data: list[dict[str, float]],
    experiment: str,
    after_construct: Callable[[], None] | None = None,
    drain_budget_s: float = 600.0,
    pace_s: float = 0.0,
) -> tuple[Outcome, Any]:
    gc.collect()
    with quiet_stdout():
        started = time.perf_counter()
        tracking = factory("bench", experiment, default_backend=backends, config={"trainer": {"lr": 1e-6}})
        construct_s = time.perf_counter() - started
        if after_construct is not None:
            after_construct()
        latencies = []
        for step, values in enumerate(data):
            if pace_s:
                time.sleep(pace_s)  # the training step's compute
            t0 = time.perf_counter()
            tracking.log(values, step)
            latencies.append(time.perf_counter() - t0)
        started = time.perf_counter()
        if hasattr(tracking, "flush") and drain_budget_s:
            tracking.flush(timeout_s=drain_budget_s)
        drain_s = time.perf_counter() - started
        started = time.perf_counter()
        result = tracking.finish()
        finish_s = time.perf_counter() - started
    if "mlflow" in backends and "mlflow" in sys.modules:
        import mlflow

        # The reference leaves its MLflow run open (a bug we fix); end it so that the next
        # reference run in this process can start one (its server may be down: forget it then).
        if mlflow.active_run() is not None:
            try:
                mlflow.end_run()
            except Exception:
                mlflow.tracking.fluent._active_run_stack.get().clear()
    return Outcome(latencies, construct_s, drain_s, finish_s, {}), result


def verify_file(path: Path, data: list[dict[str, float]]) -> int:
    lines = path.read_text().splitlines()
    assert len(lines) == len(data), f"{path}: {len(lines)} lines for {len(data)} steps"
    for step, (line, values) in enumerate(zip(lines, data, strict=True)):
        assert json.loads(line) == {"step": step, "data": values}, f"{path}: step {step} differs"
    return sum(len(values) for values in data)


def mlflow_values(uri: str, experiment: str, data: list[dict[str, float]], sample: int = 5) -> int:
    """How many (key, step, value) of ``sample`` sampled keys MLflow holds, scaled to all keys."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("bench")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{experiment}'")
    keys = list(data[0])[:: max(1, len(data[0]) // sample)][:sample]
    found = 0
    for run in runs:
        for key in keys:
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key.replace("@", "_at_"))}
            found += sum(
                1 for step, values in enumerate(data) if abs(history.get(step, float("nan")) - values[key]) < 1e-9
            )
    return found * len(data[0]) // len(keys)


def replay_mlflow(spool_root: Path, uri: str) -> None:
    """What our MLflow sink spooled (server down, or still queued when finish() timed out)."""
    files = [str(p) for p in spool_root.rglob("mlflow*.jsonl")]  # the sink's spool and the link's
    if files:
        with env(MLFLOW_TRACKING_URI=uri, MLFLOW_DISABLE_TELEMETRY="true"):
            subprocess.run(
                [sys.executable, "-m", "otel_tracking", "replay", *files],
                check=False,
                capture_output=True,
                timeout=1800,
            )


def run_case(
    key: str,
    case: Case,
    data: list[dict[str, float]],
    slow_data: list[dict[str, float]],
    rounds: int,
    root: Path,
    paced_data: list[dict[str, float]] | None = None,
    pace_s: float = 0.0,
    reference: bool = True,
) -> dict[str, Any]:
    impls = {"reference": (reference_factory(), case.reference)} if reference else {}
    impls["otel_tracking"] = (ours_factory(), case.ours)
    outcomes: dict[str, list[Outcome]] = {name: [] for name in impls}
    server = proxy = None
    if case.server:
        from tests.servers import DelayProxy, MlflowServer

        server = MlflowServer(root / f"mlflow-server-{key}").start()
        if case.server == "delayed":
            proxy = DelayProxy(server.port, delay_s=1.0).__enter__()
    try:
        for round_index in range(rounds):
            for name, (factory, backends) in impls.items():
                experiment = f"{key}-{name}-{round_index}"
                run_data = slow_data if (case.slow and name == "reference") else data
                if case.paced and paced_data is not None:
                    run_data = paced_data
                run_root = root / experiment
                base = local_backend_env(run_root)
                base["VERL_FILE_LOGGER_ROOT"] = str(run_root)
                base["TENSORBOARD_DIR"] = str(run_root / "tensorboard")
                uri = f"sqlite:///{root / 'mlflow.db'}"
                if server is not None:
                    uri = f"http://127.0.0.1:{proxy.port if proxy else server.port}"
                    if case.server == "down":
                        server.start() if server.process is None or server.process.poll() is not None else None
                base["MLFLOW_TRACKING_URI"] = uri
                after = server.stop if case.server == "down" else None
                with env(**base):
                    if "swanlab" in backends or "clearml" in backends:
                        os.chdir(run_root)
                    pace = pace_s if case.paced else 0.0
                    outcome, _ = run_one(factory, backends, run_data, experiment, after, case.drain_s, pace)
                outcome.arrived["file"] = verify_file(run_root / "bench" / f"{experiment}.jsonl", run_data)
                if "mlflow" in backends:
                    direct = f"sqlite:///{root / 'mlflow.db'}"
                    if server is not None:
                        if not server.process or server.process.poll() is not None:
                            server.start()
                        direct = server.uri
                    if name == "otel_tracking":
                        replay_mlflow(run_root / "spool", direct)
                    outcome.arrived["mlflow"] = mlflow_values(direct, experiment, run_data)
                outcome.arrived["expected_per_backend"] = len(run_data) * len(run_data[0])
                outcomes[name].append(outcome)
    finally:
        if proxy is not None:
            proxy.__exit__(None, None, None)
        if server is not None:
            server.stop()
    return summarize(case, outcomes)


def summarize(case: Case, outcomes: dict[str, list[Outcome]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "title": case.title,
        "backends_ours": case.ours,
        "backends_reference": case.reference,
        "notes": case.notes,
    }
    for name, runs in outcomes.items():
        summary[name] = {
            "steps": len(runs[0].latencies),
            "p50_ms": statistics.median(percentile(r.latencies, 50) for r in runs) * 1e3,
            "p99_ms": statistics.median(percentile(r.latencies, 99) for r in runs) * 1e3,
            "construct_ms": statistics.median(r.construct_s for r in runs) * 1e3,
            "drain_ms": statistics.median(r.drain_s for r in runs) * 1e3,
            "finish_ms": statistics.median(r.finish_s for r in runs) * 1e3,
            "arrived": runs[0].arrived,
        }
    if "reference" in summary:
        summary["ratio"] = {k: summary["otel_tracking"][k] / summary["reference"][k] for k in ("p50_ms", "p99_ms")}
    return summary


# --- import time and memory --------------------------------------------------------------------


def import_time_ms(statement: str, repeats: int = 5) -> float:
    code = f"import time; t=time.perf_counter(); {statement}; print((time.perf_counter()-t)*1e3)"
    times = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    ]
    return statistics.median(times)


RSS_SCRIPT = """
import os, sys, random, contextlib
sys.path.insert(0, {repo!r})
from bench.bench_log import workload
from otel_tracking import Tracking
def rss_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
os.environ['VERL_FILE_LOGGER_ROOT'] = {root!r}
data = workload(100, 200)
out = {{}}
with open(os.devnull, 'w') as devnull, contextlib.redirect_stdout(devnull):
    t = Tracking('bench', 'rss', default_backend=['file', 'console'])
    for step in range(100_000):
        t.log(data[step % 100], step)
        if step + 1 in (10_000, 100_000):
            out[step + 1] = rss_mb()
    t.finish()
print(out[10_000], out[100_000])
"""


def rss(root: Path) -> dict[str, float]:
    script = RSS_SCRIPT.format(repo=str(REPO), root=str(root / "rss"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    at_10k, at_100k = float(out[0]), float(out[1])
    return {"rss_mb_10k": at_10k, "rss_mb_100k": at_100k, "growth": at_100k / at_10k - 1}


def load() -> str:
    """The machine's load average (1, 5, 15 min): others share it, a run notes what it ran beside."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the cold path and log() under writeback, across checkouts ---------------------------------
#
# Each run is a fresh interpreter with the measured checkout first on its path and in PYTHONPATH
# (the bridge process inherits it), so one invocation compares checkouts (--checkouts
# before=<worktree>,after=<worktree>) round by round under the same conditions.

TRACKERS_OURS = ["tensorboard", "mlflow"]  # the ML trackers the delivery path is for
TRACKERS_REFERENCE = ["mlflow"]  # the reference's TensorBoard needs torch

CHILD = r"""
import contextlib, json, os, sys, time
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["checkout"])
data = json.loads(open(spec["data"]).read())[: spec["steps"]]
t = time.perf_counter()
if spec["impl"] == "reference":
    from tests import reference
    Tracking = reference.load(__import__("pathlib").Path(spec["shared"]))[0].Tracking
    where = "reference"
else:
    from otel_tracking import Tracking
    import otel_tracking
    where = otel_tracking.__file__
out = {"import_s": time.perf_counter() - t, "module": where}

def cpu_children():
    times = os.times()
    return times.children_user + times.children_system

def children():
    found = set()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            found |= set(open(f"/proc/self/task/{task}/children").read().split())
    return found

with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
    w0, c0 = time.perf_counter(), time.process_time()
    tracking = Tracking("bench", spec["experiment"], default_backend=spec["backends"], config={"trainer": {"lr": 1e-6}})
    w1, c1 = time.perf_counter(), time.process_time()
    latencies = []
    for step, values in enumerate(data):
        if spec["pace_s"]:
            time.sleep(spec["pace_s"])  # the training step's compute
        s0 = time.perf_counter()
        tracking.log(values, step)
        latencies.append(time.perf_counter() - s0)
    w2, c2 = time.perf_counter(), time.process_time()
    if spec["drain_s"] and hasattr(tracking, "flush"):
        tracking.flush(timeout_s=spec["drain_s"])
    w3, c3 = time.perf_counter(), time.process_time()
    counts = tracking.finish()
    w4, c4 = time.perf_counter(), time.process_time()
    deadline = time.monotonic() + 60
    while children() and time.monotonic() < deadline:
        time.sleep(0.05)  # a bridge process reaped in the background: its CPU counts once reaped
out.update(
    construct_s=w1 - w0, construct_cpu_s=c1 - c0, log_s=w2 - w1, log_cpu_s=c2 - c1, drain_s=w3 - w2,
    finish_s=w4 - w3, finish_cpu_s=c4 - c3, total_s=w4 - w0, total_cpu_s=c4 - c0,
    children_cpu_s=cpu_children(), latencies=latencies,
    counts=counts if isinstance(counts, dict) else None,
)
with open(spec["out"], "w") as f:
    json.dump(out, f)
"""


@dataclass
class Side:
    """One implementation measured in a fresh interpreter: a checkout of ours in a mode, or the reference."""

    label: str
    impl: str  # "ours" or "reference"
    checkout: Path
    bridge_process: bool = True

    @property
    def backends(self) -> list[str]:
        return TRACKERS_REFERENCE if self.impl == "reference" else TRACKERS_OURS


def sides(checkouts: str, modes: list[bool], reference: bool) -> list[Side]:
    """``name=path,...`` checkouts, each in each mode (bridge process or not), then the reference."""
    result = []
    for bridge in modes:
        for item in checkouts.split(","):
            name, _, path = item.partition("=")
            mode = "bridge process" if bridge else "BRIDGE_PROCESS=false"
            result.append(Side(f"{name} ({mode})", "ours", Path(path or name).resolve(), bridge))
    if reference:
        result.append(Side("reference (verl)", "reference", REPO))
    return result


def run_child(side: Side, root: Path, data_file: Path, name: str, steps: int, pace_s: float, drain_s: float) -> dict:
    run_root = root / name
    environment = {**os.environ, **local_backend_env(run_root)}
    environment.update(
        PYTHONPATH=str(side.checkout),
        MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}",
        TENSORBOARD_DIR=str(run_root / "tensorboard"),
        VERL_FILE_LOGGER_ROOT=str(run_root),
        OTEL_TRACKING_BRIDGE_PROCESS="true" if side.bridge_process else "false",
    )
    out = run_root / "out.json"
    spec = {
        "checkout": str(side.checkout),
        "shared": str(SHARED),
        "impl": side.impl,
        "backends": side.backends,
        "experiment": name,
        "data": str(data_file),
        "steps": steps,
        "pace_s": pace_s,
        "drain_s": drain_s,
        "out": str(out),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], env=environment, cwd=run_root, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{side.label}: {done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if side.impl == "ours":
        assert result["module"].startswith(str(side.checkout)), f"{side.label} ran {result['module']}"
    return result


def prepare(root: Path, steps: int, metrics: int) -> Path:
    """The workload as a file every run reads, and the MLflow store made once (its tables are
    created by the first client: not a cost of any measured run)."""
    root.mkdir(parents=True, exist_ok=True)
    data_file = root / "data.json"
    data_file.write_text(json.dumps(workload(steps, metrics)))
    from mlflow.tracking import MlflowClient

    with env(MLFLOW_DISABLE_TELEMETRY="true"):
        client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
        if client.get_experiment_by_name("bench") is None:
            client.create_experiment("bench")
    return data_file


def cold(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Tracking() + the first log() + finish(), each round in a fresh interpreter, sides rotated."""
    everyone = sides(args.checkouts, [True, False], reference=True)
    data_file = prepare(root, 1, args.metrics)
    runs: dict[str, list[dict]] = {s.label: [] for s in everyone}
    loads = [load()]
    for index, side in enumerate(everyone):  # one unmeasured round each: files in the page cache, .pyc written
        run_child(side, root, data_file, f"cold-warm-{index}", 1, 0.0, 0.0)
    for round_index in range(args.cold_rounds):
        order = everyone[round_index % len(everyone) :] + everyone[: round_index % len(everyone)]
        for side in order:
            name = f"cold-{round_index}-{everyone.index(side)}"
            runs[side.label].append(run_child(side, root, data_file, name, 1, 0.0, 0.0))
        print(f"cold round {round_index + 1}/{args.cold_rounds} done, load {load()}", file=sys.stderr, flush=True)
    loads.append(load())
    fields = ("import_s", "construct_s", "construct_cpu_s", "latencies", "finish_s", "finish_cpu_s", "total_s")
    fields += ("total_cpu_s", "children_cpu_s")
    table = {}
    for side in everyone:
        rows = runs[side.label]
        table[side.label] = {
            "backends": side.backends,
            "rounds": len(rows),
            **{
                key: {
                    "median_ms": statistics.median(_first(r[key]) for r in rows) * 1e3,
                    "max_ms": max(_first(r[key]) for r in rows) * 1e3,
                }
                for key in fields
            },
            "per_round": [{key: _first(r[key]) for key in fields} for r in rows],
        }
    return {"sides": table, "load": loads}


def _first(value: Any) -> float:
    return value[0] if isinstance(value, list) else value


class DirtyPages:
    """Samples the kernel's dirty and under-writeback memory (/proc/meminfo) every 0.2 s."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DirtyPages:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.samples.append(meminfo_mb("Dirty", "Writeback"))

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {}
        dirty, writeback = zip(*self.samples, strict=True)
        return {
            "dirty_mb_median": statistics.median(dirty),
            "dirty_mb_max": max(dirty),
            "writeback_mb_median": statistics.median(writeback),
            "writeback_mb_max": max(writeback),
        }


def meminfo_mb(*names: str) -> tuple[float, ...]:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) / 1024
    return tuple(values[n] for n in names)


@contextlib.contextmanager
def writeback_load(where: Path, size_mb: int) -> Iterator[Path]:
    """A process rewriting a ``size_mb`` file over and over (dd, then its fsync), so that the
    kernel is writing dirty pages back the whole time; stopped and the file removed after."""
    import shutil
    import signal

    free_mb = shutil.disk_usage(where).free / 2**20
    if size_mb > 0.3 * free_mb:
        raise SystemExit(f"--writeback-mb {size_mb} is over 30% of the {free_mb:.0f} MB free under {where}")
    big, dd_log = where / "writeback.big", where / "writeback-dd.log"
    script = f"while :; do dd if=/dev/zero of={big} bs=1M count={size_mb} conv=notrunc,fsync 2>>{dd_log}; done"
    writer = subprocess.Popen(["nice", "-n", "5", "bash", "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while sum(meminfo_mb("Dirty", "Writeback")) < min(1024, size_mb / 2) and time.monotonic() < deadline:
            time.sleep(0.5)  # until the kernel has a backlog to write back
        yield dd_log
    finally:
        os.killpg(writer.pid, signal.SIGTERM)
        writer.wait()
        big.unlink(missing_ok=True)


def writeback(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """log() p50/p99/max with the ML trackers, quiet and while the kernel writes back dirty pages."""
    everyone = sides(args.checkouts, [True, False], reference=not args.no_reference)
    data_file = prepare(root, max(args.writeback_steps, args.writeback_ref_steps), args.metrics)
    phases: dict[str, Any] = {}
    for phase in ("quiet", "writeback"):
        results: dict[str, Any] = {}
        context = writeback_load(root, args.writeback_mb) if phase == "writeback" else contextlib.nullcontext()
        with context as dd_log:
            started = load()
            for side in everyone:
                steps = args.writeback_ref_steps if side.impl == "reference" else args.writeback_steps
                name = f"{phase}-{everyone.index(side)}"
                with DirtyPages() as pages:
                    before = load()
                    r = run_child(
                        side, root, data_file, name, steps, args.writeback_pace_ms / 1e3, args.writeback_drain_s
                    )
                lat = r["latencies"]
                results[side.label] = {
                    "backends": side.backends,
                    "steps": len(lat),
                    "p50_ms": percentile(lat, 50) * 1e3,
                    "p99_ms": percentile(lat, 99) * 1e3,
                    "max_ms": max(lat) * 1e3,
                    "over_10ms": sum(1 for x in lat if x > 0.010),
                    "construct_ms": r["construct_s"] * 1e3,
                    "drain_ms": r["drain_s"] * 1e3,
                    "finish_ms": r["finish_s"] * 1e3,
                    "counts": r["counts"],
                    "pages": pages.summary(),
                    "load": before,
                }
                if "mlflow" in side.backends:
                    data = json.loads(data_file.read_text())[:steps]
                    results[side.label]["mlflow_read_back"] = mlflow_values(
                        f"sqlite:///{root / 'mlflow.db'}", name, data
                    )
                print(f"writeback {phase} {side.label}: {results[side.label]}", file=sys.stderr, flush=True)
            dd = dd_log.read_text().splitlines()[-3:] if dd_log is not None and dd_log.exists() else []
        phases[phase] = {"sides": results, "load": [started, load()], "dd": dd}
    return {
        "phases": phases,
        "steps": args.writeback_steps,
        "pace_ms": args.writeback_pace_ms,
        "size_mb": args.writeback_mb,
        "dirty_threshold_mb": _vmstat_pages("nr_dirty_threshold") * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "dirty_background_threshold_mb": _vmstat_pages("nr_dirty_background_threshold")
        * os.sysconf("SC_PAGE_SIZE")
        / 2**20,
    }


def _vmstat_pages(name: str) -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def compare_cases(args: argparse.Namespace) -> dict[str, Any]:
    """Each case once per checkout per round, in a fresh interpreter (this harness, the measured
    checkout's otel_tracking), checkouts rotated round by round: before and after side by side
    under the same conditions, each beside its own run of the reference."""
    checkouts = [
        (name, Path(path or name).resolve()) for name, _, path in (c.partition("=") for c in args.checkouts.split(","))
    ]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key in filter(None, args.cases.split(",")):
            runs[key] = {name: [] for name, _ in checkouts}
            for round_index in range(args.checkout_rounds):
                shift = round_index % len(checkouts)
                for name, path in checkouts[shift:] + checkouts[:shift]:
                    out = Path(tmp) / f"{key}-{name}-{round_index}.json"
                    command = [
                        sys.executable,
                        __file__,
                        "--cases",
                        key,
                        "--no-save",
                        "--no-rss",
                        "--json-out",
                        str(out),
                    ]
                    command += [
                        "--steps",
                        str(args.steps),
                        "--metrics",
                        str(args.metrics),
                        "--rounds",
                        str(args.rounds),
                    ]
                    command += ["--paced-steps", str(args.paced_steps), "--pace-ms", str(args.pace_ms)]
                    command += ["--no-reference"] if args.no_reference else []
                    environment = {**os.environ, "OTEL_TRACKING_BENCH_CHECKOUT": str(path), "PYTHONPATH": str(path)}
                    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL)
                    runs[key][name].append(json.loads(out.read_text())["cases"][key])
                    print(f"case {key} {name} round {round_index + 1} done, load {load()}", file=sys.stderr, flush=True)
    return runs


def render_compare(report: dict[str, Any]) -> str:
    lines = [
        f"## Checkouts side by side: {', '.join(report['checkouts'])}",
        "",
        "Each case once per checkout per round, a fresh interpreter each, checkouts rotated round by round; "
        + (
            "each run beside its own run of the reference. ours/ref: the ratio within that run."
            if report.get("reference", True)
            else "ours only (--no-reference): no reference ran in the interpreter before ours."
        ),
        "",
        "| case | checkout | round | ours p50 ms | ours p99 ms | ref p50 ms | ref p99 ms | ours/ref p50 | "
        "ours/ref p99 | drain ms | finish() ms | values read back |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, by_checkout in report["compare"].items():
        for name, rounds in by_checkout.items():
            for index, s in enumerate(rounds):
                o = s["otel_tracking"]
                r = s.get("reference", {"p50_ms": math.nan, "p99_ms": math.nan})
                ratio = s.get("ratio", {"p50_ms": math.nan, "p99_ms": math.nan})
                arrived = ", ".join(f"{k} {v}" for k, v in o["arrived"].items() if k != "expected_per_backend")
                lines.append(
                    f"| {key}: {s['title']} | {name} | {index + 1} | {o['p50_ms']:.3f} | {o['p99_ms']:.3f} | "
                    f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {ratio['p50_ms']:.3g} | "
                    f"{ratio['p99_ms']:.3g} | {o['drain_ms']:.0f} | {o['finish_ms']:.0f} | "
                    f"{arrived} of {o['arrived']['expected_per_backend']} |"
                )
    lines += [
        "",
        "Median over the rounds, ours:",
        "",
        "| case | " + " | ".join(f"{name} p50 ms | {name} p99 ms" for name in report["checkouts"]) + " |",
        "|---|" + "---|---|" * len(report["checkouts"]),
    ]
    for key, by_checkout in report["compare"].items():
        cells = []
        for name in report["checkouts"]:
            rounds = by_checkout[name]
            cells += [f"{statistics.median(s['otel_tracking'][k] for s in rounds):.3f}" for k in ("p50_ms", "p99_ms")]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_cold(report: dict[str, Any]) -> str:
    c = report["cold"]
    sides_ = c["sides"]
    rounds = next(iter(sides_.values()))["rounds"]
    lines = [
        f"## Cold path: Tracking() + first log() + finish(), a fresh interpreter each round ({rounds} rounds, "
        "sides rotated round by round)",
        "",
        "Trackers: ours " + ", ".join(TRACKERS_OURS) + " (MLflow: local sqlite store, made before the rounds); "
        "the reference " + ", ".join(TRACKERS_REFERENCE) + ". Wall and CPU in ms, median (max) of the rounds; "
        "CPU = the training process's; bridge CPU = the processes it started (waited for after finish()).",
        "",
        "| side | import | Tracking() wall | Tracking() CPU | first log() wall | finish() wall | finish() CPU | "
        "total wall | total CPU | bridge CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = ("import_s", "construct_s", "construct_cpu_s", "latencies", "finish_s", "finish_cpu_s", "total_s")
    keys += ("total_cpu_s", "children_cpu_s")
    for label, s in sides_.items():
        cells = [f"{s[k]['median_ms']:.1f} ({s[k]['max_ms']:.1f})" for k in keys]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"load average (1, 5, 15 min): {c['load'][0]} before, {c['load'][1]} after"]
    return "\n".join(lines)


def render_writeback(report: dict[str, Any]) -> str:
    w = report["writeback"]
    lines = [
        f"## log() while the kernel writes back dirty pages: {w['steps']} steps x {report['metrics_per_step']} "
        f"metrics, one every {w['pace_ms']:.0f} ms",
        "",
        f"writeback: a process rewriting a {w['size_mb']} MB file in a loop (dd bs=1M conv=notrunc,fsync) on the "
        "disk of the spool and the MLflow store; the kernel's dirty limits here: "
        f"{w['dirty_background_threshold_mb']:.0f} MB (background writeback), {w['dirty_threshold_mb']:.0f} MB "
        "(writers throttled). Ours: "
        + ", ".join(TRACKERS_OURS)
        + " (sqlite); reference: "
        + ", ".join(TRACKERS_REFERENCE)
        + " (sqlite), fewer steps (it blocks per log()).",
        "",
        "| phase | side | steps | log p50 ms | log p99 ms | log max ms | > 10 ms | Tracking() ms | drain ms | "
        "finish() ms | MLflow values read back | Dirty / Writeback MB (median, max) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase, p in w["phases"].items():
        for label, r in p["sides"].items():
            pg = r["pages"]
            pages = (
                f"{pg['dirty_mb_median']:.0f} / {pg['writeback_mb_median']:.0f} "
                f"({pg['dirty_mb_max']:.0f} / {pg['writeback_mb_max']:.0f})"
                if pg
                else "-"
            )
            lines.append(
                f"| {phase} | {label} | {r['steps']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.1f} | "
                f"{r['over_10ms']} | {r['construct_ms']:.0f} | {r['drain_ms']:.0f} | {r['finish_ms']:.0f} | "
                f"{r.get('mlflow_read_back', '-')} of {r['steps'] * report['metrics_per_step']} | {pages} | "
                f"{r['load']} |"
            )
    for phase, p in w["phases"].items():
        if p["dd"]:
            lines.append(f"\n{phase}: dd's last lines: " + " / ".join(p["dd"]))
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        for package in ("opentelemetry-sdk", "otel-tracking", "mlflow", "wandb", "swanlab", "clearml", "trackio"):
            info[package] = version(package)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--slow-steps", type=int, default=10, help="reference steps in cases d and e")
    parser.add_argument("--metrics", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per implementation in case a")
    parser.add_argument("--paced-steps", type=int, default=200, help="steps in case f")
    parser.add_argument("--pace-ms", type=float, default=250.0, help="compute time per step in case f")
    parser.add_argument("--cases", help="default a,b,c,d,e,f; none with --cold-rounds or --writeback")
    parser.add_argument("--add-to", type=Path, help="merge this run's cases into a saved results JSON")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--render", type=Path, help="print the table of a saved results JSON and exit")
    parser.add_argument(
        "--label",
        help="save as bench/results/<date>-<label>.json and .md, leaving latest.md and the day's full run alone "
        "(for a run of some cases)",
    )
    parser.add_argument(
        "--checkouts",
        default=f"this={REPO}",
        help="for --cold-rounds and --writeback: name=path,... checkouts of otel-tracking, each run in a fresh "
        "interpreter with it first on the path (e.g. before=../wt-before,after=.)",
    )
    parser.add_argument(
        "--cold-rounds",
        type=int,
        default=0,
        help="the cold path: Tracking() + first log() + finish() (wall, CPU), a fresh interpreter each round",
    )
    parser.add_argument(
        "--writeback",
        action="store_true",
        help="log() p50/p99/max with tensorboard+mlflow, quiet and while a process rewrites a large file",
    )
    parser.add_argument("--writeback-mb", type=int, default=4000, help="the file rewritten (at most 30%% of free)")
    parser.add_argument("--writeback-steps", type=int, default=1000)
    parser.add_argument("--writeback-ref-steps", type=int, default=150, help="the reference blocks per log()")
    parser.add_argument("--writeback-pace-ms", type=float, default=20.0)
    parser.add_argument("--writeback-drain-s", type=float, default=30.0, help="flush() budget before finish()")
    parser.add_argument(
        "--no-reference", action="store_true", help="the cases (and --writeback) without the reference: ours only"
    )
    parser.add_argument(
        "--checkout-rounds",
        type=int,
        default=0,
        help="with --checkouts and --cases: run each case this many times per checkout, side by side",
    )
    parser.add_argument("--json-out", type=Path, help="also write this run's report here (used by --checkout-rounds)")
    args = parser.parse_args()
    if args.cases is None:
        args.cases = "" if (args.cold_rounds or args.writeback) else "a,b,c,d,e,f"
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0

    data = workload(args.steps, args.metrics)
    slow_data = data[: args.slow_steps]
    report: dict[str, Any] = {
        "machine": machine(),
        "steps": args.steps,
        "metrics_per_step": args.metrics,
        "import_otel_tracking_ms": import_time_ms("import otel_tracking"),
        "import_tracking_facade_ms": import_time_ms("from otel_tracking import Tracking"),
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cwd = os.getcwd()
        try:
            if args.checkout_rounds:
                report["checkouts"] = [c.partition("=")[0] for c in args.checkouts.split(",")]
                report["reference"] = not args.no_reference
                report["compare"] = compare_cases(args)
                args.cases = ""
            for key in filter(None, args.cases.split(",")):
                rounds = args.rounds if key == "a" else 1
                load_before = load()
                report["cases"][key] = run_case(
                    key,
                    CASES[key],
                    data,
                    slow_data,
                    rounds,
                    root,
                    data[: args.paced_steps],
                    args.pace_ms / 1e3,
                    reference=not args.no_reference,
                )
                report["cases"][key]["load"] = [load_before, load()]
                print(render({**report, "cases": {key: report["cases"][key]}}), file=sys.stderr, flush=True)
            if args.cold_rounds:
                report["cold"] = cold(args, root / "cold")
                print(render_cold(report), file=sys.stderr, flush=True)
            if args.writeback:
                report["writeback"] = writeback(args, root / "writeback")
        finally:
            os.chdir(cwd)
        if not args.no_rss:
            report["memory"] = rss(root)
    if args.add_to:  # this run's cases (and memory, if measured) into a saved report
        saved = json.loads(args.add_to.read_text())
        saved["cases"].update(report["cases"])
        if "memory" in report:
            saved["memory"] = report["memory"]
        report = saved
    if args.json_out:
        args.json_out.write_text(json.dumps(report))
    text = render(report)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-{args.label or 'log'}"
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / f"{name}.md").write_text(text + "\n")
        if not args.label:
            (RESULTS / "latest.md").write_text(text + "\n")
    return 0


def _ratio(ratio: float) -> str:
    return f"**{ratio:.2f}x**" if ratio >= 1 else f"**{ratio:.3g}x** ({1 / ratio:.3g}x lower)"


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# log() benchmark: {report['steps']} steps x {report['metrics_per_step']} metrics",
        "",
        f"machine: {m.get('cpu', '?')}, {m['cpus']} cpus, Python {m['python']}, "
        f"opentelemetry-sdk {m.get('opentelemetry-sdk', '?')}, mlflow {m.get('mlflow', '-')}",
        f"`import otel_tracking`: {report['import_otel_tracking_ms']:.1f} ms; "
        f"`from otel_tracking import Tracking`: {report['import_tracking_facade_ms']:.1f} ms "
        "(median of 5 fresh interpreters, every backend installed)",
    ]
    if report["cases"]:
        lines += [
            "",
            "| case | impl | steps | log p50 ms | log p99 ms | Tracking() ms | drain ms | finish() ms "
            "| values read back |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    for key, s in report["cases"].items():
        for name in [n for n in ("reference", "otel_tracking") if n in s]:
            r = s[name]
            arrived = ", ".join(f"{k} {v}" for k, v in r["arrived"].items() if k != "expected_per_backend")
            lines.append(
                f"| {key}: {s['title']} | {name} | {r['steps']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                f"{r['construct_ms']:.0f} | {r['drain_ms']:.0f} | {r['finish_ms']:.0f} | "
                f"{arrived} of {r['arrived']['expected_per_backend']} |"
            )
        if "ratio" in s:
            p50, p99 = (_ratio(s["ratio"][k]) for k in ("p50_ms", "p99_ms"))
            lines.append(f"| {key} | **ours/ref** | | {p50} | {p99} | | | | |")
    if "memory" in report:
        mem = report["memory"]
        lines += [
            "",
            f"RSS (file+console): {mem['rss_mb_10k']:.1f} MB at 10k steps, {mem['rss_mb_100k']:.1f} MB "
            f"at 100k steps ({mem['growth'] * 100:+.1f}%)",
        ]
    loads = [f"{key} {s['load'][0]} -> {s['load'][1]}" for key, s in report["cases"].items() if "load" in s]
    if loads:
        lines += ["", "load average (1, 5, 15 min) before -> after each case: " + "; ".join(loads)]
    notes = [n for s in report["cases"].values() for n in s["notes"]]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    if "compare" in report:
        lines += ["", render_compare(report)]
    if "cold" in report:
        lines += ["", render_cold(report)]
    if "writeback" in report:
        lines += ["", render_writeback(report)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
