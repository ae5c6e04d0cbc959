"""Trace and span ids from the operating system's random source.

The SDK's default generator draws ids from the global ``random`` module, which training code
seeds for reproducibility (``random.seed(seed)`` in every worker): two workers, or two runs,
seeded alike then produce identical trace and span ids, and their spans overwrite each other in
Jaeger.  Ids here come from ``os.urandom``, read 64 KiB at a time (one system call per 8192 span ids
instead of one per id) and never shared across ``fork()``: a child drops the bytes its parent
had read ahead.
"""

from __future__ import annotations

import os
import threading

from opentelemetry.sdk.trace.id_generator import IdGenerator

_PAGE = 65536  # 8192 span ids per read: each read may wait for the GIL behind an exporting thread


class UrandomIdGenerator(IdGenerator):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer = b""
        self._offset = 0

    def _bytes(self, n: int) -> int:
        with self._lock:
            if self._offset + n > len(self._buffer):
                self._buffer, self._offset = os.urandom(_PAGE), 0
            chunk = self._buffer[self._offset : self._offset + n]
            self._offset += n
        return int.from_bytes(chunk, "big")

    def _forget(self) -> None:
        self._lock = threading.Lock()  # a lock held by another thread at fork() would never be released
        self._buffer, self._offset = b"", 0

    def generate_span_id(self) -> int:
        while True:
            span_id = self._bytes(8)
            if span_id:
                return span_id

    def generate_trace_id(self) -> int:
        while True:
            trace_id = self._bytes(16)
            if trace_id:
                return trace_id

    def is_trace_id_random(self) -> bool:
        return True


ID_GENERATOR = UrandomIdGenerator()
os.register_at_fork(after_in_child=ID_GENERATOR._forget)
