"""``otel-tracking timeline``: a picture of a step, from the spans a run left in its events files.

Reads the ``span`` lines of the file sink's events files (``<experiment>.events.jsonl``: the
training process's, and any other process's that wrote one) and the spans of OTLP/JSON files (what
a collector's ``file`` exporter writes: the worker processes that export only over OTLP), and with
``--traces-url`` the run's spans the stack's trace UI (Zipkin) keeps, then keeps the
spans of the chosen steps (a span's ``ml.step``, else the step of its trace's ``ml.step`` root), and
writes two files, beside the first file or in the first directory it was given unless ``--out``
says where:

* ``<out>.html``: one self-contained page (inline SVG, no script, nothing fetched) that a browser
  opens offline: each step's extent on top (its root span, ``ml.step``, drawn once there rather
  than as a bar over the phases it holds), one row per lane (the training process's phases first, then each
  role and rank, each ``ml.lane``), nested spans stacked inside their row, the time between spans left empty
  (idle), and each phase's straggler named: of the spans under one phase on several lanes, the one
  that ended last, and how much later than the median lane it ended;
* ``<out>.json``: the same spans as Chrome trace events (complete ``X`` events, one process per
  role and rank, one thread per lane, named with metadata events), which Perfetto
  (ui.perfetto.dev) and ``chrome://tracing`` open.
"""

from __future__ import annotations

import html
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_tracking.cli.stalls import events_files
from otel_tracking.signals.semconv import CONTINUES, LANE, RANK, ROLE, RUN_ID, STEP, STEP_SPAN_NAME


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int
    step: int | None
    lane: tuple[str, str]  # (process: "driver" or "<role> rank <r>", lane within it: "" or the ml.lane)
    attributes: dict[str, Any] = field(default_factory=dict)
    depth: int = 0


def read_spans(files: Iterable[Path], traces_url: str | None = None, skipped: list[str] | None = None) -> list[Span]:
    """Every span line of the events files, with its step (its own, else its trace root's); with
    ``traces_url``, also the run's spans the trace UI keeps (the run of the files' spans).  A line
    that is no span this can draw (cut short by a kill, without ids or times, a step that is not a
    number) is left out, and said in ``skipped`` (one reason per line), rather than ending the read."""
    skipped = [] if skipped is None else skipped
    raw: list[dict[str, Any]] = []
    for path in files:
        with open(path, "rb") as handle:
            for line in handle:
                otlp = b'"resourceSpans"' in line
                if not otlp and b'"type":"span"' not in line:
                    continue
                try:
                    record = json.loads(line)
                    raw.extend(otlp_json_spans(record) if otlp else [record])
                except (ValueError, TypeError, AttributeError) as error:  # a line cut short by a kill, ...
                    skipped.append(f"{path.name}: {type(error).__name__}")
    if traces_url:
        runs = {_resource(s).get(RUN_ID) for s in raw} - {None}
        known = {s.get("span_id") for s in raw}
        for run_id in sorted(runs, key=str):
            raw.extend(s for s in zipkin_spans(traces_url, str(run_id)) if s["span_id"] not in known)
    root_steps: dict[Any, int] = {}
    continued: set[Any] = set()  # the traces of a step's second root (the step logged again)
    for s in raw:
        step = _step(_attributes(s).get(STEP))
        if s.get("name") == STEP_SPAN_NAME and s.get("parent_span_id") is None and step is not None:
            root_steps[s.get("trace_id")] = step
            if _attributes(s).get(CONTINUES):
                continued.add(s.get("trace_id"))
    spans = []
    for s in raw:
        try:
            spans.append(_span(s, root_steps, continued))
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            skipped.append(f"span {str(s.get('name', '?'))[:80]!r}: {type(error).__name__} {error}"[:200])
    return spans


