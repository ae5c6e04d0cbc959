"""Side-by-side benchmark: the reference (verl's tracking.py) and otel-tracking doing the same work.

    python bench/bench_log.py [--steps 1000] [--metrics 200] [--cases file_console]

For each case both implementations run in turn in this process, on the same workload (200 float
metrics per step, verl-style keys), with stdout sent to /dev/null so the terminal is not what we
measure.  Reported: log() p50/p99 per implementation and the ratio ours/reference, plus
``import otel_tracking`` time, ``Tracking()`` construction and ``finish()`` time.  Every run's file
sink is read back to check that every value arrived, so a fast number cannot come from lost data.
Results go to bench/results/<date>-<case>.json and .md with a machine description.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("OTEL_TRACKING_SHARED", REPO.parent / "shared"))
RESULTS = REPO / "bench" / "results"


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


def reference_factory() -> Callable[..., Any]:
    sys.path.insert(0, str(SHARED / "baseline"))
    return importlib.import_module("seed_tracking").Tracking


def ours_factory() -> Callable[..., Any]:
    from otel_tracking import Tracking

    return Tracking


def run_one(
    factory: Callable[..., Any],
    backends: list[str],
    data: list[dict[str, float]],
    root: Path,
) -> dict[str, Any]:
    os.environ["VERL_FILE_LOGGER_ROOT"] = str(root)
    gc.collect()
    with quiet_stdout():
        started = time.perf_counter()
        tracking = factory("bench", "run", default_backend=backends, config=None)
        construct_s = time.perf_counter() - started
        latencies = []
        for step, values in enumerate(data):
            t0 = time.perf_counter()
            tracking.log(values, step)
            latencies.append(time.perf_counter() - t0)
        started = time.perf_counter()
        tracking.finish()
        finish_s = time.perf_counter() - started
    arrived = verify_file(root / "bench" / "run.jsonl", data) if "file" in backends else None
    return {
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "construct_ms": construct_s * 1e3,
        "finish_ms": finish_s * 1e3,
        "values_arrived": arrived,
    }


def verify_file(path: Path, data: list[dict[str, float]]) -> int:
    lines = path.read_text().splitlines()
    assert len(lines) == len(data), f"{path}: {len(lines)} lines for {len(data)} steps"
    count = 0
    for step, (line, values) in enumerate(zip(lines, data, strict=True)):
        record = json.loads(line)
        assert record == {"step": step, "data": values}, f"step {step} differs"
        count += len(values)
    return count


def import_time_ms(repeats: int = 5) -> float:
    code = "import time; t=time.perf_counter(); import otel_tracking; print((time.perf_counter()-t)*1e3)"
    times = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    ]
    return statistics.median(times)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["opentelemetry-sdk"] = version("opentelemetry-sdk")
        info["otel-tracking"] = version("otel-tracking")
    return info


CASES = {"file_console": ["file", "console"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--metrics", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per implementation")
    parser.add_argument("--cases", default="file_console")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    data = workload(args.steps, args.metrics)
    impls = {"reference": reference_factory(), "otel_tracking": ours_factory()}
    report: dict[str, Any] = {
        "machine": machine(),
        "steps": args.steps,
        "metrics_per_step": args.metrics,
        "import_otel_tracking_ms": import_time_ms(),
        "cases": {},
    }
    for case in args.cases.split(","):
        backends = CASES[case]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in impls}
        with tempfile.TemporaryDirectory() as tmp:
            for round_index in range(args.rounds):  # alternate, so drift hits both alike
                for name, factory in impls.items():
                    runs[name].append(run_one(factory, backends, data, Path(tmp) / f"{name}-{round_index}"))
        summary = {
            name: {
                k: statistics.median(r[k] for r in results) if k != "values_arrived" else results[0][k]
                for k in results[0]
            }
            for name, results in runs.items()
        }
        summary["ratio_ours_over_reference"] = {
            k: summary["otel_tracking"][k] / summary["reference"][k] for k in ("p50_ms", "p99_ms", "mean_ms")
        }
        report["cases"][case] = summary

    text = render(report)
    print(text)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d")
        (RESULTS / f"{stamp}-log.json").write_text(json.dumps(report, indent=2) + "\n")
        (RESULTS / f"{stamp}-log.md").write_text(text + "\n")
        (RESULTS / "latest.md").write_text(text + "\n")
    return 0


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# log() benchmark: {report['steps']} steps x {report['metrics_per_step']} metrics",
        "",
        f"machine: {m.get('cpu', '?')}, {m['cpus']} cpus, Python {m['python']}, "
        f"opentelemetry-sdk {m.get('opentelemetry-sdk', '?')}",
        f"`import otel_tracking`: {report['import_otel_tracking_ms']:.1f} ms (median of 5 fresh interpreters)",
        "",
        "| case | impl | log p50 ms | log p99 ms | mean ms | Tracking() ms | finish() ms | values read back |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, summary in report["cases"].items():
        for name in ("reference", "otel_tracking"):
            r = summary[name]
            lines.append(
                f"| {case} | {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} | "
                f"{r['construct_ms']:.1f} | {r['finish_ms']:.1f} | {r['values_arrived']} |"
            )
        ratio = summary["ratio_ours_over_reference"]
        lines.append(
            f"| {case} | ratio ours/ref | {ratio['p50_ms']:.2f}x | {ratio['p99_ms']:.2f}x | {ratio['mean_ms']:.2f}x "
            "| | | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
