"""The ``otel-tracking`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
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
    os.environ.setdefault("WANDB_DIR", str(out))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}")
    tracking = run_demo(steps=args.steps, backends=backends, val_every=args.val_every, lanes=args.lanes)
    print("\nThe run is done. Where each sink wrote:")
    for name, where in tracking.where().items():
        print(f"  {name:>12}: {where}")
    return 0


def _stack(args: argparse.Namespace) -> int:
    from otel_tracking import stack

    return stack.main([args.action, *args.rest])


def _replay(args: argparse.Namespace) -> int:
    from otel_tracking import replay

    return replay.main(args.paths)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-tracking", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run a simulated RL training run through the Tracking facade")
    demo.add_argument(
        "--backends",
        default=os.environ.get("OTEL_TRACKING_DEMO_BACKENDS", "console,file,tensorboard"),
        help="comma-separated backends (default: console,file,tensorboard)",
    )
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--val-every", type=int, default=10)
    demo.add_argument("--lanes", type=int, default=4, help="simulated rollout workers (span lanes)")
    demo.add_argument("--out", default="otel-tracking-demo", help="directory for the local sinks' files")
    demo.set_defaults(func=_demo)

    stack = commands.add_parser("stack", help="run a local collector, Jaeger and Prometheus (up|down|status|build)")
    stack.add_argument("action", choices=["up", "down", "status", "build"])
    stack.add_argument("rest", nargs=argparse.REMAINDER)
    stack.set_defaults(func=_stack)

    replay = commands.add_parser("replay", help="deliver spooled data (what a sink could not take) into its sink")
    replay.add_argument("paths", nargs="*", help="spool files or directories (default: the whole spool)")
    replay.set_defaults(func=_replay)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
