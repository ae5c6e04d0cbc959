"""The reattach record: what a restarted job needs to continue the same run in every tracker.

A driver run keeps one small JSON file beside its spool, keyed by project, experiment and run id::

    <spool root>/<project>/<experiment>-<run id>/run.json        (run.rank<r>.json with RANK set)

    {"project": ..., "experiment": ..., "run_id": ..., "rank": ..., "attempt": 2,
     "state": "running" | "finished", "exit_code": ..., "updated": <unix time>,
     "backends": {"wandb": {"id": ..., "project": ..., "entity": ...}, "mlflow": {"run_id": ...}, ...}}

It is rewritten (a temporary file, fsync, ``os.replace``: never half-written) when the run starts,
each time a tracker opens and says how to reattach to its run, and at ``finish()``, so a job
killed with SIGKILL leaves a record that names every tracker run it had opened.

``OTEL_TRACKING_RESUME`` (or ``Tracking(..., resume=...)``):

* ``never`` (the default): a new run, a new record;
* ``auto``: the newest record of the same project and experiment (and rank), finished or not;
* ``<run id>``: that run's record.

A resume that finds no record starts a new run (with the given run id, if one was given) and says
so in one line on stderr.  Found: the run id is kept, ``ml.run.attempt`` is the record's plus one,
and each tracker is opened with what its record entry says (``TrackerContext.resume``).

Where the resumed job restarts, the *checkpoint step* ``c``: what the killed job logged at steps
after ``c`` is superseded; up to ``c`` it stands.  ``OTEL_TRACKING_RESUME_STEP`` says it; else verl's
config does (:func:`checkpoint_step`: verl reloads ``global_step_c``, logs its validation at ``c``
and trains from ``c + 1``); else it is the step before the first one the resumed job logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NEVER = "never"
AUTO = "auto"
_RUN_ID = re.compile(r"^(?!\.+$)[A-Za-z0-9_.\-]{1,128}$")  # and not "." or ".."
_MODE_WORDS = ("never", "auto", "allow", "true", "false")  # the words of 4 letters or more parse_mode knows


def is_run_id(text: str) -> bool:
    return bool(_RUN_ID.match(text))


def looks_like_a_mode(value: str) -> bool:
    """Whether a would-be run id is one typo away from a word of :func:`parse_mode` (``atuo``,
    ``nevr``, ``Auot``): one edit or a swap of neighbours, for words of 4 letters or more."""
    lowered = value.lower()
    return any(_one_edit_apart(lowered, word) for word in _MODE_WORDS)


def _one_edit_apart(a: str, b: str) -> bool:
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 1:
            return True
        return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def parse_mode(raw: str | None, variable: str = "OTEL_TRACKING_RESUME") -> str:
    """``never``, ``auto`` or a run id; ``ValueError`` naming ``variable`` for anything else."""
    value = (raw or "").strip()
    lowered = value.lower()
    if lowered in ("", NEVER, "false", "no", "0", "off"):
        return NEVER
    if lowered in (AUTO, "true", "yes", "1", "on", "allow"):
        return AUTO
    if not is_run_id(value):
        raise ValueError(
            f"{variable}={raw!r} is not 'auto', 'never' or a run id (letters, digits, '_', '.', '-'; not only dots)"
        )
    return value


def record_name(rank: int | None) -> str:
    return "run.json" if rank is None else f"run.rank{rank}.json"


@dataclass(frozen=True)
class Resumed:
    """What a resumed run starts from: the previous attempt's record."""

    run_id: str
    attempt: int  # this attempt's number: the record's plus one
    backends: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # backend name -> reattach info
    previous_state: str = "running"  # "running": the previous attempt never finished (killed)
    path: Path | None = None


