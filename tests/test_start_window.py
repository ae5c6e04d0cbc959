"""Errors that need no server are found in the training process, before any bridge process starts.

Opening a tracker can be slow or hang (issue 11); what can be known without a server (a missing
SDK package, a tracking URI MLflow would refuse, missing credentials variables) raises
``ConfigError`` from ``Tracking()`` in milliseconds, without importing any SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from otel_tracking import Tracking
from otel_tracking.settings import ConfigError
from tests.servers import live_children

# --- errors that need no server ---------------------------------------------------------------------

SDK_PACKAGES = {
    "mlflow": "mlflow",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "swanlab": "swanlab",
    "clearml": "clearml",
    "trackio": "trackio",
}

WITHOUT_SDKS = textwrap.dedent(
    """
    import json, os, site, sys
    site.addsitedir(sys.argv[1])  # site-packages without the trackers' SDKs (python -S)
    from otel_tracking import Tracking
    from otel_tracking.settings import ConfigError
    from tests.servers import live_children

    errors = {}
    for backend in sys.argv[2:]:
        try:
            Tracking("proj", "exp", default_backend=["file", backend])
            errors[backend] = None
        except ConfigError as error:
            errors[backend] = str(error)
    imported = sorted(m for m in sys.argv[2:] if m in sys.modules)
    print(json.dumps({"errors": errors, "imported": imported, "children": len(live_children())}))
    """
)


def test_a_missing_sdk_package_is_a_config_error_naming_the_extra(tmp_path: Path) -> None:
    """The same rule for every tracker, found without importing anything or starting a process
    (MLflow used to retry for ~10 s and end "not reachable").  The packages are hidden the way an
    environment without them looks: a site-packages without their directories."""
    site_packages = Path(sysconfig.get_paths()["purelib"])
    hidden = tmp_path / "site-packages"
    hidden.mkdir()
    for entry in site_packages.iterdir():
        if entry.name not in SDK_PACKAGES.values():
            (hidden / entry.name).symlink_to(entry)
    done = subprocess.run(
        [sys.executable, "-S", "-c", WITHOUT_SDKS, str(hidden), *SDK_PACKAGES],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for backend, package in SDK_PACKAGES.items():
        assert report["errors"][backend] == (
            f"backend {backend!r} needs the {package!r} package: pip install 'otel-tracking[{backend}]'"
        )
    assert report["imported"] == [] and report["children"] == 0


def test_vemlp_wandb_without_its_platform_package_is_a_config_error(isolated: Path) -> None:
    """``volcengine_ml_platform`` is not installable here: the real missing-package case."""
    before = live_children()
    with pytest.raises(ConfigError, match="'volcengine_ml_platform' package"):
        Tracking("proj", "exp", default_backend=["file", "vemlp_wandb"])
    assert "volcengine_ml_platform" not in sys.modules
    assert live_children() == before  # no bridge process was started


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("notascheme:/x", "has the scheme 'notascheme', for which MLflow has no tracking store"),
        ("garbage", "is a local path, and MLflow 3 refuses its file store"),
        ("http://[::1", "cannot be parsed as a URI"),
        ("http:///no-host", "has no host"),
    ],
)
def test_a_tracking_uri_mlflow_refuses_is_a_config_error_before_any_process(
    isolated: Path, monkeypatch: pytest.MonkeyPatch, uri: str, message: str
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    before = live_children()
    with pytest.raises(ConfigError, match=message):
        Tracking("proj", "exp", default_backend=["file", "mlflow"])
    assert live_children() == before


def test_the_tracking_uri_check_agrees_with_mlflow() -> None:
    """Our check, made without importing MLflow, refuses what MLflow's client refuses when it is
    built (the schemes are MLflow's registry's), and takes what it takes."""
    from mlflow import MlflowClient
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    from otel_tracking.exporters import mlflow as bridge

    registered = set(_tracking_store_registry._registry)
    ours = {"", "file", *bridge.TRACKING_SCHEMES, *bridge.UNITY_CATALOG_SCHEMES, *bridge.DATABASE_SCHEMES}
    assert registered - bridge._plugin_schemes() == ours
    for uri in [
        "notascheme:/x",
        "garbage",
        "file:///tmp/mlruns",
        "http://[::1",
        "sqlite+a+b:///x.db",
        "sqlitex:///x.db",
        "https://mlflow.example.invalid",
        "databricks",
        "databricks://profile",
        "uc",
        "databricks-uc://profile",
    ]:
        try:
            MlflowClient(tracking_uri=uri)
            refused = False
        except Exception:
            refused = True
        assert (bridge.tracking_uri_problem(uri) is not None) == refused, uri
