"""The deployment's count cache: Redis writes with their expiry, and the process's layers dropped when the
active policy moves (a rollback clears the shared cache too: SPEC §6)."""

from __future__ import annotations

from typing import Any

import redis

from budgeting.admission.count_cache import LayeredCountCache, RedisCountCache


def test_counts_are_written_to_redis_with_their_expiry(redis_db: Any) -> None:
    cache = RedisCountCache(redis_db, ttl_seconds=120)
    cache.set_many({"tc:test:a": 3, "tc:test:b": 0})
    assert cache.get_many(["tc:test:a", "tc:test:b", "tc:test:c"]) == [3, 0, None]
    assert 0 < redis_db.ttl("tc:test:a") <= 120
    assert 0 < redis_db.ttl("tc:test:b") <= 120


def test_a_write_waits_for_no_reply_and_leaves_none_pending(redis_db: Any) -> None:
    # One connection. A reply the write left unread would be the answer to the next command on it, or, once
    # it has arrived, make redis-py drop the connection for a new one (another client id): either fails here.
    pool = redis.ConnectionPool(max_connections=1, **redis_db.connection_pool.connection_kwargs)
    client: Any = redis.Redis(connection_pool=pool)
    cache = RedisCountCache(client, ttl_seconds=60)
    connection_id = client.client_id()
    for n in range(3):
        cache.set_many({"tc:test:a": n, "tc:test:b": n + 1})
        assert client.echo(f"after write {n}") == f"after write {n}".encode()
        assert cache.get_many(["tc:test:a", "tc:test:b"]) == [n, n + 1]
        assert 0 < client.ttl("tc:test:a") <= 60
        assert client.client_id() == connection_id
    pool.disconnect()


def test_a_move_of_the_active_policy_drops_both_local_layers() -> None:
    # Never connected: only the local layers are used here.
    layered = LayeredCountCache(RedisCountCache(redis.Redis(port=1), ttl_seconds=1), 100, 1_000)
    layered.under_policy(7)

    def remember() -> None:
        layered.texts.set_many("sha256:t", "meta/1", {"text": 2})
        layered.local["tc:key"] = 2

    remember()
    assert layered.under_policy(7) is layered
    assert layered.texts.get_many("sha256:t", "meta/1", ["text"]) == [2] and layered.local
    layered.under_policy(6)
    assert layered.texts.get_many("sha256:t", "meta/1", ["text"]) == [None] and not layered.local
    remember()
    layered.forget_local()
    assert len(layered.texts) == 0 and not layered.local
