"""The otel-tracking command: demo, replay, stack (loaded on demand). Imports everything below."""
