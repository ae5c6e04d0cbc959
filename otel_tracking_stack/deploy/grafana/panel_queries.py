"""Extract every Prometheus query of the Grafana dashboards, and optionally run them.

    python deploy/grafana/panel_queries.py                      # list queries as JSON
    python deploy/grafana/panel_queries.py --prometheus http://127.0.0.1:9090   # run each

Grafana's template variables are replaced so the expressions run against Prometheus directly:
dashboard variables (``$service``, ``${ml_project}``...) by ``.*`` unless given, and Grafana's
interval macros (``$__rate_interval``, ``$__interval``, ``$__range``) by a fixed duration.
Standard library only; tests/test_stack.py imports it by path.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboards"

MACROS = {"__rate_interval": "1m", "__interval": "15s", "__range": "30m", "__range_s": "1800"}


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel_id: int
    panel_title: str
    panel_type: str
    ref_id: str
    expr: str  # as written in the dashboard
    query: str  # with variables and macros replaced

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_prometheus(ds: Any) -> bool:
    if isinstance(ds, dict):
        return ds.get("type") == "prometheus"
    if isinstance(ds, str):
        return "prometheus" in ds.lower()
    return False


def _walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _walk_panels(panel.get("panels") or [])


def render(expr: str, variables: Mapping[str, str] | None = None, macros: Mapping[str, str] | None = None) -> str:
    """Replace ``$var``, ``${var}``, ``${var:regex}`` and Grafana macros in ``expr``."""
    values = {**MACROS, **(macros or {})}
    variables = dict(variables or {})

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        return variables.get(name, ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)


def dashboard_queries(path: str | Path, variables: Mapping[str, str] | None = None) -> list[PanelQuery]:
    """Every Prometheus target of every panel (rows included) of one dashboard file."""
    dash = json.loads(Path(path).read_text())
    out: list[PanelQuery] = []
    for panel in _walk_panels(dash.get("panels") or []):
        for target in panel.get("targets") or []:
            ds = target.get("datasource") or panel.get("datasource")
            expr = target.get("expr")
            if not expr or not _is_prometheus(ds):
                continue
            out.append(
                PanelQuery(
                    dashboard=dash.get("uid") or Path(path).stem,
                    panel_id=int(panel.get("id", 0)),
                    panel_title=str(panel.get("title", "")),
                    panel_type=str(panel.get("type", "")),
                    ref_id=str(target.get("refId", "")),
                    expr=expr,
                    query=render(expr, variables),
                )
            )
    return out


def all_queries(directory: str | Path = DASHBOARD_DIR, variables: Mapping[str, str] | None = None) -> list[PanelQuery]:
    return [q for p in sorted(Path(directory).glob("*.json")) for q in dashboard_queries(p, variables)]


def variable_queries(path: str | Path) -> list[str]:
    """The ``label_values(...)`` queries of the dashboard's template variables."""
    dash = json.loads(Path(path).read_text())
    out = []
    for var in (dash.get("templating") or {}).get("list") or []:
        q = var.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if q:
            out.append(str(q))
    return out


def run_query(prometheus_url: str, query: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    url = f"{prometheus_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        data = json.loads(resp.read())
    if data.get("status") != "success":
        raise RuntimeError(f"{query!r}: {data}")
    return list(data["data"]["result"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DASHBOARD_DIR)
    parser.add_argument("--prometheus", help="run every query against this Prometheus URL")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    variables = dict(v.split("=", 1) for v in args.var)
    queries = all_queries(args.dir, variables)
    if not args.prometheus:
        print(json.dumps([q.to_dict() for q in queries], indent=2))
        return 0
    empty = 0
    for q in queries:
        n = len(run_query(args.prometheus, q.query))
        empty += n == 0
        print(f"{n:4d} series  [{q.panel_title} / {q.ref_id}]  {q.query}")
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
