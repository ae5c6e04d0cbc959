"""The local observability stack: OpenTelemetry Collector, Jaeger v2, Zipkin and Prometheus.

Real programs on the loopback interface, no containers:

- ``otelcol``: built with the OpenTelemetry Collector Builder from
  ``deploy/collector/builder-config.yaml`` and run with the repository's
  ``collector-config.yaml``;
- ``jaeger``: ``github.com/jaegertracing/jaeger/cmd/jaeger`` built with ``go build``, run with
  ``deploy/jaeger/config.yaml`` (in-memory storage, OTLP in, HTTP query API out);
- ``zipkin``: Zipkin's executable jar (``io.zipkin:zipkin-server``, fetched from Maven Central
  by its coordinates), run with Debian's Java, in-memory storage and a bounded heap: the
  stack's trace UI, a waterfall per trace in the browser.  It has no OTLP intake, so the collector
  sends traces as OTLP/JSON to ``trace_ui_relay`` (``zipkin_relay.py``), which posts them to Zipkin;
- ``prometheus``: Debian's ``/usr/bin/prometheus`` with a generated config that scrapes the
  collector's Prometheus exporter every second.

That collector is also the *gateway* of a multi-node run; ``Agent`` runs the node-local agent
(the same binary with ``deploy/collector/agent.yaml``) that forwards to it.

``collector-config.yaml`` and ``deploy/`` sit beside this module, in the package
``otel_tracking_stack``: the checkout and an installed wheel (package data) have the same layout.

Binaries are cached under ``~/.cache/otel-tracking/bin`` (``$OTEL_TRACKING_CACHE_DIR``
overrides the root), keyed by version and, for the collector, a hash of the manifest, so a
second run reuses them.

This is development tooling beside the runtime package ``otel_tracking``, not part of it: standard
library only; of ``otel_tracking`` it uses the scrape-target files (``otel_tracking.distributed.targets``), which
the runtime writes and this stack's Prometheus reads. ``main(argv)`` implements
``otel-tracking stack up|down|status|build``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

__all__ = [
    "BUILDER_VERSION",
    "JAEGER_VERSION",
    "Agent",
    "AgentPorts",
    "Ports",
    "Stack",
    "StackError",
    "cache_dir",
    "config_files",
    "ensure_binaries",
    "main",
]

BUILDER_VERSION = "v0.165.0"
JAEGER_MODULE = "github.com/jaegertracing/jaeger"
JAEGER_VERSION = "v1.76.0"
ZIPKIN_ARTIFACT = "io.zipkin:zipkin-server"
ZIPKIN_VERSION = "3.6.1"
MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
ZIPKIN_HEAP = "256m"  # Zipkin's memory stays bounded: its heap, and MEM_MAX_SPANS spans kept
ZIPKIN_MAX_SPANS = "200000"
HOST = "127.0.0.1"


class StackError(RuntimeError):
    """A binary cannot be built or found, or a program did not become healthy."""


# collector-config.yaml and deploy/, beside this module in a checkout and in a wheel alike.
STACK_FILES = Path(__file__).resolve().parent
COLLECTOR_MANIFEST = STACK_FILES / "deploy" / "collector" / "builder-config.yaml"
COLLECTOR_CONFIG = STACK_FILES / "collector-config.yaml"
AGENT_CONFIG = STACK_FILES / "deploy" / "collector" / "agent.yaml"
JAEGER_CONFIG = STACK_FILES / "deploy" / "jaeger" / "config.yaml"
STALL_RULES = STACK_FILES / "deploy" / "prometheus" / "stall-rules.yaml"  # the PhaseStalled alert

# In start order; Zipkin starts first and is waited for last (its JVM takes ~20 s to come up).
PROCESS_NAMES = ("zipkin", "jaeger", "trace_ui_relay", "collector", "prometheus")
# `up --light`: the trace UI alone.  The relay takes the library's OTLP/HTTP itself, on the
# collector's port: nothing to build, only Zipkin's jar to fetch.
LIGHT_PROCESS_NAMES = ("zipkin", "trace_ui_relay")


# --------------------------------------------------------------------------- binaries


def cache_dir() -> Path:
    """Root of the cache: ``$OTEL_TRACKING_CACHE_DIR`` or ``$XDG_CACHE_HOME/otel-tracking``."""
    explicit = os.environ.get("OTEL_TRACKING_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "otel-tracking"


def _log(msg: str) -> None:
    print(f"[otel-tracking stack] {msg}", file=sys.stderr, flush=True)


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if not go:
        raise StackError("the Go toolchain is needed to build otelcol and jaeger, but `go` is not on PATH")
    return go


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = env.get("GOFLAGS", "").split()
    if not any(f.startswith("-mod=") for f in flags):
        flags.append("-mod=mod")
    env["GOFLAGS"] = " ".join(flags)
    return env


def _run_logged(cmd: Sequence[str], cwd: Path, log: Path, env: Mapping[str, str]) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(list(cmd), cwd=cwd, env=dict(env), stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise StackError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_stack_file(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as err:
        raise StackError(f"cannot read {path}: {err.strerror or err}") from err


def manifest_key(manifest: Path = COLLECTOR_MANIFEST) -> str:
    """``<dist.version>-<hash>`` of the builder manifest (comments and output_path ignored), so a
    checkout and an installed wheel, which ship the same manifest, share the cached binary."""
    text = _read_stack_file(manifest)
    lines = []
    for line in text.splitlines():
        stripped = line.split(" #", 1)[0].rstrip()
        if not stripped.strip() or stripped.lstrip().startswith("#"):
            continue
        if stripped.strip().startswith("output_path:"):
            continue
        lines.append(stripped)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]
    match = re.search(r"^\s+version:\s*['\"]?([^'\"\s]+)", text, re.M)
    version = match.group(1) if match else "unknown"
    return f"{version}-{digest}"


def _ensure_builder(bin_root: Path) -> Path:
    target_dir = bin_root / f"ocb-{BUILDER_VERSION}"
    builder = target_dir / "builder"
    if builder.exists():
        return builder
    target_dir.mkdir(parents=True, exist_ok=True)
    env = _go_env()
    env["GOBIN"] = str(target_dir)
    _log(f"installing the collector builder {BUILDER_VERSION}")
    _run_logged(
        [_go(), "install", f"go.opentelemetry.io/collector/cmd/builder@{BUILDER_VERSION}"],
        cwd=target_dir,
        log=target_dir / "install.log",
        env=env,
    )
    return builder


def build_collector(manifest: Path = COLLECTOR_MANIFEST, bin_root: Path | None = None) -> Path:
    """Build otelcol from the manifest with ocb, or reuse the cached binary."""
    bin_root = bin_root or cache_dir() / "bin"
    out_dir = bin_root / f"otelcol-{manifest_key(manifest)}"
    binary = out_dir / "otelcol"
    if binary.exists():
        return binary
    with _lock(bin_root / ".otelcol.lock"):
        if binary.exists():
            return binary
        builder = _ensure_builder(bin_root)
        build_dir = out_dir / "build"
        src = build_dir / "src"
        build_dir.mkdir(parents=True, exist_ok=True)
        text = re.sub(r"^(\s+output_path:).*$", rf"\g<1> {src}", _read_stack_file(manifest), count=1, flags=re.M)
        cfg = build_dir / "builder-config.yaml"
        cfg.write_text(text)
        log = build_dir / "build.log"
        _log(f"building otelcol with ocb {BUILDER_VERSION} (several minutes; log: {log})")
        start = time.monotonic()
        _run_logged([str(builder), "--config", str(cfg)], cwd=build_dir, log=log, env=_go_env())
        built = src / "otelcol"
        if not built.exists():
            raise StackError(f"ocb finished but {built} is missing; see {log}")
        os.replace(built, binary)
        _log(f"built {binary} in {time.monotonic() - start:.0f} s")
    return binary


def build_jaeger(bin_root: Path | None = None, version: str = JAEGER_VERSION) -> Path:
    """Build Jaeger v2 (``cmd/jaeger``) in a throwaway module, or reuse the cached binary."""
    bin_root = bin_root or cache_dir() / "bin"
    out_dir = bin_root / f"jaeger-{version.lstrip('v')}"
    binary = out_dir / "jaeger"
    if binary.exists():
        return binary
    with _lock(bin_root / ".jaeger.lock"):
        if binary.exists():
            return binary
        mod = out_dir / "mod"
        mod.mkdir(parents=True, exist_ok=True)
        log = out_dir / "build.log"
        env = _go_env()
        go = _go()
        _log(f"building jaeger {version} (several minutes; log: {log})")
        start = time.monotonic()
        if not (mod / "go.mod").exists():
            _run_logged([go, "mod", "init", "x"], cwd=mod, log=log, env=env)
        _run_logged([go, "get", "-tool", f"{JAEGER_MODULE}/cmd/jaeger@{version}"], cwd=mod, log=log, env=env)
        tmp = out_dir / "jaeger.tmp"
        _run_logged(
            [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(tmp), f"{JAEGER_MODULE}/cmd/jaeger"],
            cwd=mod,
            log=log,
            env=env,
        )
        os.replace(tmp, binary)
        _log(f"built {binary} in {time.monotonic() - start:.0f} s")
    return binary


def fetch_zipkin(bin_root: Path | None = None, version: str = ZIPKIN_VERSION) -> Path:
    """Zipkin's executable jar from Maven Central (by its coordinates, checked against the
    repository's SHA-1), or the cached one.  Plain HTTPS: no Maven needed."""
    bin_root = bin_root or cache_dir() / "bin"
    out_dir = bin_root / f"zipkin-{version}"
    jar = out_dir / f"zipkin-server-{version}-exec.jar"
    if jar.exists():
        return jar
    with _lock(bin_root / ".zipkin.lock"):
        if jar.exists():
            return jar
        out_dir.mkdir(parents=True, exist_ok=True)
        group, artifact = ZIPKIN_ARTIFACT.split(":")
        url = f"{MAVEN_CENTRAL}/{group.replace('.', '/')}/{artifact}/{version}/{jar.name}"
        _log(f"fetching {ZIPKIN_ARTIFACT}:{version} (exec jar, ~130 MB) from {url}")
        start = time.monotonic()
        tmp = out_dir / (jar.name + ".download")
        digest = hashlib.sha1()  # Maven Central publishes SHA-1 checksums
        try:
            with urllib.request.urlopen(url + ".sha1", timeout=60) as response:
                expected = response.read().decode().split()[0].strip().lower()
            with urllib.request.urlopen(url, timeout=60) as response, tmp.open("wb") as out:
                while chunk := response.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (OSError, ValueError) as err:
            tmp.unlink(missing_ok=True)
            raise StackError(f"cannot fetch {url}: {err}") from err
        if digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise StackError(f"{url}: SHA-1 {digest.hexdigest()}, Maven Central says {expected}")
        os.replace(tmp, jar)
        _log(f"fetched {jar} in {time.monotonic() - start:.0f} s")
    return jar


