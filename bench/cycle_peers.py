"""The peers of the whole-cycle bench (``bench/bench_cycle.py``): PostgreSQL
SKIP LOCKED and Redis, each as claim → complete → deliver → take.

Each peer is three functions the bench's harness calls:

- ``setup(rows) -> cfg``: makes the peer's own database or key prefix and
  loads ``rows`` due rows (the keys, due times and payloads of
  ``bench/claims_external.py``); not timed;
- ``claimer(cfg, idx, batch) -> (cycle, close)``: in a claimer process;
  ``cycle()`` claims up to ``batch`` and completes them, and answers
  ``(granted, completed, ids, claim_s)`` (``ids`` is empty: the peers' result
  ids are not checked one by one, their counts are; ``claim_s`` the seconds
  the claim took, the rest of the cycle being the completion);
- ``receiver(cfg) -> (take, close)``: in the receiver process; ``take()``
  takes up to 1,000 delivered results off the peer for good and answers
  ``(taken, ids)``;
- ``teardown(cfg)``: drops what ``setup`` made; ``info(cfg)`` the server's
  version and settings.

Importing this module imports no driver: a missing driver or server shows as
the exception ``setup`` raises, which the bench reports as "not run".
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.claims_external import (
    PG_DSN,
    REDIS_URL,
    SCATTER,
    SPREAD_S,
    _pg_create_db,
    _pg_drop_db,
    _pg_dsn,
    _pg_server,
    due_of,
    key_of,
    payload_of,
)

LEASE_S = 60.0
NEXT_DUE_S = 3600.0  # a completed row is due again an hour later
TAKE_MAX = 1000  # a receiver takes up to this many results at a time

Cycle = Callable[[], tuple[int, int, list[int], float]]
Take = Callable[[], tuple[int, list[int]]]

# -- PostgreSQL ---------------------------------------------------------------------------

PG_CLAIM = """
UPDATE claims SET lease_until = now() + interval '60 s'
WHERE key IN (
    SELECT key FROM claims
    WHERE due_at <= now() AND (lease_until IS NULL OR lease_until < now())
    ORDER BY due_at LIMIT %s
    FOR UPDATE SKIP LOCKED)
RETURNING key, payload
"""
PG_WRITE_BACK = (
    "UPDATE claims SET due_at = now() + interval '3600 s', lease_until = NULL "
    "WHERE key = ANY(%s)"
)
PG_RESULTS = "INSERT INTO results (key, job, result) SELECT k, 'j', %s FROM unnest(%s::text[]) k"
PG_TAKE = """
DELETE FROM results WHERE id IN (
    SELECT id FROM results ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED)
RETURNING id, key, result
"""


def pg_setup(rows: int, dsn: str | None = None, scattered: bool = False) -> dict[str, Any]:
    import psycopg

    db = _pg_create_db(dsn)
    cfg = {"db": db, "base": dsn, "dsn": _pg_dsn(db, dsn)}
    try:
        with psycopg.connect(cfg["dsn"], autocommit=True) as conn:
            conn.execute(
                """CREATE TABLE claims (
                    key text PRIMARY KEY,
                    due_at timestamptz,
                    lease_until timestamptz,
                    payload jsonb)"""
            )
            conn.execute(
                "CREATE TABLE results (id bigserial PRIMARY KEY, key text, job text, result bytea)"
            )
            # The keys, due times and payloads of key_of / due_of / payload_of.
            conn.execute(
                """INSERT INTO claims (key, due_at, payload)
                SELECT 'https://example.com/items/' || lpad(i::text, 10, '0')
                           || '/some-slug-text-' || lpad((i %% 97)::text, 2, '0'),
                       to_timestamp(%(now)s - %(spread)s + (%(spread)s - 1.0)
                                    * (CASE WHEN %(scattered)s THEN i::bigint * %(scatter)s
                                            %% %(rows)s ELSE i END) / %(rows)s),
                       jsonb_build_object('route', 'route' || lpad((i %% 20)::text, 2, '0'),
                                          'job', 'job-' || (i %% 7), 'n', i)
                FROM generate_series(0, %(rows)s - 1) AS i ORDER BY i""",
                {"now": time.time(), "spread": SPREAD_S, "rows": rows,
                 "scattered": scattered, "scatter": SCATTER},  # fmt: skip
            )
            conn.execute("CREATE INDEX claims_due ON claims (due_at)")
            conn.execute("VACUUM ANALYZE claims")
            conn.execute("VACUUM ANALYZE results")
    except BaseException:
        _pg_drop_db(db, dsn)
        raise
    return cfg


def pg_claimer(cfg: dict[str, Any], idx: int, batch: int, result: bytes) -> tuple[Cycle, Any]:
    import psycopg

    conn = psycopg.connect(cfg["dsn"], autocommit=True)
    cur = conn.cursor()
    # Prepare every statement server-side before the clock starts.
    cur.execute(PG_CLAIM, (0,), prepare=True)
    cur.fetchall()
    with conn.transaction(force_rollback=True):  # prepared, then undone
        cur.execute(PG_WRITE_BACK, (["-"],), prepare=True)
        cur.execute(PG_RESULTS, (result, ["-"]), prepare=True)

    def cycle() -> tuple[int, int, list[int], float]:
        t0 = time.monotonic()  # _cycle_loop's clock: the rest is its time less this
        cur.execute(PG_CLAIM, (batch,), prepare=True)
        keys = [row[0] for row in cur.fetchall()]
        claim_s = time.monotonic() - t0
        if not keys:
            return 0, 0, [], claim_s
        with conn.transaction():  # one transaction: the write-backs and the results
            cur.execute(PG_WRITE_BACK, (keys,), prepare=True)
            cur.execute(PG_RESULTS, (result, keys), prepare=True)
        return len(keys), len(keys), [], claim_s

    return cycle, conn.close


def pg_receiver(cfg: dict[str, Any]) -> tuple[Take, Any]:
    import psycopg

    conn = psycopg.connect(cfg["dsn"], autocommit=True)
    cur = conn.cursor()
    cur.execute(PG_TAKE, prepare=True)  # the table is empty yet: prepares it
    cur.fetchall()

    def take() -> tuple[int, list[int]]:
        cur.execute(PG_TAKE, prepare=True)
        return len(cur.fetchall()), []

    return take, conn.close


def pg_teardown(cfg: dict[str, Any]) -> None:
    _pg_drop_db(cfg["db"], cfg["base"])


def pg_info(cfg: dict[str, Any]) -> dict[str, Any]:
    info = _pg_server(cfg["dsn"])
    return {"postgres": info["server"], "synchronous_commit": info["synchronous_commit"],
            "autovacuum": info["autovacuum"]}  # fmt: skip


# -- Redis --------------------------------------------------------------------------------

# KEYS: the due sorted set, the payload hash. ARGV: now, batch, lease expiry.
# The due members up to now, most overdue first; each one's score moved to
# the lease's expiry (claimable again then, unless completed); key, payload pairs.
REDIS_CLAIM_LUA = """
local keys = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #keys == 0 then return {} end
local z = {}
for i, k in ipairs(keys) do
    z[2 * i - 1] = ARGV[3]
    z[2 * i] = k
