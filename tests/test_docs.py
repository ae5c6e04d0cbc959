"""The documentation site (``docs/``, ``mkdocs.yml``) says what the code does, and a reader can use it.

- Every ``OTEL_*``/``OTEL_TRACKING_*`` variable the code reads is in the environment reference, and the
  reference lists none the code does not read (the code's string literals, read with ``ast``).
- The docs' Python examples run, each as a script of its own in a fresh directory; an example that
  needs a network tracker, Ray or the reader's own code is marked ``<!-- docs-test: skip (why) -->``
  on the line before its fence, and the plain-script example of *Getting started* is never skipped.
- ``mkdocs build --strict`` builds the site (a broken link or reference fails), and headless chromium
  opens it over HTTP: the navigation reaches every section, and typing in the search box finds a page.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import viewers

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
ENV_PAGE = DOCS / "reference" / "environment.md"
NAME = re.compile(r"OTEL_[A-Z0-9_]*[A-Z0-9]")
SKIP = "<!-- docs-test: skip"


# ----------------------------------------------------------------------------- environment variables


def variables_read(root: Path, set_for_children: bool) -> tuple[set[str], set[str]]:
    """The full ``OTEL_*`` names among ``root``'s string literals, and the f-strings that build one
    (``f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"``) as regular expressions.  With ``set_for_children``,
    a literal that is a dict key or the target of ``env[...] = ...`` is a variable the code sets for a
    program it starts (the stack's collector config), not one it reads."""
    names: set[str] = set()
    patterns: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        ignored: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                ignored.update(id(value) for value in node.values)
                parts = [value.value if isinstance(value, ast.Constant) else None for value in node.values]
                head = parts[0]
                if isinstance(head, str) and head.startswith("OTEL_") and not any(p and " " in p for p in parts):
                    patterns.add("".join(re.escape(p) if p is not None else "[A-Z]+" for p in parts))
            elif set_for_children and isinstance(node, ast.Dict):
                ignored.update(id(key) for key in node.keys if key is not None)
            elif set_for_children and isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                ignored.add(id(node.slice))
        for node in ast.walk(tree):
            literal = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in ignored
            if literal and NAME.fullmatch(node.value):
                names.add(node.value)
    return names, patterns


def variables_documented(page: str) -> set[str]:
    """The ``OTEL_*`` names in the first column of the table under *Read by otel-tracking*
    (``{TRACES,METRICS,LOGS}`` expanded)."""
    section = page.split("## Read by otel-tracking", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        for token in re.findall(r"`([A-Z0-9_{},]+)`", line.split(" | ", 1)[0]):
            braces = re.search(r"\{([A-Z,]+)\}", token)
            expanded = (
                [token.replace(braces.group(0), part) for part in braces.group(1).split(",")] if braces else [token]
            )
            names.update(name for name in expanded if NAME.fullmatch(name))
    return names


def reference_mismatches(roots: list[tuple[Path, bool]], page: str) -> list[str]:
    read: set[str] = set()
    patterns: set[str] = set()
    for root, set_for_children in roots:
        names, built = variables_read(root, set_for_children)
        read |= names
        patterns |= built
    documented = variables_documented(page)
    problems = [f"{name} is read by the code but missing from the reference" for name in sorted(read - documented)]
    for pattern in sorted(patterns):
        if not any(re.fullmatch(pattern, name) for name in documented):
            problems.append(f"the code builds {pattern} but the reference lists no such variable")
    for name in sorted(documented - read):
        if not any(re.fullmatch(pattern, name) for pattern in patterns):
            problems.append(f"{name} is in the reference but the code does not read it")
    return problems


CODE = [(REPO / "otel_tracking", False), (REPO / "otel_tracking_stack", True)]


def test_the_environment_reference_lists_exactly_the_variables_the_code_reads() -> None:
    assert reference_mismatches(CODE, ENV_PAGE.read_text()) == []


def test_the_environment_check_catches_a_variable_added_or_dropped_on_either_side(tmp_path: Path) -> None:
    code = tmp_path / "otel_tracking"
    code.mkdir()
    (code / "settings.py").write_text(
        'import os\nA = os.environ.get("OTEL_TRACKING_FAKE_KNOB")\nB = f"OTEL_EXPORTER_OTLP_{s}_ENDPOINT"\n'
    )
    page = (
        "## Read by otel-tracking\n\n| variable | default | meaning |\n|---|---|---|\n"
        "| `OTEL_EXPORTER_OTLP_{TRACES,METRICS,LOGS}_ENDPOINT` | | |\n| `OTEL_TRACKING_GONE` | | |\n"
    )
    assert reference_mismatches([(code, False)], page) == [
        "OTEL_TRACKING_FAKE_KNOB is read by the code but missing from the reference",
        "OTEL_TRACKING_GONE is in the reference but the code does not read it",
    ]
    stack = tmp_path / "otel_tracking_stack"
    stack.mkdir()
    (stack / "stack.py").write_text('env = {"OTEL_TRACKING_SET_ONLY": "x"}\nenv["OTEL_TRACKING_ALSO_SET"] = "y"\n')
    assert variables_read(stack, set_for_children=True) == (set(), set())


# ----------------------------------------------------------------------------- the Python examples


def examples() -> Iterator[tuple[str, str, bool]]:
    """(page:line, code, skipped) of every ```python fence in the docs, CONTRIBUTING.md too."""
    pages = [*sorted(DOCS.rglob("*.md")), REPO / "CONTRIBUTING.md"]
    for page in pages:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() == "```python":
                end = lines.index("```", number + 1)
                skipped = number > 0 and lines[number - 1].startswith(SKIP)
                yield f"{page.relative_to(REPO)}:{number + 1}", "\n".join(lines[number + 1 : end]) + "\n", skipped


EXAMPLES = list(examples())
RUN = [(where, code) for where, code, skipped in EXAMPLES if not skipped]


def test_the_getting_started_example_is_run_and_every_skip_says_why() -> None:
    assert any(where.startswith("docs/getting-started.md") and "first-run" in code for where, code in RUN)
    # reading a run back, with each tracker's own reader: run, not skipped
    read_back = [code for where, code in RUN if where.startswith("docs/getting-started.md")]
    for reader in ("EventAccumulator", "MlflowClient", "json.loads"):
        assert any(reader in code for code in read_back), reader
    for page in [*DOCS.rglob("*.md"), REPO / "CONTRIBUTING.md"]:
        for line in page.read_text().splitlines():
            if line.startswith(SKIP):
                assert re.fullmatch(r"<!-- docs-test: skip \(.+\) -->", line), f"{page}: {line}"


@pytest.mark.parametrize(("where", "code"), RUN, ids=[where for where, _ in RUN])
def test_a_docs_example_runs(where: str, code: str, isolated: Path) -> None:
    script = isolated / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=isolated, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
    if where.startswith("docs/getting-started.md") and 'experiment_name="first-run"' in code:
        # what the page says the plain script does: console lines, the file sink's two files
        assert "step:1 - actor/pg_loss:1.0 - reward/mean:0.1" in done.stdout
        lines = (isolated / "getting-started" / "first-run.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
        assert (isolated / "getting-started" / "first-run.events.jsonl").stat().st_size > 0


# ----------------------------------------------------------------------------- the built site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return out


def test_the_generated_pages_say_what_the_code_and_the_results_say(site: Path) -> None:
    from otel_tracking.cli.main import build_parser

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("demo", "stack", "replay", "stalls", "timeline"):
        assert f"otel-tracking {command} --help" in cli
    assert "--val-every" in cli and build_parser().prog == "otel-tracking"
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("Tracking", "Tracking.log", "Tracking.finish", "Tracking.flush", "Tracking.supported_backend"):
        assert f'id="otel_tracking.api.facade.{name}"' in api, name
    assert 'id="otel_tracking.api.spans.trace_state"' in api
    # attributes show their text, not the code that computes them
    for code in ("list(SUPPORTED_BACKENDS)", "sink.name", "self._run"):
        assert code not in api, code
    assert "The backend names" in api and "The run's sinks by backend name" in api
    bench = (site / "benchmarks" / "index.html").read_text()
    latest = (REPO / "bench" / "results" / "latest.md").read_text()
    machine = next(line for line in latest.splitlines() if line.startswith("machine:"))
    assert machine.split(": ", 1)[1] in bench
    # the time-to-land comparison takes its rows from the reports it names
    for line in (REPO / "bench" / "results" / "2026-12-02-land-trackio-15.md").read_text().splitlines():
        if line.startswith("| trackio"):
            assert line.split(" | ")[-1].rstrip(" |") in bench
    for report in (REPO / "bench" / "results").glob("*.md"):
        assert (site / "benchmarks" / "results" / report.stem / "index.html").is_file(), report.name


@pytest.fixture(scope="module")
def served(site: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = viewers.free_port()
    server = viewers.Server(
        "docs-site",
        [sys.executable, "-m", "http.server", str(port), "--bind", viewers.HOST, "--directory", str(site)],
        port,
        tmp_path_factory.mktemp("docs-logs"),
    )
    try:
        server.wait_ready("/", timeout=60)
        yield server.url
    finally:
        server.stop()


NAV = ["Getting started", "Guides", "Reference", "Architecture", "Benchmarks"]


def test_the_site_opens_in_chromium_with_its_navigation_and_a_working_search(served: str) -> None:
    index = json.loads(viewers.http_get(served + "/search/search_index.json"))
    assert any("OTEL_TRACKING_SPOOL_DIR" in doc["text"] for doc in index["docs"])
    with viewers.browser() as browser:
        home = browser.page(served + "/")
        home.wait_for_text(["OpenTelemetry-native experiment tracking", *NAV])
        links = home.evaluate("[...document.querySelectorAll('nav.md-nav a.md-nav__link')].map(a => a.href)")
        for page in (
            "getting-started/",
            "guides/distributed/",
            "reference/environment/",
            "architecture/",
            "benchmarks/",
        ):
            assert served + "/" + page in links, page
        if os.environ.get("DOCS_SCREENSHOTS"):
            home.screenshot(REPO / "docs" / "images" / "docs-home.png")
        reference = browser.page(served + "/reference/environment/")
        reference.wait_for_text(["OTEL_TRACKING_SPOOL_DIR", "Read by otel-tracking"])
        if os.environ.get("DOCS_SCREENSHOTS"):
            reference.screenshot(REPO / "docs" / "images" / "docs-reference.png")
        # the search box, as a reader types in it: the results list names the page that has the term
        reference.evaluate("document.querySelector('input.md-search__input').focus()")
        reference.send("Input.insertText", text="replay")
        results = viewers.wait_for(
            lambda: reference.evaluate(
                "[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href).join(' ')"
            ),
            60,
            "search results for 'replay'",
        )
        assert served + "/guides/replay/" in results
        if os.environ.get("DOCS_SCREENSHOTS"):
            reference.screenshot(REPO / "docs" / "images" / "docs-search.png")


# ----------------------------------------------------------------------------- pages a user reads

# What belongs in CONTRIBUTING, the architecture pages or the benchmark pages, not in a user's page:
# notes about the machine the docs were written on, issue numbers, paths into the workspace around
# the checkout, links into the test suite, and tables of microsecond measurements.
ENGINEERING_LOG = {
    "a note about the authors' machine": re.compile(
        r"this (\d+-core )?machine|\b\d+-core machine|(installed|installable|run|reachable|measured|available"
        r"|verified) here\b|cannot reach|could not be run",
        re.I,
    ),
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a path outside the checkout": re.compile(r"\.\./shared"),
    "a reference into the tests": re.compile(r"\btests/|\btest_\w+\.py"),
    "a table of microsecond timings": re.compile(r"^\|.*µs.*\|\s*$", re.M),
}


def user_pages() -> list[Path]:
    """The pages a user reads: the README, the home page, getting started and the other top-level
    pages (concepts, troubleshooting, FAQ, migration), the guides and the reference."""
    return [
        REPO / "README.md",
        *sorted(DOCS.glob("*.md")),
        *sorted((DOCS / "guides").glob("*.md")),
        *sorted((DOCS / "reference").glob("*.md")),
    ]


def engineering_log(pages: list[Path]) -> list[str]:
    found = []
    for page in pages:
        text = page.read_text()
        for what, pattern in ENGINEERING_LOG.items():
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{page.name}:{line}: {what}: {match.group(0)[:60]!r}")
    return found


def test_no_user_page_reads_like_an_engineering_log() -> None:
    pages = user_pages()
    assert {"concepts.md", "troubleshooting.md", "faq.md", "migration.md", "verl.md", "api.md"} <= {
        p.name for p in pages
    }
    assert engineering_log(pages) == []


def test_the_engineering_log_check_catches_each_kind(tmp_path: Path) -> None:
    page = tmp_path / "guide.md"
    page.write_text(
        "Measured on this 2-core machine.\nGrafana cannot be installed here.\nSee issue 6.\n"
        "Read ../shared/DESIGN.md.\n`tests/test_ray.py` runs it.\n| call | 1.3 µs |\nA cost of 4 µs per call.\n"
    )
    assert [line.split(": ")[1] for line in engineering_log([page])] == [
        "a note about the authors' machine",
        "a note about the authors' machine",
        "an issue number",
        "a path outside the checkout",
        "a reference into the tests",
        "a reference into the tests",
        "a table of microsecond timings",
    ]


def test_the_user_pages_are_linked_from_the_home_page_and_the_nav() -> None:
    import yaml

    home = (DOCS / "index.md").read_text()
    nav = json.dumps(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    for page in ("concepts.md", "troubleshooting.md", "faq.md", "migration.md"):
        assert f"]({page})" in home, page
        assert f'"{page}"' in nav, page


# ----------------------------------------------------------------------------- the Python API reference


def _documented_parameters(docstring: str) -> set[str]:
    return set(re.findall(r":param (?:[\w\[\], |]+ )?(\w+):", docstring))


def api_gaps(package: str, exports: dict[str, str], page: str, search_paths: list[str]) -> list[str]:
    """What the API reference would show without its text: a public name (or a public member of a
    public class) without a docstring, a parameter its docstring does not describe (``:param x:``),
    a public name without an example, a public name the reference page does not render.  Read with
    griffe, as mkdocstrings reads it for the page."""
    import griffe

    problems = []
    for name, module in sorted(exports.items()):
        if f"::: {module}.{name}" not in page:
            problems.append(f"{package}.{name} is not on the reference page")
        obj = griffe.load(module, search_paths=search_paths)[name]
        text = obj.docstring.value if obj.docstring else ""
        if not text:
            problems.append(f"{name} has no docstring")
            continue
        if "Example" not in text:
            problems.append(f"{name}'s docstring has no example")
        callables = [(name, obj, text)]
        if obj.is_class:
            init = obj.members.get("__init__")
            if init is not None:
                callables = [(name, init, text + (init.docstring.value if init.docstring else ""))]
            for member_name, member in obj.members.items():
                if member_name.startswith("_"):
                    continue
                member_text = member.docstring.value if member.docstring else ""
                if not member_text:
                    problems.append(f"{name}.{member_name} has no docstring")
                elif member.is_function:
                    callables.append((f"{name}.{member_name}", member, member_text))
        for where, function, docstring in callables:
            if not function.is_function:
                continue
            wanted = [p.name for p in function.parameters if p.name not in ("self", "cls")]
            missing = [p for p in wanted if p not in _documented_parameters(docstring)]
            if missing:
                problems.append(f"{where}: no `:param x:` for {', '.join(missing)}")
    return problems


def test_every_public_name_and_parameter_is_documented_on_the_reference_page() -> None:
    import otel_tracking

    exports = {name: otel_tracking._EXPORTS[name] for name in otel_tracking.__all__ if name != "__version__"}
    page = (DOCS / "reference" / "api.md").read_text()
    assert api_gaps("otel_tracking", exports, page, [str(REPO)]) == []


def test_the_api_check_catches_a_missing_docstring_parameter_example_or_page_entry(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "api.py").write_text(
        "class Documented:\n"
        '    """A class.\n\n    Example: ``Documented(1)``\n\n    :param size: how big.\n    """\n\n'
        "    def __init__(self, size: int, colour: str = 'red') -> None:\n        pass\n\n"
        "    def grow(self, by: int) -> None:\n        pass\n\n"
        "    def shrink(self, by: int) -> None:\n"
        '        """Smaller.\n\n        :param by: how much.\n        """\n\n\n'
        "def helper(x: int) -> int:\n"
        '    """Help.\n\n    :param x: a number.\n    """\n    return x\n'
    )
    exports = {"Documented": "pkg.api", "helper": "pkg.api"}
    assert sorted(api_gaps("pkg", exports, "::: pkg.api.Documented\n", [str(tmp_path)])) == [
        "Documented.grow has no docstring",
        "Documented: no `:param x:` for colour",
        "helper's docstring has no example",
        "pkg.helper is not on the reference page",
    ]


# ----------------------------------------------------------------------------- the README


def test_the_readme_is_short_and_its_first_screen_has_install_the_two_commands_and_the_verl_switch() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 13 * 1024
    first_screen = "\n".join(readme.splitlines()[:60])
    headline = readme.split("\n## ", 1)[0]
    assert "Grafana" not in headline and "Jaeger's UI" not in headline  # the UI a user opens is Zipkin
    pyproject = (REPO / "pyproject.toml").read_text()
    repository = re.search(r'^Repository = "(.+)"$', pyproject, re.M)
    assert repository, "project.urls names the repository"
    for needle in (
        f"git clone {repository.group(1)} && cd otel-tracking",  # not on PyPI yet: from a clone
        "pip install -e '.[tensorboard]' && otel-tracking demo",  # the demo
        "otel-tracking stack up --light",  # the light trace UI
        "./scripts/test",  # the full test suite, called what it is
        "full test suite",
        "about an hour",
        "export OTEL_TRACKING_VERL=1",  # the verl switch, the versions it needs, where older ones are
        "verl 0.9 or newer",
        "verl 0.7.1 and 0.8.0",
        "python -m verl.trainer.main_ppo",
    ):
        assert needle in first_screen, needle
    # the commands are real: the script, the demo subcommand, the extras
    assert os.access(REPO / "scripts" / "test", os.X_OK)
    from otel_tracking.cli.main import build_parser

    assert build_parser().parse_args(["demo"]).command == "demo"
    for extra in re.findall(r"\[(wandb|mlflow|tensorboard|swanlab|clearml|trackio|all)\]", readme):
        assert f"\n{extra} = [" in pyproject, extra
    # every relative link and picture of the README is a file of the checkout
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (REPO / target).exists(), target


def _defined(module: Path, dotted: str) -> bool:
    """Whether ``module`` defines ``dotted`` (a function, a class, or a class's method)."""
    tree = ast.parse(module.read_text())
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part]
        if not found:
            return False
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


def _one_value_claims(text: str) -> tuple[int, list[tuple[str, str]], list[str]]:
    """(hops, (module, name) pairs, thread names) that docs/architecture/one-value.md states."""
    hops = len(re.findall(r"^\d+\. ", text, flags=re.M))
    pairs = re.findall(r"`(\w+/\w+\.py)` `([\w.]+)`", text)
    threads = re.findall(r"`(otel-tracking-[\w-]+?)(?:_<n>)?`", text)
    return hops, pairs, threads


def test_one_values_path_names_real_functions_and_threads_in_at_most_ten_hops() -> None:
    """The architecture page that follows one log() value to MLflow cannot drift from the code:
    every module and function it names is defined there, and every thread it names is one the
    code starts."""
    text = (REPO / "docs" / "architecture" / "one-value.md").read_text()
    hops, pairs, threads = _one_value_claims(text)
    assert 0 < hops <= 10
    assert len(pairs) >= 8 and len(threads) >= 4
    package = REPO / "otel_tracking"
    missing = [f"{path} {name}" for path, name in pairs if not _defined(package / path, name)]
    assert not missing, f"one-value.md names what the code does not define: {missing}"
    code = "\n".join(p.read_text() for p in package.rglob("*.py"))
    started = set(re.findall(r'name=f?"(otel-tracking-[\w{}-]+)"', code))
    started |= set(re.findall(r'thread_name_prefix="(otel-tracking-[\w-]+)"', code))

    def starts(thread: str) -> bool:  # by its literal name, or a SinkQueue's f"otel-tracking-{name}" of a literal name
        queue = thread.removeprefix("otel-tracking-")
        return thread in started or ("otel-tracking-{name}" in started and f'"{queue}"' in code)

    unknown = [t for t in threads if not starts(t)]
    assert not unknown, f"one-value.md names threads the code does not start: {unknown}"


def test_the_one_value_check_catches_a_renamed_function_and_a_made_up_thread() -> None:
    text = (REPO / "docs" / "architecture" / "one-value.md").read_text()
    _, pairs, _ = _one_value_claims(text)
    package = REPO / "otel_tracking"
    assert not _defined(package / pairs[0][0], pairs[0][1] + "_renamed")
    _, _, threads = _one_value_claims(text + "\n`otel-tracking-made-up`")
    assert "otel-tracking-made-up" in threads
    code = "\n".join(p.read_text() for p in package.rglob("*.py"))
    assert '"made-up"' not in code and "otel-tracking-made-up" not in code
