"""wandb's private names, named here and nowhere else: steps handed to its service directly.

``run.log`` does per-value work for a step of plain numbers (``history_dict_to_json``, a JSON encoder
and a protobuf item per value, a telemetry histogram), then one hand-off to wandb's asyncio thread.
:class:`FastSteps` builds the very request ``run.log`` would build for such a step (the same items,
the same JSON text from the same encoder, ``_timestamp`` last, the same record and stream) and hands
several in one go.  That needs names wandb keeps private: :data:`PRIVATE_NAMES` lists them, and
without any of them every step goes through ``run.log`` (the same data, more CPU a step).
:meth:`FastSteps.of` says once per process, at debug, which path runs and why, and warns once when
a release it was checked against lacks a name.  ``tests/test_wandb_fast_steps.py`` is the contract:
the stored records equal ``run.log``'s, and a name taken away falls back.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_tracking.compat._said import SaidOnce, tested_release

logger = logging.getLogger("otel_tracking.wandb")
_say = SaidOnce(logger, "otel-tracking: wandb steps: %s", "otel-tracking: wandb's %s; every step goes through run.log")

# The wandb releases whose run.log this was checked against (tests/test_wandb_fast_steps.py): with
# another one, run.log does the work until the test has been run against it.
TESTED_RELEASES = ((0, 31),)

# Each private name, by what holds it; without any, every step goes through run.log.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "wandb.sdk.wandb_run.Run": (
        "_interface",
        "_local_step",
        "_init_pid",
        "_is_attached",
        "_is_finished",
        "_settings",
        "_telemetry_obj",
    ),
    "wandb.sdk.interface.interface_sock.InterfaceSock": ("_client", "_asyncer", "_stream_id", "_record_client_encode"),
    "wandb": ("patched",),
    "wandb.sdk.lib.json_util": ("pydantic_core",),
    "wandb.proto.wandb_server_pb2": ("ServerRequest",),
}


def tested_version(module: Any) -> bool:
    return tested_release(module, TESTED_RELEASES)


def missing(run: Any, interface: Any) -> list[str]:
    """The private names of :data:`PRIVATE_NAMES` that this run, its interface or wandb lack."""
    modules = sys.modules
    holders: dict[str, Any] = {
        "wandb.sdk.wandb_run.Run": run,
        "wandb.sdk.interface.interface_sock.InterfaceSock": interface,
        "wandb": modules.get("wandb"),
        "wandb.sdk.lib.json_util": modules.get("wandb.sdk.lib.json_util"),
        "wandb.proto.wandb_server_pb2": modules.get("wandb.proto.wandb_server_pb2"),
    }
    return [f"{where}.{name}" for where, names in PRIVATE_NAMES.items() for name in names
            if not hasattr(holders[where], name)]  # fmt: skip


class FastSteps:
    """Steps of plain numbers, handed to wandb's service as ``run.log(data, step=step)`` would."""

    def __init__(self, run: Any, wandb: Any, interface: Any, to_json: Callable[..., bytes], spb: Any) -> None:
        self.run = run
        self.wandb = wandb
        self.interface = interface
        self.to_json = to_json
        self.server_request = spb.ServerRequest
        self.pid = os.getpid()
        self.sent = 0  # steps handed to wandb's service directly

    @classmethod
    def of(cls, run: Any) -> FastSteps | None:
        """The fast path for ``run``, or None (and why, said once) when this is not the wandb it
        was written for."""
        modules = sys.modules
        wandb_run = modules.get("wandb.sdk.wandb_run")
        interface_sock = modules.get("wandb.sdk.interface.interface_sock")
        wandb = modules.get("wandb")
        if wandb_run is None or interface_sock is None or wandb is None:
            _say("run.log for every step: wandb's run or interface modules are not loaded")
            return None
        if not tested_version(wandb):
            _say(f"run.log for every step: wandb {getattr(wandb, '__version__', '?')} is not a release this was "
                 f"checked against {TESTED_RELEASES}")  # fmt: skip
            return None
        interface = getattr(run, "_interface", None)
        if type(run) is not getattr(wandb_run, "Run", None) or "log" in vars(run):
            _say("run.log for every step: the run is a subclass of wandb's Run or has a patched log")
            return None
        if type(interface) is not getattr(interface_sock, "InterfaceSock", None):
            _say("run.log for every step: the run does not talk to wandb's service over its socket interface")
            return None
        try:
            import pydantic_core
            from wandb.proto import wandb_server_pb2 as spb
            from wandb.sdk.lib import json_util
        except ImportError as error:
            _say(f"private names moved: {error}", moved=True)
            return None
        gone = missing(run, interface)
        if gone or not isinstance(wandb.patched, Mapping):
            _say(f"private names moved: {', '.join(gone) or 'wandb.patched is not a mapping'}", moved=True)
            return None
        if json_util.pydantic_core is not pydantic_core:
            _say("run.log for every step: its JSON comes from another encoder than pydantic_core")
            return None
        _say(f"steps of plain numbers go to wandb {wandb.__version__}'s service directly, as run.log's requests")
        return cls(run, wandb, interface, pydantic_core.to_json, spb)

    def usable(self) -> bool:
        """Whether run.log would now do nothing but send the request (no warning, no attach, no
        telemetry update, no tensorboard step handling, JSON values only)."""
        run = self.run
        try:
            settings = run._settings
            return bool(
                os.getpid() == self.pid == run._init_pid == getattr(run, "_attach_pid", None)
                and not run._is_attached
                and not run._is_finished
                and run._interface is self.interface
                and run._telemetry_obj.feature.set_step_log  # run.log's telemetry said so already
                and not settings._shared
                and settings.x_history_value_encoding == "json"
                and not self.wandb.patched.get("tensorboard")
            )
        except Exception:
            return False

    def request(self, scalars: Mapping[str, Any], step: int) -> Any:
        """The request run.log would send for ``scalars`` at ``step``; None when run.log would do
        more than that for them (a value that is not a plain number, a key wandb treats specially)."""
        if not scalars or not self.usable():
            return None
        keys = list(scalars)
        values = list(scalars.values())
        for key, value in zip(keys, values, strict=True):
            if type(value) not in (float, int, bool) or type(key) is not str or key.startswith("_"):
                return None
        started = time.monotonic()
        values.append(time.time())  # run.log adds "_timestamp" last, when it encodes the step
        keys.append("_timestamp")
        try:
            # One call of wandb's own encoder for the step: the same text, value by value, as one
            # call each (numbers hold no comma).
            texts = self.to_json(values, inf_nan_mode="constants").decode()[1:-1].split(",")
            if len(texts) != len(keys):
                return None
            request = self.server_request()
            record = request.record_publish
            history = record.request.partial_history
            add = history.item.add
            for key, text in zip(keys, texts, strict=True):
                item = add()
                item.key = key
                item.value_json = text
            history.step.num = step
            record.control.local = True
            record._info.stream_id = self.interface._stream_id
        except Exception:  # a key protobuf refuses (not UTF-8): run.log says what is wrong
            return None
        self.interface._record_client_encode(time.monotonic() - started)
        return request

    def send(self, requests: Sequence[Any]) -> None:
        """The requests, in order, in one hand-off to wandb's asyncio thread (run.log makes one a
        step), then run.log's bookkeeping: the run's step is the highest step logged."""
        client = self.interface._client

        async def publish() -> None:
            for request in requests:
                await client.publish(request)

        self.interface._asyncer.run(publish)
        self.sent += len(requests)
        step = max(request.record_publish.request.partial_history.step.num for request in requests)
        if step > self.run._local_step:
            self.run._local_step = step
