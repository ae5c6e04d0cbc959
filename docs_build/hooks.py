"""mkdocs hook: the pages that are generated from the code and from bench/results/, so they cannot drift.

A page asks for generated text with a marker line:

- ``<!-- generated: cli -->``: the ``otel-tracking`` command's help, every subcommand, from
  ``otel_tracking.cli.main.build_parser()`` (the parser the command runs);
- ``<!-- generated: bench-result NAME -->``: the file ``bench/results/NAME`` as it is at build time;
- ``<!-- generated: bench-rows NAME:TRACKER ... -->``: one table of the rows of each report ``NAME``
  whose first cell starts with ``TRACKER`` (the header of the first report's table, and a column
  naming the report each row comes from): a comparison drawn from several runs, still not pasted.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MARKER = re.compile(r"^<!-- generated: (cli|bench-result|bench-rows) ?(.*?) -->$", re.M)


def cli_reference() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: the same page everywhere
    from otel_tracking.cli.main import build_parser

    parser = build_parser()
    parts = ["```text\n$ otel-tracking --help\n" + parser.format_help() + "```\n"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts.append(
                    f"## `otel-tracking {name}`\n\n```text\n$ otel-tracking {name} --help\n{sub.format_help()}```\n"
                )
    return "\n".join(parts)


def bench_result(name: str) -> str:
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"a page includes bench/results/{name}, which does not exist")
    text = path.read_text()
    # the file's own headings sit under the page's: '# x' becomes '#### x'
    return re.sub(r"^(#+) ", lambda m: "###" + m.group(1) + " ", text, flags=re.M)


def bench_rows(selection: str) -> str:
    header: list[str] = []
    rows: list[str] = []
    for item in selection.split():
        name, _, tracker = item.partition(":")
        path = RESULTS / name
        if not path.is_file():
            raise FileNotFoundError(f"a page takes rows of bench/results/{name}, which does not exist")
        table = [line for line in path.read_text().splitlines() if line.startswith("|")]
        if not header:
            header = [table[0] + " report |", table[1] + "---|"]
        picked = [row for row in table[2:] if row.split("|")[1].strip().startswith(tracker + " ")]
        if not picked:
            raise ValueError(f"bench/results/{name} has no row for {tracker!r}")
        rows += [f"{row} [{name}](results/{path.stem}.md) |" for row in picked]
    return "\n".join(header + rows) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        kind, argument = match.group(1), match.group(2)
        if kind == "cli":
            return cli_reference()
        return bench_result(argument) if kind == "bench-result" else bench_rows(argument)

    return MARKER.sub(replace, markdown)
