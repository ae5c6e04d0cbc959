"""Side-by-side benchmark: the reference (verl's tracking.py) and otel-tracking doing the same work.

    python bench/bench_log.py                      # every case, writes bench/results/
    python bench/bench_log.py --cases a,b --steps 1000

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
sys.path.insert(0, str(REPO))


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
    from otel_tracking import Tracking

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
) -> dict[str, Any]:
    impls = {"reference": (reference_factory(), case.reference), "otel_tracking": (ours_factory(), case.ours)}
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
    parser.add_argument("--cases", default="a,b,c,d,e,f")
    parser.add_argument("--add-to", type=Path, help="merge this run's cases into a saved results JSON")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--render", type=Path, help="print the table of a saved results JSON and exit")
    parser.add_argument(
        "--label",
        help="save as bench/results/<date>-<label>.json and .md, leaving latest.md and the day's full run alone "
        "(for a run of some cases)",
    )
    args = parser.parse_args()
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
            for key in args.cases.split(","):
                rounds = args.rounds if key == "a" else 1
                report["cases"][key] = run_case(
                    key, CASES[key], data, slow_data, rounds, root, data[: args.paced_steps], args.pace_ms / 1e3
                )
                print(render({**report, "cases": {key: report["cases"][key]}}), file=sys.stderr, flush=True)
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
        "",
        "| case | impl | steps | log p50 ms | log p99 ms | Tracking() ms | drain ms | finish() ms | values read back |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in report["cases"].items():
        for name in ("reference", "otel_tracking"):
            r = s[name]
            arrived = ", ".join(f"{k} {v}" for k, v in r["arrived"].items() if k != "expected_per_backend")
            lines.append(
                f"| {key}: {s['title']} | {name} | {r['steps']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                f"{r['construct_ms']:.0f} | {r['drain_ms']:.0f} | {r['finish_ms']:.0f} | "
                f"{arrived} of {r['arrived']['expected_per_backend']} |"
            )
        p50, p99 = (_ratio(s["ratio"][k]) for k in ("p50_ms", "p99_ms"))
        lines.append(f"| {key} | **ours/ref** | | {p50} | {p99} | | | | |")
    if "memory" in report:
        mem = report["memory"]
        lines += [
            "",
            f"RSS (file+console): {mem['rss_mb_10k']:.1f} MB at 10k steps, {mem['rss_mb_100k']:.1f} MB "
            f"at 100k steps ({mem['growth'] * 100:+.1f}%)",
        ]
    notes = [n for s in report["cases"].values() for n in s["notes"]]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
