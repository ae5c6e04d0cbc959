"""Packing points of several steps into a tracker's bulk requests, within its API limits, and
sending them in a few ordered lanes at once.

A *point* is ``(index of its step in the group, key as logged, what the backend takes)``.  All of
a key's points in a group go to one lane (the lanes balanced by points), each lane sends its
requests one after the other, key by key (each key's points in the order logged), and stops at its
first failure; lanes run side by side.  So a key's points reach the backend in the order logged
even with several requests in flight and a request failing mid-group, and what did not land is
known point by point: the caller retries (or spools) exactly that, never a point that landed.
Groups go one after the other (from the sink queue's one thread), so a key may change lanes between them.

    20 steps of 200 keys --> lane 0: 50 keys --> [req: 1,000 points]   (in order)
                        \\-> lane 1: 50 keys --> [req: 1,000 points]   (beside it)
"""

from __future__ import annotations

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
    """The points split into ``count`` lanes of about as many points each: every key's points in
    one lane, in the order given, and a lane's points grouped by key (the keys with most points
    placed first, each in the lane with fewest points so far).  Grouped, a request holds as few keys
    as it can: MLflow's server reads and updates a latest-value row for each key of a request."""
    by_key: dict[str, list[Point]] = {}
    for point in points:
        by_key.setdefault(point[1], []).append(point)
    split: list[list[Point]] = [[] for _ in range(max(1, count))]
    sizes = [0] * len(split)
    for key in sorted(by_key, key=lambda k: -len(by_key[k])):  # stable: ties in the order first seen
        lane = sizes.index(min(sizes))
        split[lane].extend(by_key[key])
        sizes[lane] += len(by_key[key])
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
