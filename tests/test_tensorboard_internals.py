"""The contract with the pinned TensorBoard (``compat/tensorboard_internals.py``): the private name
the bridge process replaces is there, replacing it writes records TensorBoard's own checksum
accepts, and without it TensorBoard's checksum stays, with a warning that says so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from otel_tracking.compat import tensorboard_internals

pytestmark = pytest.mark.backend


@pytest.fixture
def record_writer(monkeypatch: pytest.MonkeyPatch) -> object:
    """TensorBoard's record writer module, its checksum put back after the test; each reason said anew."""
    from tensorboard.summary.writer import record_writer

    monkeypatch.setattr(record_writer, "masked_crc32c", record_writer.masked_crc32c)
    monkeypatch.setattr(tensorboard_internals._say, "said", set())
    return record_writer


def test_the_pinned_tensorboard_has_every_private_name_and_is_a_tested_release() -> None:
    import importlib

    import tensorboard

    assert tensorboard_internals.tested_version(tensorboard), (
        f"TensorBoard {tensorboard.__version__} is not in TESTED_RELEASES {tensorboard_internals.TESTED_RELEASES}: "
        "run this test against it, then add it"
    )
    for where, names in tensorboard_internals.PRIVATE_NAMES.items():
        module = importlib.import_module(where)
        for name in names:
            assert callable(getattr(module, name, None)), f"{where}.{name} moved: checksums_in_c() no longer works"


def test_checksums_in_c_replaces_the_writers_checksum_and_says_so_at_debug(
    record_writer: object, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    caplog.set_level(logging.DEBUG, logger="otel_tracking.tensorboard")
    assert tensorboard_internals.checksums_in_c()
    assert record_writer.masked_crc32c is tensorboard_internals.masked_crc32c  # type: ignore[attr-defined]
    assert any("from google-crc32c's C code" in r.getMessage() for r in caplog.records)
    writer = EventFileWriter(str(tmp_path))
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    raw = path.read_bytes()
    assert int.from_bytes(raw[8:12], "little") == tensorboards(raw[:8])


def test_without_the_private_name_tensorboards_checksum_stays_with_one_warning(
    record_writer: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(record_writer, "masked_crc32c")
    assert not tensorboard_internals.checksums_in_c()
    assert not tensorboard_internals.checksums_in_c()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "masked_crc32c" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert not hasattr(record_writer, "masked_crc32c")
