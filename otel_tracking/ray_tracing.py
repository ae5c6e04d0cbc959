"""The documented import path ``otel_tracking.ray_tracing``; the module is ``otel_tracking.distributed.ray_tracing``."""

from otel_tracking.distributed.ray_tracing import *  # noqa: F403
