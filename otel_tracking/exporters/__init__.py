"""OpenTelemetry exporters into ML trackers and local sinks; one module per backend."""
