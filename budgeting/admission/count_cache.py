"""Adapters that plug the pure ladder into this deployment: the Redis count cache and tokenizer loading."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import cast

import redis
from django.conf import settings


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(str(settings.REDIS_URL), socket_timeout=2, socket_connect_timeout=2)


class RedisCountCache:
    """Per-segment token counts in Redis. Keys carry the tokenizer digest and template revision (the ladder
    builds them), so a count made under an old tokenizer or template is never read back."""

    def __init__(self, client: redis.Redis | None = None, ttl_seconds: int | None = None) -> None:
        self.client = client or redis_client()
        self.ttl = ttl_seconds or settings.COUNT_CACHE_TTL_SECONDS

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        if not keys:
            return []
        values = cast(list[bytes | None], self.client.mget(list(keys)))
        return [None if v is None else int(v) for v in values]

    def set_many(self, mapping: Mapping[str, int]) -> None:
        if not mapping:
            return
        pipe = self.client.pipeline(transaction=False)
        for key, value in mapping.items():
            pipe.set(key, value, ex=self.ttl)
        pipe.execute()

    def clear_prefix(self, prefix: str) -> int:
        """Delete every cached count whose key starts with ``prefix``; returns how many."""
        deleted = 0
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += cast(int, self.client.delete(*batch))
                batch.clear()
        if batch:
            deleted += cast(int, self.client.delete(*batch))
        return deleted
