"""The ``otel-tracking`` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from otel_tracking.demo import run_demo

    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    out = Path(args.out).resolve()
    # The demo writes under --out unless the caller's environment already says where.
    os.environ.setdefault("VERL_FILE_LOGGER_ROOT", str(out))
    os.environ.setdefault("TENSORBOARD_DIR", str(out / "tensorboard"))
    os.environ.setdefault("SWANLAB_LOG_DIR", str(out / "swanlog"))
    os.environ.setdefault("SWANLAB_MODE", "offline")
    os.environ.setdefault("TRACKIO_DIR", str(out / "trackio"))
    os.environ.setdefault("WANDB_MODE", "offline")
    for variable, folder in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        os.environ.setdefault(variable, str(out / folder))
    os.environ.setdefault("WANDB_CONFIG_DIR", str(out / "wandb-config"))
    os.environ.setdefault("OTEL_TRACKING_SPOOL_DIR", str(out / "spool"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}")
    if "clearml" in backends:
        _clearml_offline(out)
    tracking = run_demo(steps=args.steps, backends=backends, val_every=args.val_every, lanes=args.lanes)
    print("\nThe run is done. Where each sink wrote:")
    for name, where in tracking.where().items():
        print(f"  {name:>12}: {where}")
    hints = _what_next(backends)
    if hints:
        print("\nTo look at it:")
        for hint in hints:
            print(f"  {hint}")
    return 0


def _clearml_offline(out: Path) -> None:
    """ClearML needs a server or a config file before Task.init; the demo gives it an offline one
    whose cache (where offline sessions go) is under --out.  ClearML still keeps a small
    ``~/.clearml/.session.json``: its location is fixed to the home folder."""
    os.environ.setdefault("CLEARML_OFFLINE_MODE", "1")
    if "CLEARML_CONFIG_FILE" in os.environ:
        return
    config = out / "clearml.conf"
    config.parent.mkdir(parents=True, exist_ok=True)
    # report_use_subprocess off: else closing the task waits ~11 s for ClearML's reporter process.
    config.write_text(
        "sdk {\n"
        "  development { report_use_subprocess: false }\n"
        f"  storage {{ cache {{ default_base_dir: {json.dumps(str(out / 'clearml'))} }} }}\n"
        "}\n"
    )
    os.environ["CLEARML_CONFIG_FILE"] = str(config)


def _what_next(backends: Sequence[str]) -> list[str]:
    """Commands that show this run, for the backends it used."""
    hints = []
    if "tensorboard" in backends:
        hints.append(f"tensorboard --logdir {os.environ['TENSORBOARD_DIR']}")
    if "mlflow" in backends:
        uri = os.environ["MLFLOW_TRACKING_URI"]
        hints.append(f"mlflow ui --backend-store-uri {uri}   # needs the full mlflow package: pip install mlflow")
    if "trackio" in backends:
        hints.append(f"TRACKIO_DIR={os.environ['TRACKIO_DIR']} trackio show")
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        hints.append("otel-tracking stack status   # the Jaeger API and Prometheus URLs of the local stack")
    return hints


def _stack(args: argparse.Namespace) -> int:
    from otel_tracking_stack import stack  # development tooling beside the runtime, loaded on demand

    return stack.main([args.action, *args.options])


def _replay(args: argparse.Namespace) -> int:
    from otel_tracking import replay

    return replay.main(args.paths)


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


def main(argv: Sequence[str] | None = None) -> int:
    from otel_tracking import __version__

    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="otel-tracking",
        description="OpenTelemetry-native experiment tracking: a demo run, a local collector/Jaeger/Prometheus "
        "stack, and replay of what a sink could not take.",
    )
    parser.add_argument("--version", action="version", version=f"otel-tracking {__version__}")
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
        help="run a local collector, Jaeger and Prometheus (up|down|status|build)",
        epilog="options: up [--free-ports] [--gateway] [--timeout S] [--state-dir DIR]; "
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
        "OTEL_EXPORTER_OTLP_ENDPOINT or MLFLOW_TRACKING_URI say otherwise. Exit code 0 when everything was "
        "delivered, 1 when something failed or was damaged, 2 for a path that does not exist.",
    )
    replay.add_argument(
        "paths", nargs="*", help="spool files or directories (default: the whole spool, OTEL_TRACKING_SPOOL_DIR)"
    )
    replay.set_defaults(func=_replay)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as error:
        if args.debug or os.environ.get("OTEL_TRACKING_DEBUG") == "1":
            raise
        print(f"otel-tracking: error: {error}" if _expected(error) else _unexpected(error), file=sys.stderr)
        return 1


def _expected(error: Exception) -> bool:
    """Errors whose message is the whole story (configuration, a missing package, the stack)."""
    from otel_tracking.settings import ConfigError

    return isinstance(error, (ConfigError, FileNotFoundError)) or type(error).__name__ == "StackError"


def _unexpected(error: Exception) -> str:
    return f"otel-tracking: error: {type(error).__name__}: {error} (run with --debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
