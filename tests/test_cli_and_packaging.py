"""The command line, the demo, entry points and import hygiene."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from otel_tracking.config.trackers import TRACKERS
from otel_tracking.exporters.file import read_anatomy

# every tracker's SDK (a new tracker's too) and the heavy packages they bring
BACKEND_SDKS = sorted({tracker.sdk for tracker in TRACKERS.values()} | {"torch", "pandas", "numpy"})


def test_import_is_lazy() -> None:
    code = (
        "import sys, otel_tracking;"
        f"heavy=[m for m in sys.modules if m.split('.')[0] in {BACKEND_SDKS!r} or m.startswith('opentelemetry.sdk')];"
        "print(heavy);"
        "from otel_tracking import Tracking, trace_state;"
        f"print([m for m in sys.modules if m.split('.')[0] in {BACKEND_SDKS!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "[]"]


def test_entry_points_are_registered_and_load() -> None:
    from opentelemetry.sdk._logs.export import LogRecordExporter
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

    trackers = set(TRACKERS)  # every tracker, by its backend name, for each signal
    expected = {
        "opentelemetry_metrics_exporter": (MetricExporter, {"file", "ml_console"} | trackers),
        "opentelemetry_traces_exporter": (SpanExporter, {"file"} | trackers),
        "opentelemetry_logs_exporter": (LogRecordExporter, {"file"} | trackers),
    }
    for group, (base, names) in expected.items():
        found = {ep.name: ep for ep in entry_points(group=group) if ep.value.startswith("otel_tracking.")}
        assert names <= set(found), group
        for name in names:
            assert issubclass(found[name].load(), base)


def test_demo_runs_and_says_where_it_wrote(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_tracking",
            "demo",
            "--backends",
            "console,file",
            "--steps",
            "12",
            "--out",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "Where each sink wrote:" in out.stdout
    metrics_file = tmp_path / "demo" / "grpo-simulated.jsonl"  # not demo/otel-tracking-demo/...
    assert str(metrics_file) in out.stdout
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [line["step"] for line in lines] == [*range(1, 11), 10, 11, 12]  # step 10 also has validation
    # the demo measures each step's anatomy: in the events file, the metrics file keeps verl's lines
    anatomy = read_anatomy(metrics_file)
    assert sorted(anatomy) == list(range(1, 13))
    assert all(k.startswith("anatomy/") for data in anatomy.values() for k in data)
    assert len(lines[0]["data"]) >= 30
    assert lines[10]["data"].keys() == {"val-core/openai/gsm8k/reward/mean@4"}
    console = [line for line in out.stdout.splitlines() if line.startswith("step:")]
    assert len(console) == 13  # one line per log(), as verl prints; no anatomy line
    assert "The step's anatomy: goodput " in out.stdout
    events_file = metrics_file.with_name("grpo-simulated.events.jsonl")
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    spans = {e["span_id"]: e for e in events if e["type"] == "span"}
    generate = [s for s in spans.values() if s["name"] == "generate"]
    assert len(generate) == 12 * 4
    for span in generate:
        rollout = spans[span["parent_span_id"]]
        assert rollout["name"] == "rollout"
        assert spans[rollout["parent_span_id"]]["name"] == "step"
    assert {s["attributes"]["ml.lane"] for s in generate} == {0, 1, 2, 3}
    generations = [e for e in events if e.get("event_name") == "ml.validation.generations"]
    assert [g["attributes"]["ml.step"] for g in generations] == [10]
    assert len(generations[0]["body"]["samples"]) == 4


def test_the_lazy_module_lists_its_public_names() -> None:
    """In a fresh interpreter (here the names may already be loaded): dir() shows the lazy names."""
    import subprocess
    import sys

    code = "import otel_tracking as o; print(' '.join(dir(o))); print(' '.join(o.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    names, public = (set(line.split()) for line in out.stdout.splitlines())
    assert {"Tracking", "trace_state", "RLInsightLogger", "ValidationGenerationsLogger", "ConfigError"} <= names
    assert public <= names


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed ``otel-tracking`` command, as a user runs it."""
    import os

    command = Path(sys.executable).with_name("otel-tracking")
    return subprocess.run(
        [str(command), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def test_cli_rejects_bad_demo_arguments_with_one_line(tmp_path: Path) -> None:
    for args, message in [
        (("--lanes", "0"), "argument --lanes: 0 is below the minimum 1"),
        (("--steps", "-3"), "argument --steps: -3 is below the minimum 1"),
        (("--val-every", "-1"), "argument --val-every: -1 is below the minimum 0"),
        (("--backends", ""), "argument --backends: name at least one backend"),
    ]:
        done = _cli("demo", "--out", str(tmp_path), *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert not (tmp_path / "otel-tracking-demo").exists()


def test_cli_expected_errors_are_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = {"OTEL_TRACKING_QUEUE_SIZE": "lots"}
    done = _cli("demo", "--steps", "1", "--out", str(tmp_path), env=bad)
    assert done.returncode == 1
    expected = "otel-tracking: error: OTEL_TRACKING_QUEUE_SIZE='lots' is not a number"
    assert done.stderr.strip().splitlines()[-1] == expected
    assert "Traceback" not in done.stderr
    debug = _cli("--debug", "demo", "--steps", "1", "--out", str(tmp_path), env=bad)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_cli_version_and_help_show_defaults() -> None:
    from otel_tracking import __version__

    assert _cli("--version").stdout.strip() == f"otel-tracking {__version__}"
    help_text = _cli("demo", "--help").stdout
    assert "(default: 20)" in help_text
    assert "--free-ports" in _cli("stack", "--help").stdout
    for command in ((), ("demo",), ("stack",), ("replay",)):
        text = _cli(*command, "--help").stdout
        assert "`" not in text and "default: None" not in text, (command, text)
    replay_help = " ".join(_cli("replay", "--help").stdout.split())
    assert "75 when something is left for a later replay" in replay_help
    assert "130 when interrupted" in replay_help


def test_the_demo_keeps_its_files_under_out_and_says_what_to_run_next(tmp_path: Path) -> None:
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    done = _cli("demo", "--steps", "2", "--out", str(out), env={"HOME": str(home)})
    assert done.returncode == 0, done.stderr
    # TensorBoard on the project's directory: the run is then named after the experiment
    assert f"tensorboard --logdir {out / 'tensorboard' / 'otel-tracking-demo'}\n" in done.stdout
    assert list(home.iterdir()) == [], "nothing written under the home directory"


def test_the_demo_runs_clearml_offline_under_out(tmp_path: Path) -> None:
    """ClearML refuses Task.init without a server or config; the demo makes it offline like wandb,
    SwanLab and MLflow, its session under --out."""
    import os

    from tests.readers_clearml import read_session

    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEARML_")}
    command = Path(sys.executable).with_name("otel-tracking")
    done = subprocess.run(
        [str(command), "demo", "--backends", "clearml", "--steps", "3", "--val-every", "0", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**env, "HOME": str(home)},
    )
    assert done.returncode == 0, done.stderr
    (folder,) = sorted((out / "clearml" / "offline").glob("offline-*/"))
    session = read_session(folder)
    assert session.project == "otel-tracking-demo"
    assert sorted({iteration for _, _, iteration, _ in session.user_scalars()}) == [1, 2, 3]
    # ClearML's session cache file is pinned to the home folder; nothing else goes there.
    assert [p.relative_to(home).as_posix() for p in home.rglob("*") if p.is_file()] == [".clearml/.session.json"]


def test_the_stack_files_sit_beside_the_stack_module(tmp_path: Path) -> None:
    from otel_tracking_stack.stack import COLLECTOR_CONFIG, COLLECTOR_MANIFEST, StackError, manifest_key

    package = Path(__file__).resolve().parent.parent / "otel_tracking_stack"
    assert package / "collector-config.yaml" == COLLECTOR_CONFIG  # this checkout
    assert COLLECTOR_MANIFEST.is_file()
    missing = tmp_path / "deploy" / "collector" / "builder-config.yaml"
    with pytest.raises(StackError, match=r"cannot read .*deploy/collector/builder-config.yaml"):
        manifest_key(missing)


def _source_tree_copy(dest: Path) -> Path:
    """The checkout's source files (tracked and new, not ignored), without venvs and build output."""
    repo = Path(__file__).resolve().parent.parent
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        timeout=60,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            source = repo / name
            if source.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    else:  # not a git checkout
        skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*cache*")
        shutil.copytree(repo, dest, ignore=skip, dirs_exist_ok=True)
    return dest


def _tree(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*") if "__pycache__" not in path.parts}


def test_pip_wheel_leaves_the_checkout_as_it_was(tmp_path: Path) -> None:
    """setuptools built in the checkout and left build/ and otel_tracking.egg-info/ there; the
    build backend (build_backend/otel_tracking_build.py) keeps them in a temporary directory."""
    import zipfile

    source = _source_tree_copy(tmp_path / "src")
    before = _tree(source)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    assert _tree(source) - before == set()
    (wheel,) = (tmp_path / "dist").glob("otel_tracking-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {"otel_tracking/__init__.py", "otel_tracking/cli/main.py", "otel_tracking_stack/collector-config.yaml"}
    assert wanted <= names
    # every package of the checkout (pyproject.toml lists them one by one)
    packages = {str(p.relative_to(source)) for p in (source / "otel_tracking").rglob("__init__.py")}
    assert packages - names == set()
    assert not [name for name in names if name.startswith(("build_backend", "tests/"))]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with otel-tracking installed from a wheel built from this checkout, as users
    install it (the wheel's dependencies resolved by pip)."""
    root = tmp_path_factory.mktemp("wheel")
    source = _source_tree_copy(root / "src")
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run(
        [*pip, "wheel", "--quiet", "--no-deps", "-w", str(root / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("otel_tracking-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr
    return venv


@pytest.mark.stack
def test_the_stack_runs_from_a_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    """`otel-tracking stack build/up/status/down` from the wheel's venv, away from the checkout:
    the configs come from the wheel's package data and the cached binaries are reused (the wheel's
    manifest is the checkout's, so is the cache key)."""
    import os

    from otel_tracking_stack.stack import build_collector

    site = next((wheel_venv / "lib").glob("python3*/site-packages"))
    packaged = site / "otel_tracking_stack"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = str(wheel_venv / "bin" / "otel-tracking")

    def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [command, "stack", *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
        )

    build = cli("build")
    assert build.returncode == 0, build.stderr
    paths = dict(line.split(None, 1) for line in build.stdout.splitlines())
    assert paths["collector"] == str(build_collector()), "the wheel rebuilt instead of reusing the cache"
    for name, relative in [
        ("collector-config", "collector-config.yaml"),
        ("jaeger-config", "deploy/jaeger/config.yaml"),
        ("agent-config", "deploy/collector/agent.yaml"),
        ("manifest", "deploy/collector/builder-config.yaml"),
    ]:
        assert paths[name] == str(packaged / relative), name
        assert Path(paths[name]).is_file()
    state = tmp_path / "state"
    up = cli("up", "--free-ports", "--state-dir", str(state), timeout=180)
    try:
        assert up.returncode == 0, up.stderr
        status = cli("status", "--json", "--state-dir", str(state))
        assert status.returncode == 0, status.stdout
        programs = json.loads(status.stdout)
        assert all(s["healthy"] for s in programs.values()), programs
        for name, config in [("collector", "collector-config.yaml"), ("jaeger", "deploy/jaeger/config.yaml")]:
            argv = Path(f"/proc/{programs[name]['pid']}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("--config") + 1] == str(packaged / config), argv
    finally:
        down = cli("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    after = cli("status", "--state-dir", str(state))
    assert after.returncode == 3 and after.stdout.count("stopped") == 5