def _span(s: dict[str, Any], root_steps: dict[Any, int], continued: set[Any]) -> Span:
    """One span line as drawn; KeyError, TypeError or ValueError for a line that is none."""
    attributes = _attributes(s)
    name, trace_id, span_id = s["name"], s["trace_id"], s["span_id"]
    if not all(isinstance(v, str) and v for v in (name, trace_id, span_id)):
        raise ValueError("no name, trace_id or span_id")
    start_ns, end_ns = int(s["start_time_unix_nano"]), int(s["end_time_unix_nano"])
    own = attributes.get(STEP)
    step = _step(own) if own is not None else None
    if own is not None and step is None:
        raise ValueError(f"ml.step {own!r} is not a step")
    if step is None or trace_id in continued:
        # a phase under a step's second root began after the step's first log(), so it says the
        # next step: its root says which step it was (the same one, logged again)
        step = root_steps.get(trace_id, step)
    parent = s.get("parent_span_id")
    return Span(
        name=name,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent if isinstance(parent, str) else None,
        start_ns=start_ns,
        end_ns=end_ns,
        step=step,
        lane=_lane(_resource(s), attributes),
        attributes=attributes,
    )


def _attributes(s: dict[str, Any]) -> dict[str, Any]:
    found = s.get("attributes")
    return found if isinstance(found, dict) else {}


def _resource(s: dict[str, Any]) -> dict[str, Any]:
    found = s.get("resource")
    return found if isinstance(found, dict) else {}


def _step(value: Any) -> int | None:
    """A step as a span says it: a whole, finite number (NaN, inf, text and bools are none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value)


def otlp_json_spans(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The spans of one OTLP/JSON traces request (a line of the collector's ``file`` exporter), in
    the shape of the events file's span lines."""
    found = []
    for resource_spans in request.get("resourceSpans") or ():
        resource = _otlp_attributes((resource_spans.get("resource") or {}).get("attributes"))
        for scope_spans in resource_spans.get("scopeSpans") or ():
            for span in scope_spans.get("spans") or ():
                found.append(
                    {
                        "name": span.get("name", ""),
                        "trace_id": span.get("traceId", "").lower(),
                        "span_id": span.get("spanId", "").lower(),
                        "parent_span_id": span.get("parentSpanId", "").lower() or None,
                        "start_time_unix_nano": span.get("startTimeUnixNano"),
                        "end_time_unix_nano": span.get("endTimeUnixNano"),
                        "attributes": _otlp_attributes(span.get("attributes")),
                        "resource": resource,
                    }
                )
    return found


