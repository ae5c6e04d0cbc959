"""The run's config as the trackers get it: made once, where ``Tracking`` takes it.

verl hands ``Tracking`` its whole OmegaConf config.  Trackers record it (as params, or the run's
config) redacted: ``redact_config`` keeps credentials out.  A few values a tracker must use as they
are (``trainer.wandb_proxy``, with the credentials in its URL) are kept apart and never recorded.
The step of the checkpoint a verl job resumes from comes from the same config
(``config/resume.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_tracking.config.resume import checkpoint_step
from otel_tracking.config.settings import Settings
from otel_tracking.signals.redact import redact_config


@dataclass(frozen=True)
class RunConfig:
    """The run's config as the trackers get it, made once, where ``Tracking`` takes it: redacted
    (``recorded``: what trackers record, as params or the run's config), and the values a tracker
    uses as they are (``inputs``, taken before redaction: today ``trainer.wandb_proxy``, which
    wandb must reach with the credentials in its URL while the config it records says
    ``http://<redacted>@proxy:8080``), never logged or recorded; and the step of the checkpoint a
    verl job resumes from, as its config says (``resume.checkpoint_step``)."""

    recorded: Any = None
    inputs: Mapping[str, str] = field(default_factory=dict)
    checkpoint_step: int | None = None

    @classmethod
    def of(cls, config: Any) -> RunConfig:
        inputs: dict[str, str] = {}
        trainer = config.get("trainer") if isinstance(config, Mapping) or _mapping_like(config) else None
        if isinstance(trainer, Mapping) or _mapping_like(trainer):
            proxy = trainer.get("wandb_proxy")  # type: ignore[union-attr]
            if proxy:
                inputs["wandb_proxy"] = str(proxy)
        return cls(redact_config(config), inputs, checkpoint_step(config))


def restart_step(settings: Settings, config: RunConfig) -> int | None:
    """The checkpoint step a resumed job restarts from (config/resume.py): OTEL_TRACKING_RESUME_STEP,
    else what verl's config says; None: the step before the first one it logs."""
    return settings.resume_step if settings.resume_step is not None else config.checkpoint_step


def _mapping_like(value: Any) -> bool:
    # OmegaConf's DictConfig: get() and items(), no Mapping subclass.
    return hasattr(value, "get") and hasattr(value, "items") and not isinstance(value, (str, bytes))
