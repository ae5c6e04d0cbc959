"""Credentials scrubbed once, where every span and log record leaves a run.

Two wrappers, as Logfire wraps its own processors: :class:`ScrubbingSpanProcessor` and
:class:`ScrubbingLogProcessor` apply ``signals/redact.py``'s rules (by key, then by value) to what
any code set on a span or record before it reaches the run's sinks: ``trace_state`` labels,
attributes set on the span it yields, exception events and the error status, event bodies and
attributes.  Nothing is scrubbed before that, and nothing after: a sink, the spool, the bridge
process and OTLP all get what passed here.  A span with nothing to scrub goes on as it is; one
with something is copied (the SDK's spans are read-only once ended).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import Link, Status

from otel_tracking.compat.otel_sdk import (
    LogRecordProcessor,
    ReadWriteLogRecord,
    span_attribute_items,
    span_has_events_or_links,
)
from otel_tracking.signals.redact import REDACTED, is_secret_key, redact, scrub_value


def scrubbed_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``attributes`` with each secret key's value replaced and every string scrubbed; None when
    nothing changed (the common case: no copy)."""
    if not attributes:
        return None
    changed: dict[str, Any] | None = None
    for key, value in attributes.items():
        if isinstance(value, str):
            clean = _clean_string(key, value) if len(value) <= _CACHED_LENGTH else _clean(key, value)
        elif is_secret_key(key):
            clean = REDACTED
        elif isinstance(value, (list, tuple)):
            clean = redact(value)
        else:  # numbers and bools: nothing to scrub
            continue
        if clean != value:
            if changed is None:
                changed = dict(attributes)
            changed[key] = clean
    return changed


def _clean(key: str, value: str) -> str:
    return REDACTED if is_secret_key(key) else scrub_value(value)


# Spans repeat the same short strings (lane, run id, phase) thousands of times: one cached lookup
# instead of a key check and a pattern search for each.
_CACHED_LENGTH = 256
_clean_string = functools.lru_cache(maxsize=4096)(_clean)


def scrubbed_span(span: ReadableSpan) -> ReadableSpan:
    """``span``, or a copy of it with its attributes, events, links and status scrubbed."""
    plain = not span_has_events_or_links(span) and not span.status.description
    if plain:  # nothing but a name and attributes: maybe a set already found clean
        key = (span.name, span_attribute_items(span))
        try:
            if key in _clean_spans:
                return span
        except TypeError:  # an unhashable value: scrubbed as any other span
            plain = False
    out = _scrubbed_span(span)
    if plain and out is span:
        if len(_clean_spans) >= _CLEAN_SPANS_KEPT:
            _clean_spans.clear()
        _clean_spans[key] = None
    return out


# The names and attributes of spans found to have nothing to scrub: a worker's spans repeat the same
# few (phase, lane, step) at every call, scrubbed once each instead of at every span.  Only what
# was found clean is kept: two sets equal as tuples (1 == 1.0 == True) are either both clean or
# both scrubbed, since only strings and secret keys' values are ever changed.
_clean_spans: dict[tuple[str, tuple[tuple[str, Any], ...]], None] = {}
_CLEAN_SPANS_KEPT = 4096


def _scrubbed_span(span: ReadableSpan) -> ReadableSpan:
    attributes = scrubbed_attributes(span.attributes)
    span_events, span_links, status = span.events, span.links, span.status
    name = _scrubbed_name(span.name)  # trace_state(f"download https://user:{pw}@host/...")
    events = span_events and _scrubbed_events(span_events)
    links = span_links and _scrubbed_all(span_links, lambda link, clean: Link(link.context, clean))
    description = status.description and scrub_value(status.description)
    if description != status.description:
        status = Status(status.status_code, description)
    if attributes is None and not events and not links and status is span.status and name == span.name:
        return span
    return ReadableSpan(
        name=name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attributes or span.attributes,
        events=events or span_events,
        links=links or span_links,
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


# Span and event names repeat (one per phase): cached, as short attribute values are.
_scrubbed_name = functools.lru_cache(maxsize=4096)(scrub_value)


def _scrubbed_events(events: Sequence[Event]) -> list[Event] | None:
    """Events, each rebuilt where its name or attributes had something to scrub; None when none had."""
    out: list[Event] = []
    changed = False
    for event in events:
        clean = scrubbed_attributes(event.attributes)
        name = _scrubbed_name(event.name)
        if clean is None and name == event.name:
            out.append(event)
        else:
            changed = True
            out.append(Event(name, clean if clean is not None else event.attributes, event.timestamp))
    return out if changed else None


def _scrubbed_all(items: Sequence[Any], rebuild: Callable[[Any, dict[str, Any]], Any]) -> list[Any] | None:
    """Events or links, each rebuilt with its attributes scrubbed where they had something to
    scrub; None when none had."""
    cleaned = [scrubbed_attributes(item.attributes) for item in items]
    if all(clean is None for clean in cleaned):
        return None
    return [item if clean is None else rebuild(item, clean) for item, clean in zip(items, cleaned, strict=True)]


class ScrubbingSpanProcessor(SpanProcessor):
    """Hands ``inner`` each ended span scrubbed."""

    def __init__(self, inner: SpanProcessor) -> None:
        self._inner = inner

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self._inner.on_end(scrubbed_span(span))

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class ScrubbingLogProcessor(LogRecordProcessor):
    """Scrubs each emitted record's body and attributes (a processor may change the record it
    is given), then hands it to ``inner``."""

    def __init__(self, inner: LogRecordProcessor) -> None:
        self._inner = inner

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        record = log_record.log_record
        record.body = redact(record.body)
        attributes = scrubbed_attributes(record.attributes)
        if attributes is not None:
            record.attributes = attributes
        self._inner.on_emit(log_record)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)
