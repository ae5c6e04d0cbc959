"""The reference the differential tests compare with: verl's ``tracking.py``.

Beside the repository (``../shared/baseline/seed_tracking.py``, or ``OTEL_TRACKING_SHARED``) when
it is there; otherwise verl's own module from PyPI: the wheel is downloaded without dependencies
(``pip download --no-deps verl==VERSION``), ``verl/utils/tracking.py`` and the console logger it
imports (``verl/utils/logger/aggregate_logger.py``) are unpacked into a cache and loaded by path.
Importing the ``verl`` package itself would pull torch; ``aggregate_logger`` imports torch at its
top for helpers the reference never calls, so a placeholder ``torch`` module stands in while that
one file executes, and is removed right after.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

VERL_VERSION = "0.9.1"
_FILES = ("verl/utils/tracking.py", "verl/utils/logger/aggregate_logger.py")


def load(shared: Path) -> tuple[types.ModuleType, str]:
    """(the reference module, which reference it is)."""
    baseline = shared / "baseline"
    if (baseline / "seed_tracking.py").is_file():
        if str(baseline) not in sys.path:
            sys.path.insert(0, str(baseline))
        return importlib.import_module("seed_tracking"), f"{baseline / 'seed_tracking.py'}"
    root = _cached_wheel_files()
    return _load_from(root), f"verl {VERL_VERSION} from PyPI ({root / _FILES[0]})"


def _cache_root() -> Path:
    base = os.environ.get("OTEL_TRACKING_CACHE_DIR") or os.path.expanduser("~/.cache/otel-tracking")
    return Path(base) / "reference" / f"verl-{VERL_VERSION}"


def _cached_wheel_files() -> Path:
    root = _cache_root()
    if all((root / name).is_file() for name in _FILES):
        return root
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"verl=={VERL_VERSION}", "-d", download],
            check=True,
            timeout=600,
        )
        (wheel,) = Path(download).glob("verl-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            for name in _FILES:
                target = root / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    return root


def _load_from(root: Path) -> types.ModuleType:
    """verl.utils.tracking from ``root``, with verl.utils.logger.LocalLogger importable."""
    for package in ("verl", "verl.utils", "verl.utils.logger"):
        module = types.ModuleType(package)
        module.__path__ = [str(root / package.replace(".", "/"))]
        sys.modules.setdefault(package, module)
    placeholder = "torch" not in sys.modules
    if placeholder:
        sys.modules["torch"] = types.ModuleType("torch")  # only while aggregate_logger.py executes
    try:
        aggregate = _exec("verl.utils.logger.aggregate_logger", root / _FILES[1])
    finally:
        if placeholder:
            del sys.modules["torch"]
    sys.modules["verl.utils.logger"].LocalLogger = aggregate.LocalLogger  # type: ignore[attr-defined]
    return _exec("verl.utils.tracking", root / _FILES[0])


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