def find_java() -> Path:
    """The ``java`` Zipkin runs with (17 or newer)."""
    found = shutil.which("java")
    if not found:
        raise StackError("`java` (17 or newer) is needed to run Zipkin: install Debian's default-jre-headless")
    return Path(os.path.realpath(found))


def find_prometheus(install: bool = True) -> Path:
    """Debian's prometheus; installed with apt-get when missing and running as root."""
    found = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if found:
        return Path(found)
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        _log("installing prometheus with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "prometheus"]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise StackError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        if Path("/usr/bin/prometheus").exists():
            return Path("/usr/bin/prometheus")
    raise StackError(
        "prometheus not found: install Debian's package (`sudo apt-get install -y prometheus`) "
        "or put a prometheus binary on PATH"
    )


def config_files() -> dict[str, Path]:
    """The files the stack and an agent run with, where this installation has them."""
    return {
        "collector-config": COLLECTOR_CONFIG,
        "jaeger-config": JAEGER_CONFIG,
        "agent-config": AGENT_CONFIG,
        "manifest": COLLECTOR_MANIFEST,
    }


def ensure_light_binaries() -> dict[str, Path]:
    """What ``up --light`` runs: Zipkin's jar (fetched once) and ``java``; ``{"zipkin", "java"}``."""
    return {"zipkin": fetch_zipkin(), "java": find_java()}


def ensure_binaries() -> dict[str, Path]:
    """Build or reuse otelcol and jaeger, fetch or reuse Zipkin's jar, find java and prometheus;
    ``{"collector", "jaeger", "zipkin", "java", "prometheus"}``."""
    return {
        "collector": build_collector(),
        "jaeger": build_jaeger(),
        "zipkin": fetch_zipkin(),
        "java": find_java(),
        "prometheus": find_prometheus(),
    }


# --------------------------------------------------------------------------- ports


_P = TypeVar("_P", bound="_PortSet")


class _PortSet:
    """Shared by the port dataclasses: free ports for tests, (de)serialization."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # subclasses are dataclasses

    @classmethod
    def free(cls: type[_P]) -> _P:
        """Ports the kernel reports free right now (for tests)."""
        socks = []
        try:
            values = []
            for _ in dataclasses.fields(cls):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((HOST, 0))
                socks.append(s)
                values.append(s.getsockname()[1])
        finally:
            for s in socks:
                s.close()
        return cls(*values)

    @classmethod
    def from_dict(cls: type[_P], data: Mapping[str, int]) -> _P:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in data.items() if k in names})

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Ports(_PortSet):
    """Every port the stack listens on (all on 127.0.0.1)."""

    otlp_grpc: int = 4317
    otlp_http: int = 4318
    prom_exporter: int = 8889
    collector_health: int = 13133
    jaeger_otlp_grpc: int = 14317
    jaeger_otlp_http: int = 14318
    jaeger_ui: int = 16686
    jaeger_grpc: int = 16685
    jaeger_health: int = 13134
    zipkin: int = 9411
    trace_ui_relay: int = 9412
    prometheus: int = 9090


@dataclasses.dataclass
class AgentPorts(_PortSet):
    """Ports of a node agent that shares its host with the stack (the gateway): the production
    defaults of ``deploy/collector/agent.yaml`` (4317, 4318, 13133, 8888) plus 20000."""

    otlp_grpc: int = 24317
    otlp_http: int = 24318
    health: int = 33133
    metrics: int = 28888


# --------------------------------------------------------------------------- stack


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child counts as gone
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _pid_runs(pid: int, binary: str) -> bool:
    """The pid is alive and still runs ``binary`` (guards against a recycled pid)."""
    if not _pid_alive(pid):
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return True  # cannot tell; trust the pid file
    return Path(exe.removesuffix(" (deleted)")).name == Path(binary).name


def _spawn(cmd: Sequence[str], cwd: Path, env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a program in its own session, stdout and stderr appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _python() -> str:
    """This interpreter's real path (what ``/proc/<pid>/exe`` of the relay will show)."""
    return os.path.realpath(sys.executable)


def _log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_healthy(name: str, url: str, proc: subprocess.Popen[bytes], timeout: float, log_path: Path) -> None:
    """Poll ``url`` until it answers 200; fail early when ``proc`` exits, with the log's tail."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"{name} exited with {proc.returncode}:\n{_log_tail(log_path)}")
        try:
            status, _ = _http_get(url, timeout=1.0)
            if status == 200:
                return
            last = f"HTTP {status}"
        except OSError as err:
            last = str(err)
        time.sleep(0.1)
    raise StackError(f"{name} not healthy at {url} after {timeout:.0f} s ({last}):\n{_log_tail(log_path)}")


class _OtlpReceiver:
    """The OTLP endpoints of a collector (the stack's, or a node agent's) for clients on this host."""

    ports: Any  # Ports or AgentPorts: both have otlp_http and otlp_grpc

    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://{HOST}:{self.ports.otlp_http}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://{HOST}:{self.ports.otlp_grpc}"


class Stack(_OtlpReceiver):
    """The programs, started as subprocesses with logs and pid files in ``workdir``.

    ``light``: only Zipkin and the relay, which then takes OTLP/HTTP from the library on
    ``ports.otlp_http`` itself (traces to Zipkin; metrics and logs are answered and dropped).

    >>> with Stack(tmp_path, Ports.free()) as stack:
    ...     print(stack.prometheus_url, stack.jaeger_url)
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        ports: Ports | Mapping[str, int] | None = None,
        *,
        binaries: Mapping[str, Path] | None = None,
        collector_config: str | os.PathLike[str] = COLLECTOR_CONFIG,
        jaeger_config: str | os.PathLike[str] = JAEGER_CONFIG,
        scrape_interval: str = "1s",
        spanmetrics_flush: str = "5s",
        startup_timeout: float = 60.0,
        collector_host: str = HOST,
        light: bool = False,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.light = light
        self.programs = LIGHT_PROCESS_NAMES if light else PROCESS_NAMES
        if ports is None:
            ports = Ports()
        elif not isinstance(ports, Ports):
            ports = Ports.from_dict(ports)
        self.ports = ports
        self.binaries = dict(binaries) if binaries else None
        self.collector_config = Path(collector_config)
        self.jaeger_config = Path(jaeger_config)
        self.scrape_interval = scrape_interval
        self.spanmetrics_flush = spanmetrics_flush
        self.startup_timeout = startup_timeout
        # "0.0.0.0" makes the collector a gateway that node agents on other hosts reach; Jaeger
        # and Prometheus stay on loopback. (The stack itself still talks to it on 127.0.0.1.)
        self.collector_host = collector_host
        self.targets_dir = self.workdir / "scrape-targets"
        self.log_dir = self.workdir / "logs"
        self.pid_dir = self.workdir / "pids"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started_binaries: dict[str, Path] = {}

    # ---------------------------------------------------------------- endpoints

    @property
    def gateway_endpoint(self) -> str:
        """``host:port`` of the collector's OTLP/gRPC receiver, what a node agent forwards to."""
        return f"{HOST}:{self.ports.otlp_grpc}"

    @property
    def jaeger_url(self) -> str:
        return f"http://{HOST}:{self.ports.jaeger_ui}"

    @property
    def trace_ui_url(self) -> str:
        """Zipkin's UI: the stack's trace waterfall in a browser."""
        return f"http://{HOST}:{self.ports.zipkin}/zipkin/"

    @property
    def prometheus_url(self) -> str:
        return f"http://{HOST}:{self.ports.prometheus}"

    @property
    def prom_exporter_url(self) -> str:
        return f"http://{HOST}:{self.ports.prom_exporter}/metrics"

    @property
    def relay_port(self) -> int:
        """Where the trace UI's relay listens: the OTLP/HTTP port itself in a light stack."""
        return self.ports.otlp_http if self.light else self.ports.trace_ui_relay

    def endpoints(self) -> dict[str, str]:
        if self.light:
            return {
                "otlp_http": self.otlp_http_endpoint + "  (traces; metrics and logs are dropped)",
                "trace_ui": self.trace_ui_url,
            }
        return {
            "otlp_http": self.otlp_http_endpoint,
            "otlp_grpc": self.otlp_grpc_endpoint,
            "trace_ui": self.trace_ui_url,
            "jaeger_api": f"{self.jaeger_url}/api/traces?service=<service.name>  (its UI page is a placeholder)",
            "prometheus": self.prometheus_url,
            "collector_prometheus_exporter": self.prom_exporter_url,
            "collector_health": f"http://{HOST}:{self.ports.collector_health}/",
            "scrape_targets_dir": str(self.targets_dir),
        }

    def client_env(self) -> dict[str, str]:
        """Environment variables that point an OTel SDK (and otel_tracking) at this stack."""
        if self.light:
            return {
                "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_http_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_TRACKING_TRACES_URL": self.trace_ui_url,
            }
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_http_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_TRACKING_SCRAPE_TARGETS_DIR": str(self.targets_dir),
            # gauges every second (the SDK's default is 60 s): Prometheus, scraping every second, shows curves
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            # the run's summary and the demo print a link to the run's traces in the trace UI
            "OTEL_TRACKING_TRACES_URL": self.trace_ui_url,
        }

    def _program_env(self) -> dict[str, str]:
        env = dict(os.environ)
        p = self.ports
        env.update(
            {
                "OTEL_TRACKING_HOST": HOST,
                "OTEL_TRACKING_OTLP_HOST": HOST,
                "OTEL_TRACKING_OTLP_GRPC_PORT": str(p.otlp_grpc),
                "OTEL_TRACKING_OTLP_HTTP_PORT": str(p.otlp_http),
                "OTEL_TRACKING_PROM_EXPORTER_PORT": str(p.prom_exporter),
                "OTEL_TRACKING_HEALTH_PORT": str(p.collector_health),
                "OTEL_TRACKING_JAEGER_OTLP_ENDPOINT": f"{HOST}:{p.jaeger_otlp_grpc}",
                "OTEL_TRACKING_SCRAPE_TARGETS_DIR": str(self.targets_dir),
                "OTEL_TRACKING_SCRAPE_INTERVAL": self.scrape_interval,
                "OTEL_TRACKING_SPANMETRICS_FLUSH": self.spanmetrics_flush,
                "OTEL_TRACKING_JAEGER_OTLP_GRPC_PORT": str(p.jaeger_otlp_grpc),
                "OTEL_TRACKING_JAEGER_OTLP_HTTP_PORT": str(p.jaeger_otlp_http),
                "OTEL_TRACKING_JAEGER_UI_PORT": str(p.jaeger_ui),
                "OTEL_TRACKING_JAEGER_GRPC_PORT": str(p.jaeger_grpc),
                "OTEL_TRACKING_JAEGER_HEALTH_PORT": str(p.jaeger_health),
                "OTEL_TRACKING_TRACE_UI_ENDPOINT": f"http://{HOST}:{p.trace_ui_relay}",
            }
        )
        return env

    def program_env(self, name: str) -> dict[str, str]:
        """The environment ``name`` runs with: the collector listens on ``collector_host``."""
        env = self._program_env()
        if name == "collector":  # only its OTLP receivers face the cluster network in gateway mode
            env["OTEL_TRACKING_OTLP_HOST"] = self.collector_host
        if name == "zipkin":
            env.update({"STORAGE_TYPE": "mem", "MEM_MAX_SPANS": ZIPKIN_MAX_SPANS, "SELF_TRACING_ENABLED": "false"})
        return env

    def _prometheus_config(self) -> Path:
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(
            "# generated by otel_tracking_stack\n"
            "global:\n"
            f"  scrape_interval: {self.scrape_interval}\n"
            f"  evaluation_interval: {self.scrape_interval}\n"
            "rule_files:\n"
            f"  - '{STALL_RULES}'\n"
            "scrape_configs:\n"
            "  - job_name: otel-collector\n"
            "    # keep job/instance as the collector exports them (job = service.name)\n"
            "    honor_labels: true\n"
            "    static_configs:\n"
            f"      - targets: ['{HOST}:{self.ports.prom_exporter}']\n"
        )
        return cfg

    def _command(self, name: str, binaries: Mapping[str, Path]) -> list[str]:
        if name == "jaeger":
            return [str(binaries["jaeger"]), "--config", str(self.jaeger_config)]
        if name == "collector":
            return [str(binaries["collector"]), "--config", str(self.collector_config)]
        if name == "prometheus":
            return [
                str(binaries["prometheus"]),
                f"--config.file={self._prometheus_config()}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                "--storage.tsdb.retention.time=2d",
                f"--web.listen-address={HOST}:{self.ports.prometheus}",
            ]
        return {
            "zipkin": [
                str(binaries["java"]), f"-Xmx{ZIPKIN_HEAP}", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                "-jar", str(binaries["zipkin"]),
                # Zipkin ignores --server.address; Armeria's own port setting binds it to loopback
                f"--armeria.ports[0].port={self.ports.zipkin}", f"--armeria.ports[0].ip={HOST}",
                "--armeria.ports[0].protocols=http",
            ],
            "trace_ui_relay": [
                sys.executable, "-m", "otel_tracking_stack.zipkin_relay",
                "--host", HOST, "--port", str(self.relay_port), "--zipkin", f"http://{HOST}:{self.ports.zipkin}",
            ],
        }[name]

    def _health_urls(self) -> dict[str, str]:
        return {
            "jaeger": f"{self.jaeger_url}/",
            "collector": f"http://{HOST}:{self.ports.collector_health}/",
            "prometheus": f"{self.prometheus_url}/-/ready",
            "zipkin": f"http://{HOST}:{self.ports.zipkin}/health",
            "trace_ui_relay": f"http://{HOST}:{self.relay_port}/health",
        }

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Stack:
        """Start Zipkin, Jaeger, the relay, the collector and Prometheus (a light stack: Zipkin and
        the relay); wait until each is healthy (Zipkin last: its JVM starts while the others do)."""
        for name in self.programs:
            pid = self._read_pid(name)
            if pid is not None and _pid_alive(pid):
                raise StackError(f"{name} already runs from {self.workdir} (pid {pid})")
        for path in () if self.light else (self.collector_config, self.jaeger_config):
            if not path.exists():
                raise StackError(f"config file missing: {path}")
        binaries = self.binaries or (ensure_light_binaries() if self.light else ensure_binaries())
        for d in (self.workdir, self.targets_dir, self.log_dir, self.pid_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.workdir / "stack.json").write_text(
            json.dumps(
                {
                    "ports": self.ports.as_dict(),
                    "binaries": {k: str(v) for k, v in binaries.items()},
                    "light": self.light,
                },
                indent=2,
            )
        )
        self._started_binaries = dict(binaries)
        try:
            for name in self.programs:
                self.start_program(name, wait=name != "zipkin")
            self._wait_program("zipkin")
        except BaseException:
            self.stop()
            raise
        return self

    def start_program(self, name: str, wait: bool = True) -> None:
        """Start one of the programs of a started stack (again, on the same ports) and wait until
        it is healthy; with ``stop_program``, e.g. a gateway outage in a test."""
        if not self._started_binaries:
            raise StackError("start() the stack first")
        env = self.program_env(name)
        proc = _spawn(self._command(name, self._started_binaries), self.workdir, env, self.log_dir / f"{name}.log")
        self._procs[name] = proc
        (self.pid_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
        if wait:
            self._wait_program(name)

    def _wait_program(self, name: str) -> None:
        log = self.log_dir / f"{name}.log"
        _wait_healthy(name, self._health_urls()[name], self._procs[name], self.startup_timeout, log)

    def log_tail(self, name: str, lines: int = 30) -> str:
        return _log_tail(self.log_dir / f"{name}.log", lines)

    def _read_pid(self, name: str) -> int | None:
        try:
            return int((self.pid_dir / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _binary_names(self) -> dict[str, str]:
        try:
            data = json.loads((self.workdir / "stack.json").read_text())
            names = {k: Path(v).name for k, v in data.get("binaries", {}).items()}
        except (OSError, ValueError):
            names = {"jaeger": "jaeger", "collector": "otelcol", "prometheus": "prometheus", "java": "java"}
        # the pid of each program runs this binary (Zipkin runs in java, the relay in Python)
        names["zipkin"] = names.get("java", "java")
        names["trace_ui_relay"] = Path(_python()).name
        return names

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM each program by pid, in the reverse of the start order, SIGKILL after ``timeout``."""
        for name in reversed(self.programs):
            self.stop_program(name, timeout)

    def stop_program(self, name: str, timeout: float = 10.0) -> None:
        """SIGTERM one program by pid, SIGKILL after ``timeout``; remove its pid file."""
        proc = self._procs.pop(name, None)
        pid = proc.pid if proc is not None else self._read_pid(name)
        if pid is not None and (proc is not None or _pid_runs(pid, self._binary_names().get(name, name))):
            self._terminate(pid, proc, timeout)
        with contextlib.suppress(OSError):
            (self.pid_dir / f"{name}.pid").unlink()

    @staticmethod
    def _terminate(pid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None:
                if proc.poll() is not None:
                    return
            elif not _pid_alive(pid):
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per program: pid, whether it runs, whether its health endpoint answers 200."""
        out: dict[str, dict[str, Any]] = {}
        health = self._health_urls()
        for name in self.programs:
            proc = self._procs.get(name)
            pid = proc.pid if proc is not None else self._read_pid(name)
            running = pid is not None and (proc.poll() is None if proc is not None else _pid_alive(pid))
            healthy = False
            if running:
                with contextlib.suppress(OSError):
                    healthy = _http_get(health[name], timeout=1.0)[0] == 200
            out[name] = {"pid": pid, "running": running, "healthy": healthy, "health_url": health[name]}
        return out

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- helpers

    def write_scrape_target(
        self, job_name: str, addresses: Sequence[str], labels: Mapping[str, str] | None = None
    ) -> Path:
        """Register Prometheus endpoints (``host:port``) for the collector to scrape: a file_sd file
        in the targets directory (what ``RLInsightLogger.register_metrics`` writes too), picked up
        within the receiver's refresh interval.  ``job_name`` becomes the ``job`` label."""
        from otel_tracking.distributed.targets import scrape_targets, write_targets_file

        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        groups = scrape_targets(addresses, job_name, [dict(labels or {})] * len(addresses))
        return write_targets_file(self.targets_dir, job_name, groups)

    def remove_scrape_target(self, job_name: str) -> None:
        from otel_tracking.distributed.targets import remove_targets_files

        remove_targets_files(self.targets_dir, job_name)


# --------------------------------------------------------------------------- node agent


class Agent(_OtlpReceiver):
    """A node agent: ``otelcol --config deploy/collector/agent.yaml``, forwarding everything it
    receives to a gateway (``Stack``'s collector, or any OTLP/gRPC endpoint) through a retrying,
    bounded in-memory queue. Log and pid file in ``workdir`` (``logs/agent.log``, ``pids/agent.pid``).

    >>> with Stack(tmp_path / "gw", Ports.free()) as stack:
    ...     with Agent(tmp_path / "agent", stack.gateway_endpoint, AgentPorts.free()) as agent:
    ...         env = agent.client_env()  # what the processes on this node export
    """

    name = "agent"

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        gateway_endpoint: str,
        ports: AgentPorts | Mapping[str, int] | None = None,
        *,
        binary: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] = AGENT_CONFIG,
        node_name: str | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        if ports is None:
            ports = AgentPorts()
        elif not isinstance(ports, AgentPorts):
            ports = AgentPorts.from_dict(ports)
        self.ports = ports
        self.gateway_endpoint = gateway_endpoint
        self.binary = Path(binary) if binary else None
        self.config = Path(config)
        self.node_name = node_name or socket.gethostname()
        self.startup_timeout = startup_timeout
        self.log_path = self.workdir / "logs" / f"{self.name}.log"
        self.pid_path = self.workdir / "pids" / f"{self.name}.pid"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def health_url(self) -> str:
        return f"http://{HOST}:{self.ports.health}/"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports.metrics}/metrics"

    def client_env(self) -> dict[str, str]:
        """What every process on the node exports to send its telemetry to this agent."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}

    def program_env(self) -> dict[str, str]:
        """The agent's own environment: the variables ``agent.yaml`` reads."""
        env = dict(os.environ)
        env.update(
            {
                "OTEL_TRACKING_AGENT_HOST": HOST,
                "OTEL_TRACKING_AGENT_OTLP_GRPC_PORT": str(self.ports.otlp_grpc),
                "OTEL_TRACKING_AGENT_OTLP_HTTP_PORT": str(self.ports.otlp_http),
                "OTEL_TRACKING_AGENT_HEALTH_PORT": str(self.ports.health),
                "OTEL_TRACKING_AGENT_METRICS_PORT": str(self.ports.metrics),
                "OTEL_TRACKING_GATEWAY_ENDPOINT": self.gateway_endpoint,
                "OTEL_TRACKING_NODE_NAME": self.node_name,
            }
        )
        return env

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._read_pid()

    def start(self) -> Agent:
        """Start the agent and wait until its health check answers."""
        pid = self._read_pid()
        if pid is not None and _pid_alive(pid):
            raise StackError(f"the agent already runs from {self.workdir} (pid {pid})")
        if not self.config.exists():
            raise StackError(f"config file missing: {self.config}")
        binary = self.binary or build_collector()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        self._proc = _spawn(
            [str(binary), "--config", str(self.config)], self.workdir, self.program_env(), self.log_path
        )
        self.pid_path.write_text(f"{self._proc.pid}\n")
        try:
            _wait_healthy(self.name, self.health_url, self._proc, self.startup_timeout, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by pid, SIGKILL after ``timeout``. A memory queue still holding data is lost."""
        proc, self._proc = self._proc, None
        pid = proc.pid if proc is not None else self._read_pid()
        binary_name = self.binary.name if self.binary else "otelcol"
        if pid is not None and (proc is not None or _pid_runs(pid, binary_name)):
            Stack._terminate(pid, proc, timeout)
        with contextlib.suppress(OSError):
            self.pid_path.unlink()

    def status(self) -> dict[str, Any]:
        pid = self.pid
        running = pid is not None and (self._proc.poll() is None if self._proc is not None else _pid_alive(pid))
        healthy = False
        if running:
            with contextlib.suppress(OSError):
                healthy = _http_get(self.health_url, timeout=1.0)[0] == 200
        return {"pid": pid, "running": running, "healthy": healthy, "health_url": self.health_url}

    def log_tail(self, lines: int = 30) -> str:
        return _log_tail(self.log_path, lines)

    def self_metrics(self) -> dict[str, float]:
        """The agent's own metrics, summed over labels: e.g. ``otelcol_exporter_queue_size``
        (bytes held for the gateway, queued or being retried), ``otelcol_exporter_sent_spans``,
        ``otelcol_exporter_send_failed_spans`` (given up), ``otelcol_receiver_accepted_spans``."""
        status, body = _http_get(self.metrics_url, timeout=2.0)
        if status != 200:
            raise StackError(f"GET {self.metrics_url}: HTTP {status}")
        totals: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI


def default_state_dir() -> Path:
    return cache_dir() / "stack"


def _load_stack(state_dir: Path) -> Stack:
    ports: Ports | None = None
    light = False
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads((state_dir / "stack.json").read_text())
        light = bool(saved.get("light", False))
        ports = Ports.from_dict(saved["ports"])
    return Stack(state_dir, ports, light=light)


def main(argv: list[str] | None = None) -> int:
    """``otel-tracking stack up|down|status``."""
    # --state-dir is accepted before or after the command (`otel-tracking stack up --state-dir D`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir", type=Path, default=argparse.SUPPRESS, help="default: ~/.cache/otel-tracking/stack"
    )
    parser = argparse.ArgumentParser(
        prog="otel-tracking stack",
        description="The local trace UI (Zipkin; up --light: nothing else) or the full stack: an OpenTelemetry "
        "Collector, Zipkin, Prometheus and Jaeger's API, on 127.0.0.1.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="build or reuse the binaries and start the stack detached")
    up.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each program")
    up.add_argument("--free-ports", action="store_true", help="pick free ports instead of the defaults")
    up.add_argument(
        "--gateway",
        action="store_true",
        help="the collector's OTLP receivers listen on all interfaces (0.0.0.0), for node agents on other "
        "hosts; its Prometheus exporter and health port, Jaeger, Zipkin and Prometheus stay on 127.0.0.1",
    )
    up.add_argument(
        "--light",
        action="store_true",
        help="only the trace UI: Zipkin (its jar fetched once from Maven Central; needs java 17+) with a relay "
        "that takes the library's OTLP/HTTP on 4318; nothing to build. Metrics and logs are dropped: the full "
        "stack keeps them in Prometheus",
    )
    sub.add_parser("down", parents=[common], help="stop the stack started by `up`")
    sub.add_parser(
        "build",
        parents=[common],
        help="build or reuse otelcol and jaeger, fetch Zipkin's jar, install prometheus; "
        "print the binaries' and config files' paths",
    )
    st = sub.add_parser("status", parents=[common], help="show what runs")
    st.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    state_dir: Path = (getattr(args, "state_dir", None) or default_state_dir()).expanduser().resolve()

    try:
        if args.command == "build":
            for name, path in ensure_binaries().items():
                print(f"{name:16s} {path}")
            for name, path in config_files().items():
                print(f"{name:16s} {path}")
            return 0
        if args.command == "up":
            existing = _load_stack(state_dir)
            if any(s["running"] for s in existing.status().values()):
                print(f"stack already running (state: {state_dir}); `down` first", file=sys.stderr)
                _print_status(existing)
                return 1
            stack = Stack(
                state_dir,
                Ports.free() if args.free_ports else Ports(),
                startup_timeout=args.timeout,
                collector_host="0.0.0.0" if args.gateway else HOST,
                light=args.light,
            )
            stack.start()
            print("otel-tracking stack is up" + (" (light: the trace UI only)" if args.light else ""))
            for key, value in stack.endpoints().items():
                print(f"  {key:30s} {value}")
            print(f"  {'logs':30s} {stack.log_dir}")
            print("\nexport these to send telemetry to it:")
            for key, value in stack.client_env().items():
                print(f"export {key}={value}")
            if args.gateway:
                print(f"\non every other node, run an agent ({AGENT_CONFIG}) with:")
                endpoint = f"{socket.gethostname()}:{stack.ports.otlp_grpc}"
                print(f"OTEL_TRACKING_GATEWAY_ENDPOINT={endpoint}   # this host as the other nodes reach it")
            return 0
        stack = _load_stack(state_dir)
        if args.command == "down":
            stack.stop()
            print("otel-tracking stack stopped")
            return 0
        if args.command == "status":
            if args.json:
                print(json.dumps(stack.status(), indent=2))
            else:
                _print_status(stack)
            return 0 if all(s["healthy"] for s in stack.status().values()) else 3
    except StackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 2


def _print_status(stack: Stack) -> None:
    status = stack.status()
    for name, s in status.items():
        state = "healthy" if s["healthy"] else ("running" if s["running"] else "stopped")
        pid = s["pid"] if s["pid"] is not None else "-"
        print(f"  {name:14s} {state:8s} pid {pid!s:8s} {s['health_url']}")
    if status["zipkin"]["healthy"]:
        print(f"\n  trace UI       {stack.trace_ui_url}")
        if not stack.light:
            print(f"  Jaeger API     {stack.jaeger_url}/api/traces?service=<service.name>")
            print(f"  Prometheus     {stack.prometheus_url}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
