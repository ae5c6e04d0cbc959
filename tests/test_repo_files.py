"""What the repository ships beside the code: its licence, and the benchmark's way to the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_license_file_is_the_apache_license_pyproject_names() -> None:
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text().splitlines()
    text = (REPO / "LICENSE").read_text()
    assert text.split("\n", 2)[:2] == [" " * 33 + "Apache License", " " * 27 + "Version 2.0, January 2004"]
    assert "END OF TERMS AND CONDITIONS" in text and "http://www.apache.org/licenses/LICENSE-2.0" in text


def test_the_benchmark_finds_the_reference_without_shared_baseline(tmp_path: Path) -> None:
    """Without ``../shared/baseline`` (a checkout elsewhere), bench/bench_log.py falls back to verl's
    own tracking.py from PyPI, as the differential tests do (tests/reference.py)."""
    code = (
        "import sys; sys.path.insert(0, 'bench'); import bench_log; "
        "cls = bench_log.reference_factory(); print(cls.__module__, cls.__name__)"
    )
    env = {**os.environ, "OTEL_TRACKING_SHARED": str(tmp_path / "no-shared-here")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["verl.utils.tracking", "Tracking"]
    assert "reference: verl 0.9.1 from PyPI" in done.stderr
