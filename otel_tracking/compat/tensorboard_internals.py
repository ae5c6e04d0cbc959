"""TensorBoard's private name, named here and nowhere else: the checksum its record writer uses.

TensorBoard's event-file writer checksums every record with ``masked_crc32c``, looked up at each
write in ``tensorboard.summary.writer.record_writer``.  Without TensorFlow that is its stub's
pure-Python CRC32C, the larger part of the time of a burst of steps.  In the bridge process, which
runs only our code and the trackers', :func:`checksums_in_c` puts google-crc32c's C checksum under
that name: the same bytes on disk.  That module attribute is not TensorBoard's API:
:data:`PRIVATE_NAMES` lists it, :data:`TESTED_RELEASES` the releases it was checked against.
Whichever path runs is said once per process at debug; a tested release without the name warns
once, and TensorBoard's own checksum stays.  ``tests/test_tensorboard_internals.py`` is the
contract with the pinned TensorBoard.
"""

from __future__ import annotations

import logging
from typing import Any

from otel_tracking.compat._said import SaidOnce, tested_release

logger = logging.getLogger("otel_tracking.tensorboard")
_say = SaidOnce(
    logger,
    "otel-tracking: TensorBoard checksums: %s",
    "otel-tracking: TensorBoard's %s; its own (pure-Python) checksum stays",
)

# The TensorBoard releases whose record writer this was checked against.
TESTED_RELEASES = ((2, 21),)

PRIVATE_NAMES: dict[str, tuple[str, ...]] = {"tensorboard.summary.writer.record_writer": ("masked_crc32c",)}


def tested_version(tensorboard: Any) -> bool:
    return tested_release(tensorboard, TESTED_RELEASES)


def masked_crc32c(data: bytes) -> int:
    """The masked CRC32C of a TFRecord (length, then payload), as TensorBoard's writer computes it,
    from google-crc32c's C code."""
    import google_crc32c

    crc = int(google_crc32c.value(data))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def checksums_in_c() -> bool:
    """TensorBoard's record writer takes its checksum from C in this process (the bridge process
    only: the training process's TensorBoard is left as it is).  False, and nothing changed, without
    google-crc32c or with a TensorBoard whose writer has no such name (said once, why)."""
    try:
        import google_crc32c  # noqa: F401
    except ImportError:
        _say("pure-Python CRC32C: google-crc32c is not installed")
        return False
    try:
        import tensorboard
        from tensorboard.summary.writer import record_writer
    except ImportError:
        _say("pure-Python CRC32C: tensorboard.summary.writer.record_writer is not importable")
        return False
    if not callable(getattr(record_writer, "masked_crc32c", None)):
        release = getattr(tensorboard, "__version__", "?")
        _say(f"record writer in {release} has no masked_crc32c", moved=tested_version(tensorboard))
        return False
    record_writer.masked_crc32c = masked_crc32c
    _say("CRC32C from google-crc32c's C code, in the record writer's masked_crc32c")
    return True
