"""Shared test setup: every test runs in its own directory with a clean environment, and the
reference module (verl's tracking.py, ``../shared/baseline/seed_tracking.py``) is importable for
differential tests."""

from __future__ import annotations

import importlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
# The reference lives beside the repository (shared/baseline); OTEL_TRACKING_SHARED overrides.
SHARED = Path(os.environ.get("OTEL_TRACKING_SHARED", REPO.parent / "shared"))

_CLEARED_PREFIXES = (
    "OTEL_",
    "VERL_",
    "WANDB_",
    "MLFLOW_",
    "SWANLAB_",
    "CLEARML_",
    "TRACKIO_",
    "TENSORBOARD_",
    "VOLC_",
    "MLP_",
)


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh working directory and an environment without any tracker or OTel variables."""
    for name in list(os.environ):
        if name.startswith(_CLEARED_PREFIXES) or name == "RANK":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACKING_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    _finish_leftover_runs()


def _finish_leftover_runs() -> None:
    from otel_tracking import run as run_module

    while (leftover := run_module.current_run()) is not None:
        leftover.finish()


@pytest.fixture(scope="session")
def seed() -> ModuleType:
    """The reference module, imported from shared/baseline (never skipped: CI has it)."""
    baseline = SHARED / "baseline"
    assert (baseline / "seed_tracking.py").is_file(), f"reference baseline not found under {baseline}"
    if str(baseline) not in sys.path:
        sys.path.insert(0, str(baseline))
    return importlib.import_module("seed_tracking")


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trackio reads TRACKIO_DIR once, at its first import: every test of the session shares one."""
    return tmp_path_factory.mktemp("trackio")


@pytest.fixture(scope="session")
def clearml_config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ClearML may read its configuration once per process: keep the file for the whole session.
    path = tmp_path_factory.mktemp("clearml") / "clearml.conf"
    path.write_text("sdk {\n  development {\n    report_use_subprocess: false\n  }\n}\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