def zipkin_spans(base_url: str, run_id: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The run's spans as the stack's trace UI (Zipkin) keeps them: every trace with a span tagged
    ``ml.run.id=<run_id>`` (the stack's relay tags each span with its resource's attributes), in the
    shape of the events file's span lines.  ``ConfigError`` when the trace UI does not answer."""
    import urllib.error
    import urllib.parse
    import urllib.request

    from otel_tracking.config.settings import ConfigError

    parts = urllib.parse.urlsplit(base_url)
    query = urllib.parse.urlencode(
        {"annotationQuery": f"ml.run.id={run_id}", "limit": "1000", "lookback": str(30 * 86_400_000)}
    )
    url = f"{parts.scheme}://{parts.netloc}/api/v2/traces?{query}"  # Zipkin's API, beside its UI's /zipkin/
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            traces = json.load(answer)
    except (OSError, ValueError) as error:
        raise ConfigError(f"the trace UI at {base_url} did not answer {url}: {error}") from None
    found = []
    for trace in traces:
        for span in trace:
            tags = {key: _tag_value(value) for key, value in (span.get("tags") or {}).items()}
            start_ns = int(span.get("timestamp", 0)) * 1000
            found.append(
                {
                    "name": span.get("name", ""),
                    "trace_id": span.get("traceId", ""),
                    "span_id": span.get("id", ""),
                    "parent_span_id": span.get("parentId"),
                    "start_time_unix_nano": start_ns,
                    "end_time_unix_nano": start_ns + int(span.get("duration", 0)) * 1000,
                    "attributes": tags,
                    "resource": tags,  # Zipkin keeps one set of tags: the resource's among them
                }
            )
    return found


def _tag_value(text: str) -> Any:
    """A Zipkin tag back as the value it was (the relay writes what is not a string as JSON)."""
    if text[:1].isdigit() or text[:1] in "-[{" or text in ("true", "false"):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _otlp_attributes(items: Any) -> dict[str, Any]:
    return {item["key"]: _otlp_value(item.get("value") or {}) for item in items or () if "key" in item}


def _otlp_value(value: dict[str, Any]) -> Any:
    if "intValue" in value:
        return int(value["intValue"])  # a string in OTLP/JSON (int64)
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values") or ()]
    for kind in ("stringValue", "doubleValue", "boolValue"):
        if kind in value:
            return value[kind]
    return None


def _lane(resource: dict[str, Any], attributes: dict[str, Any]) -> tuple[str, str]:
    role, rank = resource.get(ROLE), resource.get(RANK)
    if role is None and rank is None:
        process = "driver"
    else:
        process = " ".join(str(p) for p in (role or "process", None if rank is None else f"rank {rank}") if p)
    lane = attributes.get(LANE)
    return process, "" if lane is None else str(lane)


def is_step_root(span: Span) -> bool:
    """The root span of a step's trace (``ml.step``), which the picture draws as the step's extent."""
    return span.name == STEP_SPAN_NAME and not span.parent_id


def select_steps(spans: Sequence[Span], first: int, last: int) -> list[Span]:
    chosen = [s for s in spans if s.step is not None and first <= s.step <= last]
    by_id = {s.span_id: s for s in chosen}
    for span in sorted(chosen, key=lambda s: s.start_ns):  # depth within its lane: its lane's ancestors
        parent = by_id.get(span.parent_id or "")
        while parent is not None and (parent.lane != span.lane or is_step_root(parent)):
            parent = by_id.get(parent.parent_id or "")
        span.depth = 0 if parent is None else parent.depth + 1
    return chosen


@dataclass(frozen=True)
class Straggler:
    phase: str
    step: int | None
    lane: tuple[str, str]
    lag_s: float  # how much later than the median lane it ended
    span_id: str  # its span that ended last


def stragglers(spans: Sequence[Span]) -> list[Straggler]:
    """For each span whose children ran on several lanes: the lane whose children ended last, and
    its lag behind the median lane's end."""
    by_id = {s.span_id: s for s in spans}
    last: dict[str, dict[tuple[str, str], Span]] = {}  # parent span id -> lane -> its child that ended last
    for span in spans:
        parent = by_id.get(span.parent_id or "")
        if parent is not None and parent.lane != span.lane:
            lanes = last.setdefault(parent.span_id, {})
            if span.lane not in lanes or span.end_ns > lanes[span.lane].end_ns:
                lanes[span.lane] = span
    found = []
    for parent_id, lanes in last.items():
        if len(lanes) < 2:
            continue
        latest = max(lanes.values(), key=lambda s: s.end_ns)
        lag = (latest.end_ns - statistics.median(s.end_ns for s in lanes.values())) / 1e9
        parent = by_id[parent_id]
        found.append(Straggler(parent.name, parent.step, latest.lane, lag, latest.span_id))
    return sorted(found, key=lambda s: (s.step or 0, s.phase))


def lanes_in_order(spans: Sequence[Span]) -> list[tuple[str, str]]:
    """The driver's first, then by role, rank (as numbers) and lane."""

    def key(lane: tuple[str, str]) -> tuple[int, str, int, str]:
        process, name = lane
        rank = process.rsplit("rank ", 1)[-1]
        return (process != "driver", process.split(" rank ")[0], int(rank) if rank.isdigit() else -1, name)

    return sorted({s.lane for s in spans}, key=key)


def lane_label(lane: tuple[str, str]) -> str:
    process, name = lane
    return f"{process} / lane {name}" if name else process


# --- Chrome trace events ------------------------------------------------------------------------


def chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """The trace-event format's JSON object form: complete events (``ph: X``, microseconds), one
    pid per process, one tid per lane, both named by metadata events."""
    origin = min(s.start_ns for s in spans)
    lanes = lanes_in_order(spans)
    processes = list(dict.fromkeys(process for process, _ in lanes))
    pid = {process: i + 1 for i, process in enumerate(processes)}
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = []
    for process in processes:
        events.append({"ph": "M", "name": "process_name", "pid": pid[process], "tid": 0, "args": {"name": process}})
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid[process],
                "tid": 0,
                "args": {"sort_index": pid[process]},
            }
        )
    for lane in lanes:
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid[lane[0]],
                "tid": tid[lane],
                "args": {"name": lane_label(lane)},
            }
        )
    for span in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):  # parents before children
        events.append(
            {
                "ph": "X",
                "name": span.name,
                "cat": "step" if span.name == STEP_SPAN_NAME else "phase",
                "ts": (span.start_ns - origin) / 1e3,
                "dur": (span.end_ns - span.start_ns) / 1e3,
                "pid": pid[span.lane[0]],
                "tid": tid[span.lane],
                "args": {"step": span.step, "span_id": span.span_id, "trace_id": span.trace_id},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# --- the picture --------------------------------------------------------------------------------

_ROW_H, _LABEL_W, _PLOT_W, _BAR_H = 22, 220, 1000, 16
_RIGHT_MARGIN = 40  # room for the last tick's label, which ends at the plot's right edge
_STEPS_H = 20  # the strip on top that shows each step's extent
_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"]


def svg(spans: Sequence[Span], found: Sequence[Straggler]) -> str:
    origin, end = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
    scale = _PLOT_W / max(end - origin, 1)
    roots = [s for s in spans if is_step_root(s)]
    spans = [s for s in spans if not is_step_root(s)] or roots  # a step with no phase: its root alone
    if spans is roots:
        roots = []
    lanes = lanes_in_order(spans)
    depth = {lane: max(s.depth for s in spans if s.lane == lane) + 1 for lane in lanes}
    late = {f.span_id for f in found}
    names = sorted({s.name for s in spans})
    color = {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(names)}
    parts, y = [], 24
    total_s = (end - origin) / 1e9
    unit, factor = ("ms", 1000.0) if total_s < 1 else ("s", 1.0)
    for i in range(11):  # the time axis
        x = _LABEL_W + i * _PLOT_W / 10
        label = f"{total_s * factor * i / 10:.3g} {unit}"
        parts.append(f'<line x1="{x:.1f}" y1="18" x2="{x:.1f}" y2="100%" stroke="#eee"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="12" font-size="10" text-anchor="middle">{label}</text>')
    if roots:  # each step's extent, once, above the lanes
        parts.append(f'<text class="steps" x="4" y="{y + 14}" font-size="12">steps</text>')
        for root in roots:
            x = _LABEL_W + (root.start_ns - origin) * scale
            width = max((root.end_ns - root.start_ns) * scale, 1.0)
            title = f"step {root.step}: {(root.end_ns - root.start_ns) / 1e9:.3f} s (the step's root span)"
            parts.append(
                f'<rect class="step" x="{x:.1f}" y="{y + 4}" width="{width:.1f}" height="12" fill="none" '
                f'stroke="#555"><title>{html.escape(title)}</title></rect>'
            )
            parts.append(f'<text x="{x + 3:.1f}" y="{y + 14}" font-size="10">step {root.step}</text>')
        y += _STEPS_H
    for lane in lanes:
        height = depth[lane] * _ROW_H
        parts.append(
            f'<rect x="0" y="{y}" width="{_LABEL_W + _PLOT_W}" height="{height}" fill="#fafafa" stroke="#ddd"/>'
        )
        parts.append(f'<text class="lane" x="4" y="{y + 15}" font-size="12">{html.escape(lane_label(lane))}</text>')
        for span in (s for s in spans if s.lane == lane):
            x = _LABEL_W + (span.start_ns - origin) * scale
            width = max((span.end_ns - span.start_ns) * scale, 1.0)
            top = y + span.depth * _ROW_H + 3
            stroke = ' stroke="#d62728" stroke-width="2"' if span.span_id in late else ""
            kind = "span straggler" if span.span_id in late else "span"
            duration = (span.end_ns - span.start_ns) / 1e9
            title = f"{span.name} (step {span.step}): {duration:.3f} s on {lane_label(lane)}"
            parts.append(
                f'<rect class="{kind}" data-name="{html.escape(span.name)}" x="{x:.1f}" y="{top}" width="{width:.1f}" '
                f'height="{_BAR_H}" fill="{color[span.name]}"{stroke}><title>{html.escape(title)}</title></rect>'
            )
            if width > 40:
                parts.append(
                    f'<text x="{x + 3:.1f}" y="{top + 12}" font-size="10" fill="#fff">{html.escape(span.name)}</text>'
                )
        y += height
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LABEL_W + _PLOT_W + _RIGHT_MARGIN}" height="{y + 10}" '
        f'font-family="sans-serif">{"".join(parts)}</svg>'
    )


