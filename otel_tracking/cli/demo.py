"""``otel-tracking demo``: a simulated RL post-training run through the facade.

Each step runs rollout (one lane per simulated inference worker, in threads; the last lane is a
straggler, three times slower), reward and update phases as ``trace_state`` spans, then logs ~30
verl-style metrics; every ``--val-every`` steps a validation phase logs ``val-core/...@4`` metrics
and generations.  Nothing is trained: values follow smooth curves with noise from a fixed seed, so
two runs log the same numbers.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_tracking.api.facade import Tracking
from otel_tracking.api.generations import ValidationGenerationsLogger
from otel_tracking.api.spans import trace_state
from otel_tracking.exporters.mlflow import mlflow_training_view

DEFAULT_BACKENDS = ("console", "file", "tensorboard")
PROMPTS = ["What is 17 * 23?", "Is 91 prime?", "Sum of 1..100?", "Capital of Australia?"]


def step_metrics(step: int, rng: random.Random, timings: dict[str, float]) -> dict[str, Any]:
    progress = 1.0 - math.exp(-step / 15.0)
    noise = lambda scale: rng.gauss(0.0, scale)  # noqa: E731
    score = 0.2 + 0.6 * progress + noise(0.03)
    length = 380 + 220 * progress + noise(15)
    metrics: dict[str, Any] = {
        "actor/entropy": 1.2 - 0.5 * progress + noise(0.02),
        "actor/pg_loss": -0.05 * progress + noise(0.01),
        "actor/pg_clipfrac": 0.02 + noise(0.002),
        "actor/ppo_kl": 0.001 + abs(noise(0.0005)),
        "actor/grad_norm": 0.8 + abs(noise(0.1)),
        "actor/lr": 1e-6,
        "critic/score/mean": score,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "critic/rewards/mean": score,
        "critic/advantages/mean": noise(0.01),
        "critic/advantages/max": 2.5 + noise(0.1),
        "critic/advantages/min": -2.5 + noise(0.1),
        "critic/returns/mean": score + noise(0.01),
        "response_length/mean": length,
        "response_length/max": 1024,
        "response_length/min": 32,
        "response_length/clip_ratio": max(0.0, 0.01 + noise(0.005)),
        "prompt_length/mean": 120 + noise(3),
        "prompt_length/max": 256,
        "prompt_length/min": 24,
        "training/global_step": step,
        "training/epoch": step // 10,
        "perf/total_num_tokens": int(256 * length),
        "perf/throughput": 2400 + noise(50),
        "perf/max_memory_allocated_gb": 38.5 + noise(0.2),
        "perf/cpu_memory_used_gb": 61.0 + noise(0.3),
    }
    metrics.update({f"timing_s/{name}": seconds for name, seconds in timings.items()})
    metrics["perf/time_per_step"] = sum(timings.values())
    return metrics


@dataclass
class DemoPlaces:
    """Where the demo's local sinks write (all under ``out``), and the commands that show the run."""

    out: Path
    project: str
    experiment: str
    mlflow_experiment_id: str | None = None

    def use(self, backends: Sequence[str]) -> None:
        """Point every local sink under ``out``, unless the caller's environment already says where:
        each in the layout its viewer expects (TensorBoard: ``<root>/<project>/<experiment>``, as
        verl writes it, so that TensorBoard names the run), none in the working directory."""
        out = self.out
        defaults = {
            "VERL_FILE_LOGGER_PATH": out / f"{self.experiment}.jsonl",
            "TENSORBOARD_DIR": out / "tensorboard" / self.project / self.experiment,
            "SWANLAB_LOG_DIR": out / "swanlog",
            "SWANLAB_MODE": "offline",
            "TRACKIO_DIR": out / "trackio",
            "WANDB_MODE": "offline",
            "WANDB_DIR": out,
            "WANDB_CACHE_DIR": out / "wandb-cache",
            "WANDB_DATA_DIR": out / "wandb-data",
            "WANDB_CONFIG_DIR": out / "wandb-config",
            "OTEL_TRACKING_SPOOL_DIR": out / "spool",
            "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}",
            "OTEL_TRACKING_ANATOMY": "1",  # each step's anatomy/* numbers, as a verl run gets them
        }
        for variable, value in defaults.items():
            os.environ.setdefault(variable, str(value))
        if "mlflow" in backends:
            self.mlflow_experiment_id = _mlflow_experiment(self.project, out / "mlflow-artifacts")
        if "clearml" in backends:
            _clearml_offline(out)

    def next_steps(self, backends: Sequence[str]) -> list[str]:
        """Commands that open each viewer on this run."""
        hints = []
        if "tensorboard" in backends:
            run_dir = Path(os.environ["TENSORBOARD_DIR"])
            # Its parent, so that TensorBoard names the run after the experiment (on the run's own
            # directory it would call it ".").
            logdir = run_dir.parent if run_dir.name == self.experiment else run_dir
            hints.append(f"tensorboard --logdir {logdir}")
        if "mlflow" in backends:
            uri = os.environ["MLFLOW_TRACKING_URI"]
            hints.append(f"mlflow ui --backend-store-uri {uri} --port 5000   # needs the full mlflow package")
            if self.mlflow_experiment_id is not None:
                hints.append(f"  then open {MLFLOW_UI}{mlflow_training_view(self.mlflow_experiment_id)}")
        if "trackio" in backends:
            hints.append(f"TRACKIO_DIR={os.environ['TRACKIO_DIR']} trackio show --project {self.project}")
        if "wandb" in backends:
            hints.append(f"wandb leet {os.environ['WANDB_DIR']}/wandb/latest-run   # wandb's terminal viewer")
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            hints.append("otel-tracking stack status   # the local stack's trace UI URL (and Prometheus')")
        else:
            hints.append(
                "otel-tracking stack up --light   # the trace UI (Zipkin); export what it prints, run the demo again"
            )
        return hints


