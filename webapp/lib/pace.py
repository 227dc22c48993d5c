"""A token bucket that makes a sender wait rather than lose anything: back-pressure for one agent's events."""

from __future__ import annotations

import asyncio
import time


class Pace:
    """At most `rate` units per second on average, in bursts of at most `burst`; `take` waits for its turn."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, time.monotonic()

    def delay(self, units: float) -> float:
        """Take `units` now; how long to wait before what they pay for may go ahead (0 within the budget)."""
        t = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (t - self.at) * self.rate) - units
        self.at = t
        return max(0.0, -self.tokens / self.rate)

    async def take(self, units: float) -> None:
        wait = self.delay(units)
        if wait > 0:
            await asyncio.sleep(wait)
