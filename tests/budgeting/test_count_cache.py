"""The deployment's count cache: Redis writes with their expiry, and the process's layers dropped when the
active policy moves (a rollback clears the shared cache too: SPEC §6)."""

from __future__ import annotations

from typing import Any

import redis

from budgeting.admission.count_cache import LayeredCountCache, RedisCountCache


def test_counts_are_held_then_written_to_redis_with_their_expiry(redis_db: Any) -> None:
    cache = RedisCountCache(redis_db, ttl_seconds=120)
    cache.set_many({"tc:test:a": 3, "tc:test:b": 0})
    assert redis_db.exists("tc:test:a", "tc:test:b") == 0, "held: nothing sent before the flush"
    cache.flush()
    assert redis_db.mget(["tc:test:a", "tc:test:b"]) == [b"3", b"0"]
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
        cache.flush()
        assert client.echo(f"after write {n}") == f"after write {n}".encode()
        assert cache.get_many(["tc:test:a", "tc:test:b"]) == [n, n + 1]
        assert 0 < client.ttl("tc:test:a") <= 60
        assert client.client_id() == connection_id
    pool.disconnect()


def test_a_read_answers_the_writes_held_and_sends_them_behind_its_own(redis_db: Any) -> None:
    pool = redis.ConnectionPool(max_connections=1, **redis_db.connection_pool.connection_kwargs)
    client: Any = redis.Redis(connection_pool=pool)
    cache = RedisCountCache(client, ttl_seconds=60)
    client.set("tc:test:b", 2)
    cache.set_many({"tc:test:a": 1})
    assert cache.get_many(["tc:test:a", "tc:test:b", "tc:test:c"]) == [1, 2, None]
    # Sent in the read's packet, after its MGET and ECHO, with its reply skipped: the connection is in step.
    assert client.echo("after the read") == b"after the read"
    assert client.get("tc:test:a") == b"1" and 0 < client.ttl("tc:test:a") <= 60
    assert cache.get_many(["tc:test:a"]) == [1]
    pool.disconnect()


def test_while_redis_is_skipped_the_writes_held_still_answer(monkeypatch: Any) -> None:
    from budgeting.admission import count_cache

    cache = RedisCountCache(redis.Redis(port=1), ttl_seconds=60)  # never reached
    monkeypatch.setattr(count_cache, "_skip_until", float("inf"))
    cache.set_many({"tc:test:a": 1})
    assert cache.get_many(["tc:test:a", "tc:test:b"]) == [1, None]
    cache.flush()  # dropped while Redis is skipped: nothing is kept without bound
    assert cache.get_many(["tc:test:a"]) == [None]


def test_the_api_sends_the_counts_it_held_once_its_answer_is_out(redis_db: Any, client: Any) -> None:
    from budgeting.admission.count_cache import count_cache

    count_cache().set_many({"tc:test:a": 4})
    assert redis_db.exists("tc:test:a") == 0
    assert client.get("/api/v1/").status_code in (200, 401)
    assert redis_db.get("tc:test:a") == b"4"


def test_a_celery_task_sends_the_counts_it_held_once_it_has_run(redis_db: Any) -> None:
    from budgeting.admission.count_cache import count_cache
    from budgeting.celery import app

    @app.task(name="tests.hold_a_count")
    def hold_a_count() -> None:
        count_cache().set_many({"tc:test:t": 6})

    hold_a_count.apply()
    assert redis_db.get("tc:test:t") == b"6"


def test_a_move_of_the_active_policy_forgets_the_writes_held(redis_db: Any) -> None:
    layered = LayeredCountCache(RedisCountCache(redis_db, ttl_seconds=60), 100, 1_000)
    layered.under_policy(7)
    layered.set_many({"tc:test:a": 3})
    layered.under_policy(8)
    layered.shared.flush()
    assert redis_db.exists("tc:test:a") == 0


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


def test_a_reply_left_on_the_connection_is_never_read_as_counts(redis_db: Any, monkeypatch: Any) -> None:
    """A server that ignored CLIENT REPLY SKIP would leave a write's reply to be read as the next command's.
    Planted here, on the pool's one connection: a command sent and not read whose reply, two values, comes
    0.1 s later (redis-py drops a connection whose reply has already arrived, not one still on its way). A
    plain MGET (the negative control) returns those two values as if they were ours; the cache's read sees
    the shift, answers misses, drops the connection and makes later writes wait for their replies."""
    from budgeting.admission import count_cache

    monkeypatch.setattr(count_cache, "_reply_skip", True)
    monkeypatch.setattr(count_cache, "_skip_until", 0.0)
    pool = redis.ConnectionPool(max_connections=1, **redis_db.connection_pool.connection_kwargs)
    client: Any = redis.Redis(connection_pool=pool)
    client.mset({"tc:test:a": 1, "tc:test:b": 2})
    late_reply = (
        "local s = redis.call('TIME') local t repeat t = redis.call('TIME') "
        "until (t[1] - s[1]) * 1000000 + t[2] - s[2] > 100000 return {'7', '9'}"
    )

    def plant() -> None:
        connection = pool.get_connection()
        connection.send_command("EVAL", late_reply, 0)
        pool.release(connection)

    plant()
    assert client.mget(["tc:test:a", "tc:test:b"]) == [b"7", b"9"]  # the negative control: read as ours
    pool.disconnect()

    cache = RedisCountCache(client, ttl_seconds=60)
    plant()
    assert cache.get_many(["tc:test:a", "tc:test:b"]) == [None, None]
    assert count_cache._reply_skip is False
    monkeypatch.setattr(count_cache, "_skip_until", 0.0)
    assert cache.get_many(["tc:test:a", "tc:test:b"]) == [1, 2]  # a new connection, in step
    cache.set_many({"tc:test:a": 5})
    cache.flush()  # waits for its reply: nothing is left pending
    assert client.echo("next") == b"next"
    assert cache.get_many(["tc:test:a"]) == [5]
    pool.disconnect()
