"""Prometheus scrape targets as file-based service discovery files.

``register_metrics(addresses, job_name, labels)`` of the reference API lands here: one JSON file
per registration in ``OTEL_TRACKING_SCRAPE_TARGETS_DIR`` (the directory the collector's prometheus
receiver watches with ``file_sd_configs``; ``otel-tracking stack up`` prints it), in the standard
format ``[{"targets": ["host:port"], "labels": {"job": ..., ...}}]``.  Files are written atomically
(temp file + rename), so the collector never reads half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from otel_tracking.config import paths


def scrape_targets(
    addresses: list[str], job_name: str | None, labels: list[dict[str, Any] | None] | None
) -> list[dict[str, Any]]:
    """One file_sd group per address; ``labels[i]`` (if given) labels ``addresses[i]``."""
    groups = []
    for index, address in enumerate(addresses):
        target = address.split("://", 1)[-1].rstrip("/")
        group_labels = {"job": job_name or "otel_tracking"}
        if labels and index < len(labels) and labels[index]:
            group_labels.update({str(k): str(v) for k, v in labels[index].items()})  # type: ignore[union-attr]
        groups.append({"targets": [target], "labels": group_labels})
    return groups


def safe_job_name(job_name: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", job_name or "otel_tracking") or "otel_tracking"


def write_targets_file(directory: Path, job_name: str | None, groups: list[dict[str, Any]]) -> Path:
    """``<directory>/<job>-<digest of the groups>.json``: registering other addresses for the same
    job adds a file, registering the same ones again rewrites the same file.  The collector only
    globs ``*.json``, so the temp file it is written through is never read half-written."""
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(json.dumps(groups, sort_keys=True).encode()).hexdigest()[:12]
    path = directory / f"{safe_job_name(job_name)}-{digest}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(groups, handle, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def remove_targets_files(directory: Path, job_name: str | None) -> None:
    for path in directory.glob(f"{safe_job_name(job_name)}-*.json"):
        path.unlink(missing_ok=True)


def register_scrape_targets(
    addresses: list[str], job_name: str | None, labels: list[dict[str, Any] | None] | None
) -> list[dict[str, Any]]:
    groups = scrape_targets(addresses, job_name, labels)
    directory = paths.targets_dir()
    if directory is not None:
        write_targets_file(directory, job_name, groups)
    return groups
