"""Adapters that plug the pure ladder into this deployment: the Redis count cache and tokenizer loading."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import cast

import redis
from django.conf import settings

from ladder.counting import TextCounts

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(str(settings.REDIS_URL), socket_timeout=2, socket_connect_timeout=2)


# While Redis is unreachable the cache is skipped for this long, so admissions do not each wait on a timeout.
SKIP_AFTER_FAILURE_SECONDS = 5.0
_skip_until = 0.0
# Whether a write may skip its reply (RedisCountCache.set_many); off for good once a read was out of step.
_reply_skip = True


def _redis_failed(exc: redis.RedisError) -> None:
    global _skip_until
    if time.monotonic() >= _skip_until:
        logger.warning("count cache: Redis unavailable, counting without it: %s", exc)
    _skip_until = time.monotonic() + SKIP_AFTER_FAILURE_SECONDS


class RedisCountCache:
    """Per-segment token counts in Redis. Keys carry the tokenizer digest and template revision (the ladder
    builds them), so a count made under an old tokenizer or template is never read back.

    Only a cache: while Redis is down every segment is a miss and the tokenizer counts it (exact, slower);
    the counting-unavailable rule of the policy is for when the tokenizer itself cannot count.
    """

    # One command for all of a count's new keys, each with its expiry: a pipeline of one SET per key costs
    # redis-py several times as much to pack and to read back (about 6 ms against 2 for 200 keys here).
    SET_WITH_EXPIRY = "for i, key in ipairs(KEYS) do redis.call('SET', key, ARGV[i], 'EX', ARGV[#ARGV]) end"

    def __init__(self, client: redis.Redis | None = None, ttl_seconds: int | None = None) -> None:
        self.client = client or redis_client()
        self.ttl = ttl_seconds or settings.COUNT_CACHE_TTL_SECONDS

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        """The counts of ``keys`` (``None`` for a miss). The MGET is followed, in the same round trip, by an
        ECHO of a value never sent before: a reply left unread on the connection (a server that ignored a
        write's CLIENT REPLY SKIP, see ``set_many``) would shift the answers, and the ECHO's would not be
        that value. Such a read is a failure, never a count: the pool's connections are dropped and the
        writes of this process wait for their replies from then on."""
        global _reply_skip
        if not keys or time.monotonic() < _skip_until:
            return [None] * len(keys)
        nonce = uuid.uuid4().hex
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.mget(list(keys))
            pipe.echo(nonce)
            values, echoed = pipe.execute()
            if echoed != nonce.encode() or not isinstance(values, list) or len(values) != len(keys):
                _reply_skip = False
                self.client.connection_pool.disconnect()
                raise redis.ResponseError("count cache: a reply was out of step; writes now wait for theirs")
        except redis.RedisError as exc:
            _redis_failed(exc)
            return [None] * len(keys)
        return [None if v is None else int(v) for v in values]

    def set_many(self, mapping: Mapping[str, int]) -> None:
        """Send the counts with their expiry, without waiting for Redis to store them.

        A count does not need the write's answer: ``CLIENT REPLY SKIP`` (Redis 3.2 and later, spoken to
        directly, not through a proxy that drops it) tells Redis to send none, so the count returns once the
        command is sent. Waiting for it was the largest part of what a cold count added to its tokenizer's
        time: about 0.8 ms of the 2-3 ms for count_bench's 188 segments, where sending takes about 0.12 ms.
        The connection goes back to the pool with no reply pending, and the commands of one connection run
        in order, so what this process asks next on it sees the write. The body is sent (EVAL), not its
        digest: a skipped reply could not say that Redis no longer knows the script, and Redis keeps the
        compiled body. A refused write (Redis out of memory) goes unseen; a connection that fails does not,
        and Redis is skipped for a while, as after a failed read. Once a read found a reply out of step
        (``get_many``), the writes wait for their replies.
        """
        if not mapping or time.monotonic() < _skip_until:
            return
        keys = list(mapping)
        write = ("EVAL", self.SET_WITH_EXPIRY, len(keys), *keys, *mapping.values(), self.ttl)
        if not _reply_skip:
            try:
                self.client.execute_command(*write)
            except redis.RedisError as exc:
                _redis_failed(exc)
            return
        pool = self.client.connection_pool
        try:
            connection = pool.get_connection()
            try:
                connection.send_packed_command(connection.pack_commands([("CLIENT", "REPLY", "SKIP"), write]))
            finally:
                pool.release(connection)
        except redis.RedisError as exc:
            _redis_failed(exc)

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


class LayeredCountCache:
    """Counts in this process first, then in Redis. Two local layers: ``texts``
    (``ladder.counting.TextCounts``), by the segment's text, which a warm count of unchanged segments finds
    without building a key; and ``local``, by key, for what ``texts`` no longer holds and for the providers'
    counts (keyed by payload digest). Every entry names its tokenizer digest and template revision (or counter
    and payload digest), so none goes stale; both are bounded (least recently used out first)."""

    def __init__(self, shared: RedisCountCache, capacity: int, text_chars: int = 0) -> None:
        self.shared = shared
        self.capacity = capacity
        self.local: OrderedDict[str, int] = OrderedDict()
        self.texts = TextCounts(text_chars)
        self.lock = threading.Lock()
        self.policy_revision: int | None = None

    def under_policy(self, revision: int | None) -> LayeredCountCache:
        """The cache under this active policy revision: a rollback (any move of the alias) drops the local
        layers, as it clears the shared one (SPEC §6)."""
        with self.lock:
            if revision != self.policy_revision:
                self.local.clear()
                self.texts.clear()
                self.policy_revision = revision
        return self

    def forget_local(self) -> None:
        """Drop both local layers (Redis keeps its counts)."""
        with self.lock:
            self.local.clear()
        self.texts.clear()

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        with self.lock:
            found = [self.local.get(key) for key in keys]
            for key, value in zip(keys, found, strict=True):
                if value is not None:
                    self.local.move_to_end(key)
        missing = [key for key, value in zip(keys, found, strict=True) if value is None]
        if not missing:
            return found
        shared = dict(zip(missing, self.shared.get_many(missing), strict=True))
        self._keep({key: value for key, value in shared.items() if value is not None})
        return [value if value is not None else shared[key] for key, value in zip(keys, found, strict=True)]

    def set_many(self, mapping: Mapping[str, int]) -> None:
        self._keep(mapping)
        self.shared.set_many(mapping)

    def _keep(self, mapping: Mapping[str, int]) -> None:
        with self.lock:
            self.local.update(mapping)
            for key in mapping:
                self.local.move_to_end(key)
            while len(self.local) > self.capacity:
                self.local.popitem(last=False)


@lru_cache(maxsize=1)
def count_cache() -> LayeredCountCache:
    """The process's count cache (in-process layer in front of Redis)."""
    return LayeredCountCache(
        RedisCountCache(), settings.COUNT_CACHE_LOCAL_ENTRIES, settings.COUNT_CACHE_LOCAL_CHARS
    )
