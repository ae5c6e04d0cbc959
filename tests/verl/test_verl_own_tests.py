"""verl's own CPU tests of the single controller pass with the instrumentation on.

They are verl's files as its wheel installs them (a top-level ``tests`` package in the verl venv),
run by pytest in a process of their own with ``OTEL_TRACKING_VERL=1`` and a real OTLP endpoint:
the decorator (sync, async and TensorDict dispatch), fused workers (``_fuw_execute``) and the
workers' environment (``worker_env``, which our ``runtime_env`` merge must not
disturb).  Each starts its own Ray cluster, as verl's tests do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import verl

from tests.otlp_receiver import HttpReceiver

VERL_TESTS = Path(verl.__file__).resolve().parent.parent / "tests" / "single_controller"
FILES = (
    "test_decorator_on_cpu.py",
    "test_fused_workers_on_cpu.py",
    "test_ray_local_envs_on_cpu.py",
)


def test_verl_single_controller_tests_pass_instrumented(tmp_path: Path) -> None:
    with HttpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "PYTHONPATH"))}
        env.update(
            OTEL_TRACKING_VERL="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_TRACKING_SPOOL_DIR=str(tmp_path / "spool"),
            PYTHONFAULTHANDLER="1",  # a crash (CI saw a SIGSEGV once) leaves its Python stacks in the output
        )
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(VERL_TESTS),
             *(str(VERL_TESTS / name) for name in FILES)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "otel-tracking: verl instrumented (OTEL_TRACKING_VERL=1)" in output
    assert "could not instrument" not in output and "failed (" not in output
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) == 6, output[-2000:]
