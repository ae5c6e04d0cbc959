"""Real servers for tests, on loopback, started and stopped by PID: an MLflow tracking server, a
TCP proxy that delays (or holds) every request, and a server that accepts connections and never
answers (a hung proxy)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import free_port


class MlflowServer:
    """``mlflow server`` with a sqlite store; about 15 s to answer /health on this machine."""

    def __init__(self, root: Path, port: int | None = None, workers: int = 1) -> None:
        self.root = root
        self.port = port or free_port()
        self.workers = workers
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"server-{self.port}.log", "ab")  # noqa: SIM115 - closed with the process
        mlflow = Path(sys.executable).with_name("mlflow")
        self.process = subprocess.Popen(
            [
                str(mlflow),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.root / 'mlflow.db'}",
                "--default-artifact-root",
                str(self.root / "artifacts"),
                "--workers",
                str(self.workers),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: see {log.name}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"mlflow server did not answer /health within {timeout_s}s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # the server's workers are its children
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


class DelayProxy:
    """Forwards 127.0.0.1:port to a target, holding every chunk from the client for ``delay_s``
    (one HTTP request is one chunk or a few: each request waits about ``delay_s``) and, with a
    ``gate``, for as long as the gate is not set."""

    def __init__(self, target_port: int, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.gate = gate
        self.port = free_port()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> DelayProxy:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # an answer held at the gate is late, not lost
            for source, sink, delay, gate in (
                (client, upstream, self.delay_s, self.gate),
                (upstream, client, 0.0, None),
            ):
                threading.Thread(target=self._pipe, args=(source, sink, delay, gate), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delay: float, gate: threading.Event | None) -> None:
        try:
            while chunk := source.recv(65536):
                if delay:
                    time.sleep(delay)
                while gate is not None and not gate.wait(0.1):
                    if self._stop.is_set():
                        return
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class HungServer:
    """Accepts TCP connections on 127.0.0.1:port, reads what comes and never answers: a hung
    proxy in front of a tracker.  A client waits until its own timeout, or forever."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self.accepted = threading.Event()  # a client connected
        self._connections: list[socket.socket] = []
        self._stop = threading.Event()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HungServer:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._server.close()
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            self._connections.append(connection)
            self.accepted.set()
            threading.Thread(target=self._swallow, args=(connection,), daemon=True).start()

    def _swallow(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while connection.recv(65536):
                pass


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie still answers kill(0): look at its state
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True


def live_children(parent: int | None = None) -> set[int]:
    """Live (non-zombie) child processes of ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found
