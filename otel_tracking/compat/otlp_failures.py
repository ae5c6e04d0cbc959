"""Why an OTLP export failed, said once by the sink, instead of the SDK's lines at every attempt.

The SDK's OTLP exporters report a failed export by logging an error ("Failed to export spans batch
due to timeout, max retries or shutdown.", the same line at every attempt: ten in a three-step run
against a dead endpoint) and returning FAILURE, which carries no reason.  Behind a :class:`Sink`,
:func:`explain_failures` makes an exporter's failed ``export()`` raise :class:`OTLPExportError`
with the reason instead (cannot connect, the HTTP status, the gRPC code), so that the sink's
first-failure warning says why (scrubbed there: an endpoint can carry credentials) and later
failures are counted in the summary.  What the SDK logs during our export call, on that thread,
is kept for the reason and not printed; its lines elsewhere (someone else's exporter) are left alone.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, TypeVar

_T = TypeVar("_T")
_SDK_LOGGERS = "opentelemetry.exporter.otlp"
_held = threading.local()  # .records: the SDK's log records of the export running on this thread
_installed: set[str] = set()


class OTLPExportError(Exception):
    """An OTLP export the endpoint did not take, with the reason."""


class _HoldDuringExport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        records = getattr(_held, "records", None)
        if records is None:
            return True
        records.append(record)
        return False


_FILTER = _HoldDuringExport()


def _install_filter() -> None:
    """On every logger of the SDK's OTLP exporter modules (a logger's filter sees only its own
    records, not its children's), first: the SDK's own DuplicateFilter, on some of them, would
    otherwise swallow a second sink's record of the same kind before it reached us.  The modules
    are imported when this runs."""
    names = [name for name in logging.Logger.manager.loggerDict if name.startswith(_SDK_LOGGERS)]
    for name in names:
        if name not in _installed:
            _installed.add(name)
            logging.getLogger(name).filters.insert(0, _FILTER)


def explain_failures(exporter: _T) -> _T:
    """Make ``exporter.export`` raise :class:`OTLPExportError` (with the reason) where it would
    return FAILURE; for an exporter behind a :class:`Sink` only (which counts the exception as
    the failure it is), never one handed to the SDK's own processors."""
    _install_filter()
    client = getattr(exporter, "_client", None)
    if callable(getattr(client, "export", None)) and hasattr(client, "_transport"):
        # The SDK's HTTP client (1.45+) returns the request's error, which its log line leaves out.
        client_export = client.export  # type: ignore[union-attr]

        def export_and_keep_reason(data: Any) -> Any:
            result = client_export(data)
            reasons = getattr(_held, "reasons", None)
            if reasons is not None and not getattr(result, "success", True):
                reasons.append(_http_reason(result, str(getattr(client, "_endpoint", ""))))
            return result

        client.export = export_and_keep_reason  # type: ignore[union-attr]

    export = exporter.export  # type: ignore[attr-defined]
    endpoint = str(getattr(exporter, "_endpoint", "") or "")

    def export_or_raise(data: Any) -> Any:
        _held.records, _held.reasons = [], []
        try:
            result = export(data)
            records, found = _held.records, _held.reasons
        except Exception as error:  # older SDKs' HTTP exporters let requests' ConnectionError out
            raise OTLPExportError(_error_reason(error, endpoint)) from error
        finally:
            _held.records = _held.reasons = None
        if getattr(result, "name", "") != "FAILURE":
            return result
        raise OTLPExportError(found[-1] if found else _said(records))

    exporter.export = export_or_raise  # type: ignore[attr-defined]
    return exporter


_RETRYING = re.compile(r",? retrying in [0-9.]+s?\.?$")


def _said(records: list[logging.LogRecord]) -> str:
    """The reason among the SDK's own lines: its last error, else its first warning (older SDKs
    warn "Transient error ... retrying in 1s." and then, as ``one_try_per_export`` stops that
    retry, "Shutdown in progress, aborting retry.")."""
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    if errors:
        return errors[-1]
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    warnings = [w for w in warnings if not w.startswith("Shutdown in progress")]
    return _RETRYING.sub("", warnings[0]) if warnings else "the exporter reported FAILURE"


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")]+)")


def _http_reason(result: Any, endpoint: str) -> str:
    """One line for a failed OTLP/HTTP request: the status, or why no connection was made."""
    status = getattr(result, "status_code", None)
    if status is not None:
        reason = getattr(result, "reason", None) or ""
        return f"{endpoint} answered HTTP {status}{' ' + reason if reason else ''}"
    error = getattr(result, "error", None)
    return f"no answer from {endpoint}" if error is None else _error_reason(error, endpoint)


def _error_reason(error: BaseException, endpoint: str) -> str:
    text = str(error)
    errno = _ERRNO.search(text)  # requests' connection errors bury the reason in three wrappers
    if errno:
        return f"cannot connect to {endpoint} ({errno.group(1).strip()})"
    return f"{endpoint}: {type(error).__name__}: {text}"