def page(spans: Sequence[Span], found: Sequence[Straggler], title: str) -> str:
    rows = "".join(
        f"<li>step {f.step}, <b>{html.escape(f.phase)}</b>: straggler {html.escape(lane_label(f.lane))}, "
        f"{f.lag_s:.3f} s after the median lane</li>"
        for f in found
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body style='font-family:sans-serif'><h2>{html.escape(title)}</h2>"
        f"<p>Each step's extent on top; one row per lane; nested spans stacked inside it; empty space is idle "
        f"time; a red outline is a phase's straggler.</p>{svg(spans, found)}<h3>Stragglers</h3><ul id='stragglers'>"
        f"{rows or '<li>none</li>'}</ul></body></html>"
    )


def main(
    paths: list[str], steps: str | None, out: str | None, stdout: Any = None, traces_url: str | None = None
) -> int:
    import sys

    say = stdout or sys.stdout
    files = events_files([Path(p) for p in paths] or [Path.cwd()])
    skipped: list[str] = []
    spans = read_spans(files, traces_url, skipped)
    if skipped:
        say.write(f"otel-tracking timeline: skipped {len(skipped)} span lines it cannot draw (first: {skipped[0]})\n")
    known = sorted({s.step for s in spans if s.step is not None})
    if not known:
        say.write("otel-tracking timeline: no spans with a step in the events files found\n")
        return 2
    first, last = _step_range(steps, known)
    chosen = select_steps(spans, first, last)
    if not chosen:
        say.write(f"otel-tracking timeline: no spans at steps {first}-{last} (steps found: {known[0]}-{known[-1]})\n")
        return 2
    found = stragglers(chosen)
    base = Path(out) if out else _beside(paths) / (f"timeline-step{first}" + (f"-{last}" if last != first else ""))
    html_path, json_path = base.with_suffix(".html"), base.with_suffix(".json")
    title = f"steps {first}-{last}" if last != first else f"step {first}"
    html_path.write_text(page(chosen, found, f"otel-tracking timeline: {title}"))
    json_path.write_text(json.dumps(chrome_trace(chosen)))
    say.write(f"otel-tracking timeline: {len(chosen)} spans on {len(lanes_in_order(chosen))} lanes, {title}\n")
    for f in found:
        say.write(f"  straggler: step {f.step} {f.phase}: {lane_label(f.lane)}, +{f.lag_s:.3f} s after the median\n")
    say.write(f"  {html_path} (open in a browser)\n  {json_path} (Perfetto, chrome://tracing)\n")
    return 0


def _beside(paths: list[str]) -> Path:
    """Where the files go without ``--out``: beside the first input file, in the first input
    directory, or (no path given) in the working directory."""
    if not paths:
        return Path.cwd()
    first = Path(paths[0])
    return first if first.is_dir() else first.parent


def _step_range(steps: str | None, known: list[int]) -> tuple[int, int]:
    if not steps:
        return known[-1], known[-1]
    first, _, last = steps.partition("-")
    return int(first), int(last or first)