MLFLOW_UI = "http://127.0.0.1:5000/"


def _mlflow_experiment(project: str, artifacts: Path) -> str:
    """MLflow keeps a new experiment's artifacts in ``./mlruns`` of the working directory unless the
    experiment is made with a location: the demo makes it, its artifacts under ``--out``."""
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(project)
    if experiment is not None:
        return str(experiment.experiment_id)
    return str(client.create_experiment(project, artifact_location=artifacts.as_uri()))


def _clearml_offline(out: Path) -> None:
    """ClearML needs a server or a config file before Task.init; the demo gives it an offline one
    whose cache (where offline sessions go) is under --out.  ClearML still keeps a small
    ``~/.clearml/.session.json``: its location is fixed to the home folder."""
    os.environ.setdefault("CLEARML_OFFLINE_MODE", "1")
    if "CLEARML_CONFIG_FILE" in os.environ:
        return
    config = out / "clearml.conf"
    config.parent.mkdir(parents=True, exist_ok=True)
    # report_use_subprocess off: else closing the task waits ~11 s for ClearML's reporter process.
    config.write_text(
        "sdk {\n"
        "  development { report_use_subprocess: false }\n"
        f"  storage {{ cache {{ default_base_dir: {json.dumps(str(out / 'clearml'))} }} }}\n"
        "}\n"
    )
    os.environ["CLEARML_CONFIG_FILE"] = str(config)


STRAGGLER_SLOWDOWN = 3  # with several lanes, the last one generates this many times slower


def _rollout_worker(lane: int, step: int, pause_s: float) -> None:
    with trace_state("generate", state_lane_id=lane, step=step, worker=f"vllm-{lane}"):
        time.sleep(pause_s)


