"""The documented import path ``otel_tracking.propagation``; the module is ``otel_tracking.distributed.propagation``."""

from otel_tracking.distributed.propagation import *  # noqa: F403
