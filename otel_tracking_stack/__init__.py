"""Development tooling beside the runtime package: the local OpenTelemetry Collector, Jaeger and
Prometheus (``otel-tracking stack``), built from pinned sources and run on loopback.  See ``stack.py``."""
