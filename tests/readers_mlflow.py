"""Reading an MLflow tracking store back through MLflow's own client (no mocks)."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any


def client(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def make_experiment(mlflow_client: Any, name: str, artifact_root: Path) -> str:
    """An experiment whose artifacts live under ``artifact_root`` (with a sqlite URI they would go to
    ./mlruns otherwise)."""
    artifact_root.mkdir(parents=True, exist_ok=True)
    return str(mlflow_client.create_experiment(name, artifact_location=artifact_root.as_uri()))


def only_run(mlflow_client: Any, experiment_id: str) -> Any:
    runs = mlflow_client.search_runs([experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def _plain(value: float) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def metric_triples(mlflow_client: Any, run_id: str) -> list[tuple[str, int, Any]]:
    """Every stored (key, step, value) of the run, sorted; NaN as the string "nan" so lists compare."""
    run = mlflow_client.get_run(run_id)
    triples = []
    for key in run.data.metrics:
        for metric in mlflow_client.get_metric_history(run_id, key):
            triples.append((metric.key, metric.step, _plain(metric.value)))
    return sorted(triples, key=lambda t: (t[0], t[1], str(t[2])))


def artifact_bytes(mlflow_client: Any, run_id: str, path: str, dst: Path) -> bytes:
    dst.mkdir(parents=True, exist_ok=True)
    local = mlflow_client.download_artifacts(run_id, path, str(dst))
    return Path(local).read_bytes()


def artifact_json(mlflow_client: Any, run_id: str, path: str, dst: Path) -> Any:
    return json.loads(artifact_bytes(mlflow_client, run_id, path, dst))


def traces(mlflow_client: Any, experiment_id: str, run_id: str | None = None) -> list[Any]:
    return list(mlflow_client.search_traces(locations=[experiment_id], run_id=run_id))


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
