"""``opentelemetry-instrument``'s entry point (group ``opentelemetry_instrumentor``, name ``verl``):
``opentelemetry-instrument python -m verl.trainer.main_ppo ...`` instruments verl 0.7 and later.
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=verl`` leaves it out."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_tracking.verl import install


class VerlInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    def instrumentation_dependencies(self) -> Collection[str]:
        return ("verl >= 0.7",)

    def _instrument(self, **kwargs: Any) -> None:
        install("opentelemetry-instrument")

    def _uninstrument(self, **kwargs: Any) -> None:
        # The patches stay: verl's classes were swapped at import, and undoing that under a
        # running trainer would mix the two facades.
        return None
