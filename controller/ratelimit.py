"""A token bucket: how the launcher sessions cap the messages each launcher may send, and how
a launcher paces its writes to stay under that cap (`wait`)."""

from __future__ import annotations


class TokenBucket:
    """At most `rate` events per second on average, `burst` at once. The clock is passed
    in, so tests need no sleeping."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated_at = now

    def allow(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.updated_at) * self.rate)
        self.updated_at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait(self, now: float) -> float:
        """Take a token, owing it if none is left: the seconds to wait before using it."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated_at) * self.rate) - 1.0
        self.updated_at = now
        return max(0.0, -self.tokens / self.rate)
