"""verl 0.7.1 and 0.8.0 (no ``verl.plugins`` there; ``opentelemetry-instrument`` or the Ray setup
hook switch them on): their ``tracking.py``, verbatim, gets the facade swap.  Light: a stand-in
``verl`` package holding only that module, taken from verl's wheel on PyPI at test time (nothing of
verl's is kept in this repository), no torch, so it runs in any venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

WHEELS = Path(os.environ.get("OTEL_TRACKING_CACHE", Path.home() / ".cache" / "otel-tracking")) / "verl-wheels"


def older_verl(version: str) -> Path:
    """A folder holding a stand-in ``verl`` package: an empty ``verl/__init__.py`` (the real one
    imports torch) and ``verl/utils/tracking.py`` as verl ``version``'s wheel has it, downloaded
    once into the cache."""
    root = WHEELS / f"stand-in-{version}"
    tracking = root / "verl" / "utils" / "tracking.py"
    if not tracking.is_file():
        wheels = list(WHEELS.glob(f"verl-{version}-*.whl"))
        if not wheels:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS), f"verl=={version}"],
                check=True,
                timeout=600,
            )
            wheels = list(WHEELS.glob(f"verl-{version}-*.whl"))
        with zipfile.ZipFile(wheels[0]) as wheel:
            source = wheel.read("verl/utils/tracking.py")
        tracking.parent.mkdir(parents=True, exist_ok=True)
        (root / "verl" / "__init__.py").write_text(f"# Stand-in for verl {version}: only verl/utils/tracking.py.\n")
        (root / "verl" / "utils" / "__init__.py").write_text("")
        tracking.write_bytes(source)
    return root


SCRIPT = """
import json, sys
if sys.argv[1] == "on":
    from otel_tracking.verl import install
    install("test")
from verl.utils.tracking import Tracking, ValidationGenerationsLogger
tracking = Tracking("proj", "exp", default_backend="file")
tracking.log({"actor/loss": 0.5, "timing_s/step": 1.25, "count": 3}, step=1)
tracking.log({"actor/loss": 0.25}, step=2)
# no finish(): 0.7 and 0.8 have none (their Tracking ends in __del__); ours ends at exit
print(json.dumps([Tracking.__module__, ValidationGenerationsLogger.__module__]))
"""


def run(version: str, mode: str, tmp: Path) -> tuple[list[str], list[dict], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    sink = tmp / f"{mode}.jsonl"
    env.update(
        PYTHONPATH=str(older_verl(version)),
        VERL_FILE_LOGGER_PATH=str(sink),
        OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"),
        OTEL_SDK_DISABLED="true",  # no OTLP endpoint here: the ML side is what this test is about
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, cwd=tmp, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in sink.read_text().splitlines()]
    return json.loads(done.stdout.splitlines()[-1]), lines, done.stderr


@pytest.mark.parametrize("version", ["0.7.1", "0.8.0"])
def test_older_verl_tracking_gets_the_facade_swap(version: str, tmp_path: Path) -> None:
    theirs, their_lines, _ = run(version, "off", tmp_path)
    ours, our_lines, stderr = run(version, "on", tmp_path)
    assert theirs == ["verl.utils.tracking", "verl.utils.tracking"]
    assert ours == ["otel_tracking.api.facade", "otel_tracking.api.generations"]
    assert our_lines == their_lines  # the same file sink, line for line
    warnings = [line for line in stderr.splitlines() if "could not instrument" in line]
    assert len(warnings) == 1, stderr
    assert "verl.utils.tracking.DapoFilteredRewardTableLogger, verl.utils.tracking.RLInsightLogger" in warnings[0]


LATE = """
import sys, types
from verl.utils.tracking import Tracking as verl_tracking  # bound before the switch, like a trainer
trainer = types.ModuleType("verl.trainer_stand_in")
trainer.Tracking = verl_tracking
sys.modules[trainer.__name__] = trainer
from otel_tracking.verl import install
install("late")
import verl.utils.tracking as module
print(trainer.Tracking.__module__, module.Tracking.__module__, module.verl_Tracking.__module__)
"""


def test_a_late_switch_rebinds_what_verl_modules_bound_already(tmp_path: Path) -> None:
    """``worker_setup`` in a process that imported verl already: the modules that bound verl's
    ``Tracking`` get ours too, and verl's stays reachable as ``verl_Tracking``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    env.update(PYTHONPATH=str(older_verl("0.8.0")), OTEL_SDK_DISABLED="true")
    command = [sys.executable, "-c", LATE]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["otel_tracking.api.facade", "otel_tracking.api.facade", "verl.utils.tracking"]


def test_ray_init_gets_the_runtime_env_and_the_setup_hook_where_plugins_do_not_reach(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from otel_tracking.verl.ray_env import SETUP_HOOK, merged_runtime_env

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20secret-token")
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")  # verl's plugins will not load us
    env = merged_runtime_env({"env_vars": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://mine:4318"}, "pip": ["x"]})
    assert env["env_vars"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://mine:4318", "the caller's runtime_env wins"
    assert env["env_vars"]["OTEL_TRACKING_VERL"] == "1" and env["pip"] == ["x"]
    assert "secret-token" not in repr(env)
    assert env["worker_process_setup_hook"] == SETUP_HOOK
    assert merged_runtime_env({"worker_process_setup_hook": "mine.setup"})["worker_process_setup_hook"] == "mine.setup"
    # verl 0.9.1's metadata (what importlib.metadata reads), whatever this venv holds
    dist = tmp_path / "verl-0.9.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 0.9.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "auto")
    assert "worker_process_setup_hook" not in merged_runtime_env(None), "import verl loads the plugin there"
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "someone_else")
    assert merged_runtime_env(None)["worker_process_setup_hook"] == SETUP_HOOK


INSIGHT = """
import json
from otel_tracking.verl import install
install("test")
from verl.utils.tracking import RLInsightLogger, Tracking
tracking = Tracking("proj", "exp", default_backend="file")
with RLInsightLogger.trace_state("generate", state_lane_id="replica_0"):
    pass
tracking.log({"actor/loss": 0.5}, step=1)
RLInsightLogger.log({"rollout/tokens_per_s": 900.0}, step=500)  # rl_insight's own step
with RLInsightLogger.trace_state("generate", state_lane_id="replica_0"):
    pass
tracking.log({"actor/loss": 0.25}, step=2)
tracking.finish()
"""


def test_rl_insight_log_does_not_move_the_drivers_step(tmp_path: Path) -> None:
    """verl 0.9.1's ``RLInsightLogger`` patched on the class (its ``tracking.py`` alone, no torch):
    ``RLInsightLogger.log(step=500)`` feeds the OTLP gauges only, so the next phase is stamped
    step 2, not 501, and the file sink keeps Tracking's steps (issue 19, item 10)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_"))}
    sink = tmp_path / "exp.jsonl"
    env.update(
        PYTHONPATH=str(older_verl("0.9.1")),
        VERL_FILE_LOGGER_PATH=str(sink),
        OTEL_TRACKING_SPOOL_DIR=str(tmp_path / "spool"),
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
    )
    done = subprocess.run(
        [sys.executable, "-c", INSIGHT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in sink.read_text().splitlines()] == [1, 2]
    events = [json.loads(line) for line in (tmp_path / "exp.events.jsonl").read_text().splitlines()]
    phases = [e for e in events if e.get("name") == "generate"]
    # the phase after the insight values: the step in progress is Tracking's 2
    assert phases[1]["attributes"]["ml.step"] == 2, phases
    assert {p["attributes"]["ml.lane"] for p in phases} == {"replica_0"}
