"""The viewers of a demo run, as a user opens them: each viewer's own server on loopback, and
Debian's ``chromium`` (headless) driven through the DevTools protocol.

Used by ``tests/test_viewers.py`` (what a user must see) and ``scripts/screenshots`` (the docs'
pictures).  Waits are on conditions with deadlines (the page's DOM, a server's health URL), never
on a fixed sleep.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
HOST = "127.0.0.1"
BIN = Path(sys.executable).parent
# The flags that work here (../shared/BACKENDS.md): no sandbox as root, no GPU (headless WebGL
# draws blank lines: TensorBoard gets ?forceSVG=true).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio")


class ViewerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25) -> T:
    """``check()`` until it returns something truthy; ViewerError with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except (OSError, ValueError, KeyError) as error:  # a server still starting, a page still loading
            last = error
        if last and not isinstance(last, Exception):
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise ViewerError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}"[:2000])
        time.sleep(interval)


def http_get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def http_json(url: str, timeout: float = 10.0) -> Any:
    return json.loads(http_get(url, timeout))


class Server:
    """One viewer's server process (its own process group, its output in a log file)."""

    def __init__(
        self, name: str, command: Sequence[str], port: int, log_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    def wait_ready(self, path: str = "/", timeout: float = 120.0) -> Server:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise ViewerError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
            http_get(self.url + path, timeout=5)
            return True

        wait_for(ready, timeout, f"{self.name} at {self.url}{path}")
        return self

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop_group(self.process)


def tensorboard(logdir: Path, log_dir: Path) -> Server:
    port = free_port()
    command = [str(BIN / "tensorboard"), "--logdir", str(logdir), "--host", HOST, "--port", str(port)]
    return Server("tensorboard", command, port, log_dir)


def mlflow_ui(tracking_uri: str, log_dir: Path) -> Server:
    port = free_port()
    command = [str(BIN / "mlflow"), "ui", "--backend-store-uri", tracking_uri, "--host", HOST, "--port", str(port)]
    command += ["--workers", "1"]
    return Server("mlflow", command, port, log_dir, {"MLFLOW_DISABLE_TELEMETRY": "true"})


def trackio_show(trackio_dir: Path, project: str, log_dir: Path) -> Server:
    port = free_port()
    env = {"TRACKIO_DIR": str(trackio_dir), "GRADIO_SERVER_PORT": str(port), "BROWSER": "true"}
    return Server("trackio", [str(BIN / "trackio"), "show", "--project", project], port, log_dir, env)


# --- the run ---------------------------------------------------------------------------------------

DEMO_BACKENDS = "file,tensorboard,mlflow,trackio,wandb"


def run_demo(
    root: Path,
    otlp_endpoint: str,
    steps: int = 12,
    val_every: int = 5,
    lanes: int = 4,
    traces_url: str | None = None,
) -> tuple[Path, str, str]:
    """``otel-tracking demo`` as a user runs it, in ``root/cwd`` with its own home and ``--out run``,
    its OTLP to ``otlp_endpoint`` (and the trace UI that ``stack up`` prints, when given); (the
    --out directory, what it printed on stdout, on stderr)."""
    cwd, home = root / "cwd", root / "home"
    cwd.mkdir()
    home.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLFLOW_", "WANDB_", "TRACKIO_"))},
        "HOME": str(home),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        **({"OTEL_TRACKING_TRACES_URL": traces_url} if traces_url else {}),
    }
    command = [str(BIN / "otel-tracking"), "demo", "--backends", DEMO_BACKENDS, "--steps", str(steps)]
    command += ["--val-every", str(val_every), "--lanes", str(lanes), "--out", "run"]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ViewerError(f"the demo failed ({done.returncode}): {done.stderr[-3000:]}")
    return cwd / "run", done.stdout, done.stderr


def step_trace_id(zipkin_port: int, step: int, service: str = "otel-tracking-demo") -> str:
    """The id of the trace whose root is step ``step``'s (``ml.step``), as Zipkin's API lists it."""
    query = urllib.parse.urlencode(
        {"serviceName": service, "annotationQuery": f"ml.step={step}", "limit": "1000", "lookback": "86400000"}
    )

    def found() -> str | None:
        for trace in http_json(f"http://{HOST}:{zipkin_port}/api/v2/traces?{query}"):
            roots = [span for span in trace if "parentId" not in span]
            if [root["name"] for root in roots] == ["ml.step"] and roots[0]["tags"].get("ml.step") == str(step):
                return str(roots[0]["traceId"])
        return None

    return wait_for(found, 60, f"step {step}'s trace in Zipkin")


# --- the browser ---------------------------------------------------------------------------------


