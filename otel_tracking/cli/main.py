"""The ``otel-tracking`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from otel_tracking.cli.demo import DemoPlaces, goodput_summary, run_demo, straggler_summary

    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    places = DemoPlaces(Path(args.out).resolve(), project="otel-tracking-demo", experiment="grpo-simulated")
    places.use(backends)  # the demo writes under --out unless the caller's environment already says where
    tracking = run_demo(
        steps=args.steps,
        backends=backends,
        val_every=args.val_every,
        lanes=args.lanes,
        project=places.project,
        experiment=places.experiment,
    )
    print("\nThe run is done. Where each sink wrote:")
    for name, where in tracking.where().items():
        print(f"  {name:>12}: {where}")
    events = _events_file(places.project, places.experiment) if "file" in backends else None
    metrics = Path(os.environ.get("VERL_FILE_LOGGER_PATH", ""))  # where DemoPlaces put the file sink
    found = [goodput_summary(metrics)] if events is not None and metrics.is_file() else []
    found += [straggler_summary(events)] if events is not None else []
    if any(found):
        said = "; ".join(f for f in found if f)
        print(f"\nThe step's anatomy: {said}; draw a step:\n  otel-tracking timeline {events} --steps 3")
    hints = places.next_steps(backends)
    if hints:
        print("\nTo look at it:")
        for hint in hints:
            print(f"  {hint}")
    return 0


def _events_file(project: str, experiment: str) -> Path | None:
    """The file sink's events file of a finished demo run, if it wrote one."""
    from otel_tracking.config import paths
    from otel_tracking.exporters.file import events_path

    path = events_path(paths.file_sink_path(project, experiment))
    return path if path.exists() else None


def _stack(args: argparse.Namespace) -> int:
    from otel_tracking_stack import stack  # development tooling beside the runtime, loaded on demand

    return stack.main([args.action, *args.options])


def _replay(args: argparse.Namespace) -> int:
    from otel_tracking.delivery import replay

    return replay.main(args.paths)


def _stalls(args: argparse.Namespace) -> int:
    from otel_tracking.cli import stalls

    return stalls.main(args.paths, stacks=args.stacks)


def _timeline(args: argparse.Namespace) -> int:
    from otel_tracking.cli import timeline

    traces_url = args.traces_url or os.environ.get("OTEL_TRACKING_TRACES_URL") or None
    return timeline.main(args.paths, args.steps, args.out, traces_url=traces_url)


def _steps(raw: str) -> str:
    """An argparse type: ``N`` or ``N-M`` (steps), else a one-line usage error."""
    first, _, last = raw.partition("-")
    if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a step or a range of steps (3, or 3-5)")
    return raw


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, else a one-line usage error."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{raw} is below the minimum {minimum}")
        return value

    return parse


def _backend_list(raw: str) -> str:
    if not [name for name in raw.split(",") if name.strip()]:
        raise argparse.ArgumentTypeError("name at least one backend, e.g. console,file")
    return raw


