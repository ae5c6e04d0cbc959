"""The documented import path ``otel_tracking.ray_tracing``: the very module ``otel_tracking.distributed.ray_tracing``
(one module object under both names: a monkeypatch or a private name reaches the same thing)."""

import sys
from typing import TYPE_CHECKING

from otel_tracking.distributed import ray_tracing as _module

if TYPE_CHECKING:
    from otel_tracking.distributed.ray_tracing import *  # noqa: F403

sys.modules[__name__] = _module