class Page:
    """One tab, driven over its DevTools websocket."""

    def __init__(self, websocket_url: str) -> None:
        from websockets.sync.client import connect

        self._connection = contextlib.ExitStack()
        self._socket = self._connection.enter_context(connect(websocket_url, max_size=64 * 2**20, open_timeout=30))
        self._ids = itertools.count(1)

    def send(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        self._socket.send(json.dumps({"id": request_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self._socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == request_id:
                if "error" in message:
                    raise ViewerError(f"{method}: {message['error']}")
                return dict(message.get("result") or {})

    def open(self, url: str) -> Page:
        self.send("Page.enable")
        self.send("Page.navigate", url=url)
        return self

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise ViewerError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def text(self) -> str:
        """What the page shows as text (``innerText`` of the body, shadow roots included)."""
        return str(self.evaluate(_TEXT_WITH_SHADOW_ROOTS) or "")

    def wait_for_text(self, needles: Sequence[str], timeout: float = 90.0) -> str:
        """The page's text once it shows every one of ``needles``."""

        def shown() -> str | None:
            text = self.text()
            return text if all(needle in text for needle in needles) else None

        try:
            return wait_for(shown, timeout, f"{needles!r} on the page")
        except ViewerError as error:
            missing = [needle for needle in needles if needle not in self.text()]
            raise ViewerError(f"{error}; missing {missing!r}; the page shows: {self.text()[:3000]!r}") from None

    def click_text(self, text: str, selector: str = "*") -> None:
        """Click the innermost element under ``selector`` whose own text is ``text``."""
        found = self.evaluate(_CLICK_TEXT % (json.dumps(selector), json.dumps(text)))
        if not found:
            raise ViewerError(f"nothing to click shows {text!r}")

    def screenshot(self, path: Path, width: int = 1280, height: int = 800, scale: float = 0.6) -> None:
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": scale}
        data = self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=False)["data"]
        import base64

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._connection.close()


_TEXT_WITH_SHADOW_ROOTS = """
(() => {
  const parts = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) {
        for (const child of el.shadowRoot.children) {
          if (child.tagName !== 'STYLE' && child.tagName !== 'TEMPLATE') parts.push(child.innerText || '');
        }
        walk(el.shadowRoot);
      }
    }
  };
  parts.unshift(document.body ? document.body.innerText : '');
  if (document.body) walk(document.body);
  return parts.join('\\n');
})()
"""

_CLICK_TEXT = """
(() => {
  const wanted = %s, text = %s;
  const hits = [...document.querySelectorAll(wanted)].filter(
    (el) => (el.innerText || '').trim() === text && ![...el.children].some((c) => (c.innerText || '').trim() === text));
  if (!hits.length) return false;
  hits[0].click();
  return true;
})()
"""


class Browser:
    """Headless chromium with a DevTools port, in a profile of its own."""

    def __init__(self, width: int = 1600, height: int = 1000) -> None:
        binary = shutil.which("chromium")
        if binary is None:
            raise ViewerError("chromium is not installed: apt-get install -y chromium (scripts/test does)")
        self.port = free_port()
        self._profile = tempfile.mkdtemp(prefix="viewers-chromium-")
        command = [
            binary,
            *CHROMIUM_FLAGS,
            f"--window-size={width},{height}",
            f"--remote-debugging-port={self.port}",
            f"--user-data-dir={self._profile}",
            "about:blank",
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_for(lambda: http_json(f"http://{HOST}:{self.port}/json/version"), 60, "chromium's DevTools port")
        self._pages: list[Page] = []

    def page(self, url: str) -> Page:
        request = urllib.request.Request(f"http://{HOST}:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            target = json.loads(response.read())
        page = Page(target["webSocketDebuggerUrl"])
        self._pages.append(page)
        return page.open(url)

    def close(self) -> None:
        for page in self._pages:
            page.close()
        stop_group(self.process)
        shutil.rmtree(self._profile, ignore_errors=True)


@contextlib.contextmanager
def browser() -> Iterator[Browser]:
    opened = Browser()
    try:
        yield opened
    finally:
        opened.close()


def tail_on_error(server: Server) -> str:
    return f"\n--- {server.name} log ---\n{server.log_tail()}"


__all__ = [
    "Browser",
    "Page",
    "Server",
    "ViewerError",
    "browser",
    "free_port",
    "http_json",
    "mlflow_ui",
    "run_demo",
    "tensorboard",
    "trackio_show",
    "wait_for",
]


def stop_group(process: subprocess.Popen[Any]) -> None:
    """SIGTERM to the process's group (a viewer's server and its workers, or chromium and its
    helpers), SIGKILL after 15 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)