end
redis.call('ZADD', KEYS[1], unpack(z))
local payloads = redis.call('HMGET', KEYS[2], unpack(keys))
local out = {}
for i, k in ipairs(keys) do
    out[2 * i - 1] = k
    out[2 * i] = payloads[i]
end
return out
"""


def _redis_keys(prefix: str) -> tuple[str, str, str]:
    return f"{prefix}:due", f"{prefix}:payload", f"{prefix}:results"


def redis_setup(rows: int, url: str | None = None, scattered: bool = False) -> dict[str, Any]:
    import redis

    url = url or REDIS_URL
    prefix = f"qn_bench_cycle:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    cfg = {"url": url, "prefix": prefix}
    r = redis.Redis.from_url(url)
    try:
        r.ping()
        due_k, payload_k, _ = _redis_keys(prefix)
        now = time.time()
        for lo in range(0, rows, 10_000):
            hi = min(rows, lo + 10_000)
            pipe = r.pipeline(transaction=False)
            pipe.zadd(due_k, {key_of(i): due_of(i, rows, now, scattered) for i in range(lo, hi)})
            pipe.hset(payload_k, mapping={key_of(i): payload_of(i) for i in range(lo, hi)})
            pipe.execute()
    except BaseException:
        redis_teardown(cfg)
        raise
    finally:
        r.close()
    return cfg


def redis_claimer(cfg: dict[str, Any], idx: int, batch: int, result: bytes) -> tuple[Cycle, Any]:
    import redis

    r = redis.Redis.from_url(cfg["url"])
    due_k, payload_k, results_k = _redis_keys(cfg["prefix"])
    sha = r.script_load(REDIS_CLAIM_LUA)
    r.evalsha(sha, 2, due_k, payload_k, time.time(), 0, time.time() + LEASE_S)  # warm up

    def cycle() -> tuple[int, int, list[int], float]:
        t0 = time.monotonic()  # _cycle_loop's clock: the rest is its time less this
        now = time.time()
        out = r.evalsha(sha, 2, due_k, payload_k, now, batch, now + LEASE_S)
        keys = out[0::2]
        claim_s = time.monotonic() - t0
        if not keys:
            return 0, 0, [], claim_s
        done = time.time()
        pipe = r.pipeline(transaction=True)  # one MULTI: the next due times, the results
        pipe.zadd(due_k, {k: done + NEXT_DUE_S for k in keys})
        pipe.rpush(results_k, *[k + b"\0" + result for k in keys])
        pipe.execute()
        return len(keys), len(keys), [], claim_s

    return cycle, r.close


def redis_receiver(cfg: dict[str, Any]) -> tuple[Take, Any]:
    import redis

    r = redis.Redis.from_url(cfg["url"])
    _, _, results_k = _redis_keys(cfg["prefix"])
    r.ping()

    def take() -> tuple[int, list[int]]:
        got = r.lpop(results_k, TAKE_MAX)
        return (len(got) if got else 0), []

    return take, r.close


def redis_teardown(cfg: dict[str, Any]) -> None:
    import redis

    r = redis.Redis.from_url(cfg["url"])
    try:
        r.delete(*_redis_keys(cfg["prefix"]))
    finally:
        r.close()


def redis_info(cfg: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import version

    import redis

    r = redis.Redis.from_url(cfg["url"])
    try:
        server = r.info("server").get("redis_version")
    finally:
        r.close()
    return {"redis": server, "redis_py": version("redis"), "durable": False}


# name -> setup, claimer, receiver, teardown, info
PEERS: dict[str, tuple[Callable[..., Any], ...]] = {
    "postgres": (pg_setup, pg_claimer, pg_receiver, pg_teardown, pg_info),
    "redis": (redis_setup, redis_claimer, redis_receiver, redis_teardown, redis_info),
}
PEER_DSN = {"postgres": PG_DSN, "redis": REDIS_URL}
