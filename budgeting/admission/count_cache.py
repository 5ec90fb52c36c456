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

    Writes are held until ``flush``, which the API calls once its answer is sent (``request_finished``) and
    a Celery task once it has run, so an admission never waits on a write it does not need: sending one was
    0.1-0.4 ms of a cold count here. A read sends the writes held so far behind its own commands, in the
    same packet, so this process's next read after them sees them.
    """

    # One command for all of a count's new keys, each with its expiry: a pipeline of one SET per key costs
    # redis-py several times as much to pack and to read back (about 6 ms against 2 for 200 keys here).
    SET_WITH_EXPIRY = (
        "local ttl = ARGV[#ARGV] for i, key in ipairs(KEYS) do redis.call('SET', key, ARGV[i], 'EX', ttl) end"
    )

    def __init__(self, client: redis.Redis | None = None, ttl_seconds: int | None = None) -> None:
        self.client = client or redis_client()
        self.ttl = ttl_seconds or settings.COUNT_CACHE_TTL_SECONDS
        self._held: dict[str, int] = {}
        self._held_lock = threading.Lock()

    def get_many(self, keys: Sequence[str]) -> list[int | None]:
        """The counts of ``keys`` (``None`` for a miss), the writes held answering for theirs.

        The MGET is followed, in the same round trip, by an ECHO of a value never sent before: a reply left
        unread on the connection (a server that ignored a write's CLIENT REPLY SKIP, see ``flush``) would
        shift the answers, and the ECHO's would not be that value. Such a read is a failure, never a count:
        the pool's connections are dropped and the writes of this process wait for their replies from then
        on. The writes held go behind the ECHO: Redis runs a connection's commands in order, and the read's
        answer does not wait for theirs.
        """
        global _reply_skip
        if time.monotonic() < _skip_until:
            with self._held_lock:
                return list(map(self._held.get, keys))
        if not keys:
            return []
        nonce = uuid.uuid4().hex
        if _reply_skip:
            held = self._take_held()
            writes = self._writes(held, skip_reply=True)
        else:
            self.flush()
            held, writes = {}, []
        pool = self.client.connection_pool
        try:
            connection = pool.get_connection()
            try:
                connection.send_packed_command(
                    connection.pack_commands([("MGET", *keys), ("ECHO", nonce), *writes])
                )
                values = connection.read_response()
                echoed = connection.read_response()
            except BaseException:
                connection.disconnect()
                raise
            finally:
                pool.release(connection)
            if echoed != nonce.encode() or not isinstance(values, list) or len(values) != len(keys):
                _reply_skip = False
                pool.disconnect()
                raise redis.ResponseError("count cache: a reply was out of step; writes now wait for theirs")
        except redis.RedisError as exc:
            _redis_failed(exc)
            values = [None] * len(keys)
        counts = [None if v is None else int(v) for v in values]
        if held:
            counts = [held.get(key, count) for key, count in zip(keys, counts, strict=True)]
        return counts

    def set_many(self, mapping: Mapping[str, int]) -> None:
        """Hold the counts for the next ``flush`` or read: nothing is sent now."""
        if not mapping:
            return
        with self._held_lock:
            self._held.update(mapping)

    def discard_held(self) -> None:
        """Forget the writes not sent yet (the active policy moved: SPEC §6 clears what was counted)."""
        with self._held_lock:
            self._held.clear()

    def flush(self) -> None:
        """Send the writes held, with their expiry, without waiting for Redis to store them.

        A count does not need the write's answer: ``CLIENT REPLY SKIP`` (Redis 3.2 and later, spoken to
        directly, not through a proxy that drops it) tells Redis to send none, so this returns once the
        command is sent. The connection goes back to the pool with no reply pending, and the commands of one
        connection run in order, so what this process asks next on it sees the write. The body is sent
        (EVAL), not its digest: a skipped reply could not say that Redis no longer knows the script, and
        Redis keeps the compiled body. A refused write (Redis out of memory) goes unseen; a connection that
        fails does not, and Redis is skipped for a while, as after a failed read. Once a read found a reply
        out of step (``get_many``), the writes wait for their replies.
        """
        writes = self._writes(self._take_held(), skip_reply=_reply_skip)
        if not writes:
            return
        pool = self.client.connection_pool
        try:
            if not _reply_skip:
                self.client.execute_command(*writes[0])
                return
            connection = pool.get_connection()
            try:
                connection.send_packed_command(connection.pack_commands(writes))
            finally:
                pool.release(connection)
        except redis.RedisError as exc:
            _redis_failed(exc)

    def _take_held(self) -> dict[str, int]:
        """The counts held, which are no longer held."""
        with self._held_lock:
            held, self._held = self._held, {}
        return held

    def _writes(self, held: Mapping[str, int], *, skip_reply: bool) -> list[tuple[object, ...]]:
        """The commands that write ``held`` (none while Redis is skipped), the reply skipped or not."""
        if not held or time.monotonic() < _skip_until:
            return []
        write = ("EVAL", self.SET_WITH_EXPIRY, len(held), *held, *held.values(), self.ttl)
        return [("CLIENT", "REPLY", "SKIP"), write] if skip_reply else [write]

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
                self.shared.discard_held()
                self.policy_revision = revision
        return self

    def forget_local(self) -> None:
        """Send the writes held to Redis, then drop both local layers (Redis keeps its counts)."""
        self.shared.flush()
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


def flush_held_counts(**_: object) -> None:
    """Send the counts this process holds for Redis (``RedisCountCache.flush``), if it has a count cache: the
    receiver of ``request_finished`` and of Celery's ``task_postrun``."""
    if count_cache.cache_info().currsize:
        count_cache().shared.flush()
