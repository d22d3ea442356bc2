"""Per-tenant request rate limit: a token bucket per tenant.

A tenant may make ``per_minute`` requests a minute, in bursts of up to a tenth of that (at least
one). Past it, the request is refused with a ``RateLimitedError`` saying when the next one
would pass, which the server answers with 429 and ``Retry-After``.

>>> now = [0.0]
>>> limiter = RateLimiter(per_minute=60, clock=lambda: now[0])  # one a second, bursts of 6
>>> for _ in range(6):
...     limiter.acquire('alice')
>>> try:
...     limiter.acquire('alice')
... except RateLimitedError as e:
...     print(f'{e.retry_after_s:.1f} s')
1.0 s
>>> now[0] = 1.0
>>> limiter.acquire('alice')
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from twinkle.errors import RateLimitedError


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """Token buckets keyed by tenant; thread-safe."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self.rate = per_minute / 60.0
        self.burst = max(1.0, per_minute / 10.0)
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def acquire(self, tenant: str, tenant_name: str | None = None) -> None:
        """Take one request from ``tenant``'s bucket, or raise ``RateLimitedError``."""
        with self._lock:
            now = self._clock()
            bucket = self._buckets.setdefault(tenant, _Bucket(self.burst, now))
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                raise RateLimitedError(tenant_name or tenant, self.per_minute, (1.0 - bucket.tokens) / self.rate)
            bucket.tokens -= 1.0
