"""Wall-clock timing of trainer phases. Device work is queued asynchronously on GPUs/NPUs, so the clock is read only
after ``get_platform().synchronize()``; otherwise a phase would be charged for its predecessor's kernels."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import psutil

from megatron_dapo.platform import Platform, get_platform


class Timer:
    """Start/stop timer; ``elapsed`` is the sum of all start→stop intervals in seconds. ``platform`` defaults to the
    process's platform (``get_platform()``, looked up when the clock is read)."""

    def __init__(self, name: str = "", platform: Optional[Platform] = None) -> None:
        self.name = name
        self.elapsed = 0.0
        self._start: Optional[float] = None
        self._platform = platform

    def _sync(self) -> None:
        (self._platform or get_platform()).synchronize()

    def start(self) -> Timer:
        if self._start is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._sync()
        self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        """Stop and return the length of this interval."""
        if self._start is None:
            raise RuntimeError(f"timer {self.name!r} was stopped without being started")
        self._sync()
        interval = time.perf_counter() - self._start
        self._start = None
        self.elapsed += interval
        return interval

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def timed(name: str, timings: dict[str, float], platform: Optional[Platform] = None) -> Iterator[None]:
    """Add the block's duration to ``timings[name]`` (accumulating, as verl's timer does: a phase that runs several
    times in one step, e.g. generation with dynamic sampling, reports its total). Recorded also when the block
    raises, so a failing phase still shows how long it ran."""
    timer = Timer(name, platform).start()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + timer.stop()


def process_age_s() -> float:
    """Seconds since this process was launched (its creation time, as the OS reports it): the start-up clock that
    includes the interpreter's start and the imports, which no timer inside the process can see."""
    return max(0.0, time.time() - psutil.Process().create_time())


class StartupClock:
    """A process's start-up times, ``timing_s/startup/<part>``, reported once (``pop``, with the first step):
    ``imports`` is launch → the clock's creation (the interpreter and the imports); each ``mark(part)`` the host
    time since the previous mark; ``mark_total`` sets ``startup``, launch → now (the first step)."""

    def __init__(self) -> None:
        self.times = {"startup/imports": process_age_s()}
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.times[f"startup/{part}"] = now - self._last
        self._last = now

    def mark_total(self) -> None:
        self.times["startup"] = process_age_s()

    def pop(self) -> dict[str, float]:
        """The times not reported yet ({} once reported)."""
        times, self.times = self.times, {}
        return times
