"""The documented import path ``otel_tracking.worker``; the module is ``otel_tracking.distributed.worker``."""

from otel_tracking.distributed.worker import *  # noqa: F403
