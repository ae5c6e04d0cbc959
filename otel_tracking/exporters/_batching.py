"""Packing points of several steps into a tracker's bulk requests, within its API limits, and
sending them in a few ordered lanes at once.

A *point* is ``(index of its step in the group, key as logged, what the backend takes)``.  Every
key always goes to the same lane (by a hash of the key), each lane sends its requests one after
the other, in step order, and stops at its first failure; lanes run side by side.  So a key's
points reach the backend in step order even with several requests in flight and a request failing
mid-group, and what did not land is known point by point: the caller retries (or spools) exactly
that, never a point that landed.

    steps 1..5 of 200 keys --> lane 0: keys with hash 0 --> [req 1000 pts] -> [req ...]   (in order)
                          \\-> lane 1: keys with hash 1 --> [req 1000 pts] -> [req ...]   (beside it)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

Point = tuple[int, str, Any]


@dataclass(frozen=True)
class Limits:
    """One request's limits: points, and bytes as ``size`` estimates them."""

    points: int
    bytes: int


def lanes(points: Sequence[Point], count: int) -> list[list[Point]]:
    """The points split into ``count`` lanes by key, each lane in the points' order."""
    split: list[list[Point]] = [[] for _ in range(max(1, count))]
    if len(split) == 1:
        split[0].extend(points)
        return split
    for point in points:
        split[zlib.crc32(point[1].encode("utf-8", "surrogatepass")) % len(split)].append(point)
    return split


def requests(points: Sequence[Point], limits: Limits, size: Callable[[Point], int]) -> list[list[Point]]:
    """The points, in order, cut into requests of at most ``limits`` (a point bigger than the byte
    limit goes alone: the backend says what it makes of it)."""
    out: list[list[Point]] = []
    current: list[Point] = []
    used = 0
    for point in points:
        cost = size(point)
        if current and (len(current) >= limits.points or used + cost > limits.bytes):
            out.append(current)
            current, used = [], 0
        current.append(point)
        used += cost
    if current:
        out.append(current)
    return out


def send_in_lanes(
    points: Sequence[Point],
    lane_count: int,
    limits: Limits,
    size: Callable[[Point], int],
    send: Callable[[list[Point]], list[Point]],
    pool: Executor | None,
    landed: Callable[[], None] = lambda: None,
) -> list[Point]:
    """Send every point; the points that did not land.  ``send(request)`` returns the points of
    that request that did not land (all of them when the backend failed); a lane stops at the
    first request that did not fully land, and the rest of that lane did not land either.  Lane 0
    runs on the calling thread, the others on ``pool`` (one lane when there is none).  ``landed()``
    is called after each request that landed whole (progress, for a caller waiting on a slow
    backend)."""

    def run(lane: list[Point]) -> list[Point]:
        batches = requests(lane, limits, size)
        for index, batch in enumerate(batches):
            try:
                missing = send(batch)
            except Exception:  # send should say what failed, not raise: then nothing of it landed
                missing = list(batch)
            if missing:
                return missing + [point for later in batches[index + 1 :] for point in later]
            landed()
        return []

    split = lanes(points, lane_count if pool is not None else 1)
    futures = [pool.submit(run, lane) for lane in split[1:] if lane] if pool is not None else []
    missing = run(split[0])
    for future in futures:
        missing += future.result()
    return missing


__all__ = ["Limits", "Point", "lanes", "requests", "send_in_lanes"]
