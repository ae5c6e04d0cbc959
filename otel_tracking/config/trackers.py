"""The ML trackers we deliver to: one row each, the only table a new tracker is added to.

A row says where the tracker's code is (``otel_tracking.exporters.<module>``, imported only when
its backend is asked for), which package its SDK is (the extra of the backend's name installs it:
a missing one is a ``ConfigError`` naming the extra before anything starts), and which of its
variables say where it writes (kept in each spool header so that ``otel-tracking replay`` goes
where the run was configured to go; never its credentials).  The backend names verl's ``Tracking``
accepts come first, in verl's order; a tracker of ours verl does not know follows them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tracker:
    module: str  # under otel_tracking.exporters
    sdk: str  # the top-level package of its SDK
    destination: tuple[str, ...] = ()  # variables that say where it writes (never credentials)
    directories: tuple[str, ...] = ()  # those of them that name a directory (kept absolute)


TRACKERS: dict[str, Tracker] = {
    "wandb": Tracker("wandb", "wandb", ("WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "WANDB_ENTITY"), ("WANDB_DIR",)),
    "mlflow": Tracker("mlflow", "mlflow", ("MLFLOW_TRACKING_URI",)),
    "swanlab": Tracker("swanlab", "swanlab", ("SWANLAB_MODE", "SWANLAB_LOG_DIR"), ("SWANLAB_LOG_DIR",)),
    # no extra of ours installs Volcengine ML Platform's SDK
    "vemlp_wandb": Tracker("vemlp_wandb", "volcengine_ml_platform", ("MLP_TRACKING_REGION",)),
    "tensorboard": Tracker("tensorboard", "tensorboard", ("TENSORBOARD_DIR",), ("TENSORBOARD_DIR",)),
    "clearml": Tracker(
        "clearml", "clearml", ("CLEARML_API_HOST", "CLEARML_WEB_HOST", "CLEARML_FILES_HOST", "CLEARML_OFFLINE_MODE")
    ),
    "trackio": Tracker("trackio", "trackio", ("TRACKIO_DIR", "TRACKIO_SERVER_URL"), ("TRACKIO_DIR",)),
}

# verl's Tracking.supported_backend, in its order: the trackers above and our other sinks
VERL_BACKENDS: tuple[str, ...] = (
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "tensorboard",
    "console",
    "clearml",
    "trackio",
    "file",
    "rl_insight",
)
SUPPORTED_BACKENDS: tuple[str, ...] = VERL_BACKENDS + tuple(name for name in TRACKERS if name not in VERL_BACKENDS)