def _load(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


def find(
    project_dir: Path, experiment_dirname: str, project: str, experiment: str, rank: int | None, mode: str
) -> Resumed | None:
    """The record to resume from: for ``auto`` the newest one of this project, experiment and rank
    (under ``project_dir``, in directories ``<experiment_dirname>-<run id>``); for a run id, that
    run's; None when there is none."""
    if mode == NEVER:
        return None
    name = record_name(rank)
    if mode == AUTO:
        candidates = sorted(project_dir.glob(f"{glob_escape(experiment_dirname)}-*/{name}"))
    else:
        candidates = [project_dir / f"{experiment_dirname}-{mode}" / name]
    best: tuple[float, dict[str, Any], Path] | None = None
    for path in candidates:
        record = _load(path)
        if record is None or record.get("project") != project or record.get("experiment") != experiment:
            continue  # another experiment whose name starts the same way ("exp" and "exp-2")
        if path.parent.name != f"{experiment_dirname}-{record['run_id']}":
            continue
        updated = float(record.get("updated") or 0.0)
        if best is None or updated > best[0]:
            best = (updated, record, path)
    if best is None:
        return None
    _, record, path = best
    raw = record.get("backends")
    backends: dict[str, Any] = raw if isinstance(raw, dict) else {}
    return Resumed(
        run_id=str(record["run_id"]),
        attempt=int(record.get("attempt") or 1) + 1,
        backends={str(k): dict(v) for k, v in backends.items() if isinstance(v, dict)},
        previous_state=str(record.get("state") or "running"),
        path=path,
    )


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


class RunRecord:
    """The record of the running attempt, rewritten atomically on every change."""

    def __init__(
        self,
        path: Path,
        project: str,
        experiment: str,
        run_id: str,
        attempt: int,
        rank: int | None,
        backends: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._record: dict[str, Any] = {
            "project": project,
            "experiment": experiment,
            "run_id": run_id,
            "rank": rank,
            "attempt": attempt,
            "state": "running",
            "exit_code": None,
            # What the previous attempt knew stays until this attempt's tracker says otherwise:
            # a tracker that does not open this time can still be reattached by the next one.
            "backends": {k: dict(v) for k, v in (backends or {}).items()},
        }

    @property
    def backends(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._record["backends"].items()}

    def write(self) -> bool:
        """Write the record now; False (and a warning left to the caller) when it cannot be written."""
        with self._lock:
            self._record["updated"] = time.time()
            text = json.dumps(self._record, default=str, sort_keys=True)
            return _write_atomically(self.path, text)

    def set_backend(self, name: str, info: Mapping[str, Any] | None) -> bool:
        if not info:
            return True
        with self._lock:
            if self._record["backends"].get(name) == dict(info):
                return True
            self._record["backends"][name] = dict(info)
        return self.write()

    def finished(self, exit_code: int) -> bool:
        with self._lock:
            self._record["state"] = "finished"
            self._record["exit_code"] = exit_code
        return self.write()


def _write_atomically(path: Path, text: str) -> bool:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False


# --- where the resumed job restarts -----------------------------------------------------------

_GLOBAL_STEP = re.compile(r"global_step_(\d+)")


def checkpoint_step(config: Any, cwd: Path | None = None) -> int | None:
    """The step of the checkpoint a verl job resumes from, read from its config as ``Tracking``
    got it, the way verl's ``RayPPOTrainer._load_checkpoint`` finds it: ``trainer.resume_mode``
    ``resume_path``: the N of ``global_step_N`` in ``trainer.resume_from_path``; ``auto``: the
    number in ``<trainer.default_local_dir>/latest_checkpointed_iteration.txt`` (relative to the
    working directory); anything else (``disable``, no checkpoint yet, not a verl config): None."""
    trainer = _field(config, "trainer")
    mode = _field(trainer, "resume_mode")
    if mode == "resume_path":
        match = _GLOBAL_STEP.search(str(_field(trainer, "resume_from_path") or ""))
        return int(match.group(1)) if match else None
    if mode != "auto" or _field(trainer, "default_local_dir") is None:
        return None
    tracker = Path(cwd or Path.cwd()) / str(_field(trainer, "default_local_dir")) / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def _field(value: Any, name: str) -> Any:
    """``value[name]`` of a dict or an OmegaConf ``DictConfig`` (``get``), else None."""
    get = getattr(value, "get", None)
    if value is None or isinstance(value, (str, bytes)) or not callable(get):
        return None
    try:
        return get(name)
    except Exception:  # a config object whose get() wants other arguments
        return None