def run_demo(
    steps: int = 20,
    backends: Sequence[str] = DEFAULT_BACKENDS,
    val_every: int = 10,
    lanes: int = 4,
    pause_s: float = 0.002,
    seed: int = 0,
    project: str = "otel-tracking-demo",
    experiment: str = "grpo-simulated",
) -> Tracking:
    rng = random.Random(seed)
    config = {"trainer": {"total_training_steps": steps, "logger": list(backends)}, "actor": {"lr": 1e-6}}
    generations = ValidationGenerationsLogger(project, experiment)
    tracking = Tracking(project, experiment, default_backend=list(backends), config=config)
    with tracking, ThreadPoolExecutor(max_workers=lanes) as pool:
        for step in range(1, steps + 1):
            timings: dict[str, float] = {}
            with trace_state("step", step=step):
                for phase in ("rollout", "reward", "update"):
                    started = time.perf_counter()
                    with trace_state(phase, step=step):
                        if phase == "rollout":
                            # Each lane's span nests under rollout: a pool thread's phase hangs
                            # under the phase that handed it the work (trace_state's docs).
                            futures = [
                                pool.submit(
                                    _rollout_worker,
                                    lane,
                                    step,
                                    pause_s * (STRAGGLER_SLOWDOWN if lanes > 1 and lane == lanes - 1 else 1),
                                )
                                for lane in range(lanes)
                            ]
                            for future in futures:
                                future.result()
                        else:
                            time.sleep(pause_s)
                    timings[phase] = time.perf_counter() - started
            tracking.log(step_metrics(step, rng, timings), step=step)
            if val_every and step % val_every == 0:
                with trace_state("validate", step=step):
                    score = 0.3 + 0.5 * (1.0 - math.exp(-step / 15.0))
                    tracking.log({"val-core/openai/gsm8k/reward/mean@4": score}, step=step)
                    samples = [
                        (p, f"simulated answer {step}.{i}", round(score + rng.gauss(0, 0.05), 3))
                        for i, p in enumerate(PROMPTS)
                    ]
                    generations.log(list(backends), samples, step)
    return tracking


def goodput_summary(metrics_path: Path) -> str | None:
    """The mean of each step's ``anatomy/*`` shares, read back from the file sink's events file
    (beside its metrics file)."""
    from otel_tracking.exporters.file import read_anatomy

    shares: dict[str, list[float]] = {}
    for data in read_anatomy(metrics_path).values():
        for key in ("goodput", "overhead_frac", "idle_frac"):
            if f"anatomy/{key}" in data:
                shares.setdefault(key, []).append(data[f"anatomy/{key}"])
    if not shares.get("goodput"):
        return None
    mean = {key: 100 * sum(values) / len(values) for key, values in shares.items()}
    return (
        f"goodput {mean['goodput']:.0f}% of the step's wall time (overhead {mean['overhead_frac']:.0f}%, "
        f"idle {mean['idle_frac']:.0f}%), mean of {len(shares['goodput'])} steps"
    )


def straggler_summary(events_path: Path) -> str | None:
    """Which lane the run's phases waited for most, read back from its events file (what
    ``otel-tracking timeline`` draws), or None when no phase ran on several lanes."""
    from collections import Counter

    from otel_tracking.cli.timeline import lane_label, read_spans, select_steps, stragglers

    spans = read_spans([events_path])
    steps = [s.step for s in spans if s.step is not None]
    if not steps:
        return None
    found = stragglers(select_steps(spans, min(steps), max(steps)))
    if not found:
        return None
    (phase, lane), count = Counter((f.phase, f.lane) for f in found).most_common(1)[0]
    lags = sorted(f.lag_s for f in found if (f.phase, f.lane) == (phase, lane))
    of = len({f.step for f in found if f.phase == phase})
    return (
        f"straggler: in {phase!r}, {lane_label(lane)} ended last in {count} of {of} steps "
        f"(median {1000 * lags[len(lags) // 2]:.1f} ms after the median lane)"
    )
