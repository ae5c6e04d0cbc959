"""Where a run's files go on disk, by the variables that say so: the spool
(``OTEL_TRACKING_SPOOL_DIR``), the file sink (``VERL_FILE_LOGGER_PATH`` / ``_ROOT``, the
reference's rules), TensorBoard (``TENSORBOARD_DIR``) and the scrape targets
(``OTEL_TRACKING_SCRAPE_TARGETS_DIR``).  A name that becomes part of a path (project, experiment,
run id, sink) goes through :func:`path_part` and never leaves its directory."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def spool_root(env: Mapping[str, str] | None = None) -> Path:
    raw = _env(env).get("OTEL_TRACKING_SPOOL_DIR")
    return Path(os.path.expanduser(raw or "~/.cache/otel-tracking/spool"))


def spool_dir(project: str, experiment: str, run_id: str, env: Mapping[str, str] | None = None) -> Path:
    """<OTEL_TRACKING_SPOOL_DIR or ~/.cache/otel-tracking/spool>/<project>/<experiment>-<run id>/,
    each part by :func:`path_part`: whatever the names, the directory is inside the spool root."""
    return spool_root(env) / path_part(project) / f"{path_part(experiment)}-{path_part(run_id)}"


_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_MAX_PART = 100


def path_part(name: str) -> str:
    """A name as one directory entry that stays where it is put: every character outside
    ``A-Za-z0-9_.-`` becomes ``_``; a name of dots only (``.``, ``..``) or none becomes
    underscores; a name longer than 100 characters is cut to 87 plus ``-`` and 12 hex digits of
    its SHA-1 (names that differ stay apart)."""
    safe = _UNSAFE_PATH_CHARS.sub("_", name)
    if not safe.strip("."):
        safe = "_" * max(1, len(safe))
    if len(safe) > _MAX_PART:
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        safe = f"{safe[: _MAX_PART - 13]}-{digest}"
    return safe


def confined(name: str) -> str:
    """A project or experiment name as a relative path that stays under its directory: ``/``
    still nests (``"qwen/grpo"``, as the reference writes it), but an absolute start, ``.`` and
    empty parts are dropped and a part of dots only (``..``) becomes underscores, so
    ``"../../../escaped/x"`` is ``"__/__/__/escaped/x"``."""
    parts = [part for part in re.split(r"[/\\]", name) if part not in ("", ".")]
    kept = ["_" * len(part) if not part.strip(".") else part for part in parts]
    return "/".join(kept) or "_"


def file_sink_path(project: str, experiment: str, env: Mapping[str, str] | None = None) -> Path:
    """The reference's rules: VERL_FILE_LOGGER_PATH, else <VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl,
    the names :func:`confined` to that root."""
    e = _env(env)
    explicit = e.get("VERL_FILE_LOGGER_PATH")
    if explicit is not None:
        return Path(explicit)
    root = Path(os.path.expanduser(e.get("VERL_FILE_LOGGER_ROOT", ".")))
    return root / confined(project) / f"{confined(experiment)}.jsonl"


def tensorboard_dir(project: str, experiment: str, env: Mapping[str, str] | None = None) -> Path:
    """TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment>, the names :func:`confined`."""
    e = _env(env)
    explicit = e.get("TENSORBOARD_DIR")
    if explicit:
        return Path(explicit)
    return Path("tensorboard_log") / confined(project) / confined(experiment)


def targets_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where scrape-target files go (the collector's file_sd directory), if configured."""
    raw = _env(env).get("OTEL_TRACKING_SCRAPE_TARGETS_DIR")
    return Path(os.path.expanduser(raw)) if raw else None