def build_parser() -> argparse.ArgumentParser:
    """The ``otel-tracking`` command's parser (the docs' CLI reference is generated from it)."""
    from otel_tracking.signals.semconv import SCOPE_VERSION

    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="otel-tracking",
        description="OpenTelemetry-native experiment tracking: a demo run, a local trace UI (Zipkin) or the full "
        "stack, replay of what a sink could not take, stall reports and a step's timeline.",
    )
    parser.add_argument("--version", action="version", version=f"otel-tracking {SCOPE_VERSION}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (also OTEL_TRACKING_DEBUG=1)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="run a simulated RL training run through the Tracking facade", formatter_class=defaults
    )
    demo.add_argument(
        "--backends",
        type=_backend_list,
        default=os.environ.get("OTEL_TRACKING_DEMO_BACKENDS", "console,file,tensorboard"),
        help="comma-separated backends (the default comes from OTEL_TRACKING_DEMO_BACKENDS when set)",
    )
    demo.add_argument("--steps", type=_count(1), default=20, help="training steps")
    demo.add_argument("--val-every", type=_count(0), default=10, help="a validation step every N steps (0: none)")
    demo.add_argument("--lanes", type=_count(1), default=4, help="simulated rollout workers (span lanes)")
    demo.add_argument("--out", default="otel-tracking-demo", help="directory for the local sinks' files")
    demo.set_defaults(func=_demo)

    stack = commands.add_parser(
        "stack",
        help="a local trace UI: stack up --light (Zipkin, nothing to build), or the full stack: a collector, "
        "Zipkin, Prometheus with a stall alert, Jaeger's API (up|down|status|build)",
        epilog="options: up [--light] [--free-ports] [--gateway] [--timeout S] [--state-dir DIR]; "
        "down|status [--state-dir DIR] (status exits 3 when a program is not healthy); build. "
        "otel-tracking stack up --help says more.",
    )
    stack.add_argument("action", choices=["up", "down", "status", "build"])
    stack.add_argument("options", nargs=argparse.REMAINDER, help="the action's options (see below)")
    stack.set_defaults(func=_stack)

    replay = commands.add_parser(
        "replay",
        help="deliver spooled data (what a sink could not take) into its sink",
        epilog="Each file goes where its run went (the OTLP endpoint or MLflow URI kept in its header) unless "
        "OTEL_EXPORTER_OTLP_ENDPOINT or MLFLOW_TRACKING_URI say otherwise. Replay keeps its place beside each file "
        "(<file>.pos) and never moves a file a running job may still append to: a file still being written is "
        "delivered up to its end and left for the next replay; a file delivered in full, that nothing writes, is "
        "removed. Stopped (Ctrl-C, SIGTERM, a kill), the next replay goes on where it stopped: no record is "
        "delivered twice (records a killed replay had on their way are set aside in <file>.in-doubt). "
        "Exit code 0 only when everything was delivered and nothing is left to deliver (then the spool may be "
        "deleted); 75 when something is left for a later replay: a file a running process still writes, records "
        "the backend did not take, records set aside in doubt, a file not replayed; 1 for a path that does not "
        "exist, a *.replayed file of an older release, or damaged records skipped; 130 when interrupted.",
    )
    replay.add_argument(
        "paths", nargs="*", help="spool files or directories (default: the whole spool, OTEL_TRACKING_SPOOL_DIR)"
    )
    replay.set_defaults(func=_replay)

    stalls = commands.add_parser(
        "stalls",
        help="the phases a run reported stuck (ml.stall), from the file sink's events files",
        epilog="One row per stuck phase, its latest report: rank, role, pid, host, phase, step, how long it was open, "
        "its bound, whether it recovered (after how long) or was still open at the end, and the line it was stuck "
        "in. Exit code 0 when no stall was still open at the end (none reported, or all recovered), 1 when some "
        "were, 2 when no events file was found.",
    )
    stalls.add_argument(
        "paths", nargs="*", help="events files (<experiment>.events.jsonl) or directories (default: the current one)"
    )
    stalls.add_argument("--stacks", action="store_true", help="print each report's Python stacks too")
    stalls.set_defaults(func=_stalls)

    timeline = commands.add_parser(
        "timeline",
        help="a picture of a step: every lane's spans over time (HTML) and Chrome trace events (Perfetto)",
        epilog="Reads the span lines of the file sink's events files and OTLP/JSON trace files. Writes <out>.html "
        "(one row per lane, the "
        "training process's phases on top, idle time empty, each phase's straggler outlined and listed) and "
        "<out>.json (Chrome trace events). Exit code 2 when no span of those steps was found.",
    )
    timeline.add_argument(
        "paths",
        nargs="*",
        help="events files (<experiment>.events.jsonl), OTLP/JSON trace files (a collector's file exporter) "
        "or directories (default: the current one)",
    )
    timeline.add_argument("--steps", type=_steps, help="a step (3) or a range (3-5); default: the last step")
    timeline.add_argument(
        "--out",
        help="where to write, without suffix (default: timeline-step<N> beside the first events file, or in the "
        "first directory given)",
    )
    timeline.add_argument(
        "--traces-url",
        help="also the run's spans the stack's trace UI keeps (Zipkin, e.g. http://127.0.0.1:9411/zipkin/: the "
        "workers that export only over OTLP); default: OTEL_TRACKING_TRACES_URL",
    )
    timeline.set_defaults(func=_timeline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as error:
        if args.debug or os.environ.get("OTEL_TRACKING_DEBUG") == "1":
            raise
        print(f"otel-tracking: error: {error}" if _expected(error) else _unexpected(error), file=sys.stderr)
        return 1


def _expected(error: Exception) -> bool:
    """Errors whose message is the whole story (configuration, a missing package, the stack)."""
    from otel_tracking.config.settings import ConfigError

    return isinstance(error, (ConfigError, FileNotFoundError)) or type(error).__name__ == "StackError"


def _unexpected(error: Exception) -> str:
    return f"otel-tracking: error: {type(error).__name__}: {error} (run with --debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
