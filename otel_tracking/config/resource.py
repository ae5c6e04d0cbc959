"""The OTel Resource of one process of a run: who is speaking, on every signal it sends."""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.sdk.resources import Resource

from otel_tracking.config.settings import Settings
from otel_tracking.signals import semconv
from otel_tracking.signals.redact import is_secret_key, redact


def build_resource(settings: Settings) -> Resource:
    """The run's identity, on top of what any OTel app's resource has: ``Resource.create`` gives
    ``telemetry.sdk.*`` and runs the standard detectors (``OTEL_RESOURCE_ATTRIBUTES`` among them);
    our identity attributes win, and keys that look secret are dropped."""
    attributes: dict[str, Any] = dict(settings.resource_attributes)
    attributes.update(
        {
            "service.name": settings.service_name,
            "service.instance.id": settings.run_id,
            semconv.PROJECT: settings.project,
            semconv.EXPERIMENT: settings.experiment,
            semconv.RUN_ID: settings.run_id,
            semconv.RUN_ATTEMPT: settings.attempt,
            "host.name": settings.host,
            "process.pid": os.getpid(),
        }
    )
    if settings.rank is not None:
        attributes[semconv.RANK] = settings.rank
    if settings.role:
        attributes[semconv.ROLE] = settings.role
    created = Resource.create(attributes)
    kept = {k: redact(v) for k, v in created.attributes.items() if not is_secret_key(k)}
    return RunResource(kept, created.schema_url)


class RunResource(Resource):
    """A Resource that works its hash out once.  The OTLP encoders group every span, log record
    and metric by ``hash(resource)``, and the SDK's hash dumps the attributes to JSON each time:
    about 5 of the 17 µs it took to encode a worker's span, measured when this was added.  A run's
    resource never changes after it is built, so its hash cannot either."""

    _hash: int | None = None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = super().__hash__()
        return self._hash
