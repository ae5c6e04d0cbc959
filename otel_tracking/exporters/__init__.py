"""Bridges from OpenTelemetry data into ML trackers and local sinks; one module per backend."""
