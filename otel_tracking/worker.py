"""The documented import path ``otel_tracking.worker``: the very module ``otel_tracking.distributed.worker``
(one module object under both names: a monkeypatch or a private name reaches the same thing)."""

import sys
from typing import TYPE_CHECKING

from otel_tracking.distributed import worker as _module

if TYPE_CHECKING:
    from otel_tracking.distributed.worker import *  # noqa: F403

sys.modules[__name__] = _module
