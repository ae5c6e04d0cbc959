"""mkdocs-gen-files script: pages made from files outside docs/ at build time.

- ``contributing.md``: ``CONTRIBUTING.md``, as it is;
- ``benchmarks/results.md`` and one page per ``bench/results/*.md``: every saved benchmark report,
  with the plots (``bench/results/*.png``) beside them.
"""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files

REPO = Path(__file__).resolve().parents[1]

with mkdocs_gen_files.open("contributing.md", "w") as out:
    out.write((REPO / "CONTRIBUTING.md").read_text())
mkdocs_gen_files.set_edit_path("contributing.md", "../CONTRIBUTING.md")

reports = sorted((REPO / "bench" / "results").glob("*.md"), reverse=True)
with mkdocs_gen_files.open("benchmarks/results.md", "w") as index:
    index.write(
        "# All benchmark results\n\nEvery report in `bench/results/`, newest first, as the benchmarks saved it "
        "(the machine, the command and the numbers; `latest.md` is the `bench_log.py` run the "
        "[method page](index.md) shows).\n\n"
    )
    for report in reports:
        title = report.read_text().splitlines()[0].lstrip("# ").strip() if report.stat().st_size else report.stem
        index.write(f"- [{report.name}](results/{report.stem}.md): {title}\n")
        with mkdocs_gen_files.open(f"benchmarks/results/{report.stem}.md", "w") as page:
            page.write(f"# {report.name}\n\n`bench/results/{report.name}`, included as it is at build time.\n\n")
            page.write(f"<!-- generated: bench-result {report.name} -->\n")

for plot in sorted((REPO / "bench" / "results").glob("*.png")):
    with mkdocs_gen_files.open(f"benchmarks/results/{plot.name}", "wb") as image:
        image.write(plot.read_bytes())
