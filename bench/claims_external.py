"""Claim-path figures of peer queues, for the ratios of the claims bench.

    .venv/bin/python bench/claims_external.py --variant all --batch 1 64 \\
        --procs 2 --seconds 10 --rows 250000

One workload for every variant: ``rows`` rows (250,000) with keys of about 55
characters and a small JSON payload, due times spread evenly over the past 30
days (so every row is due), loaded in due-time order; each claim takes the
``batch`` most overdue rows that are not leased and leases them for 60 s.
``procs`` claimer processes (spawned, one connection each) loop claim(batch)
until the deadline and time every call. Setup (database, schema, rows, index,
VACUUM ANALYZE) happens before the timed part and is not timed.

Variants, one function each, ``run_<variant>(rows, batch, procs, seconds)``:

- ``postgres_skip_locked``: a table (key text primary key, due_at, lease_until,
  holder, payload jsonb), claimed by one UPDATE ... WHERE key IN (SELECT ...
  ORDER BY due_at LIMIT $n FOR UPDATE SKIP LOCKED) RETURNING key, payload;
  psycopg 3, autocommit, prepared statements. Tried with three index layouts
  (``PG_LAYOUTS``); the best one is returned, the others are listed in
  ``tried``. Runs in a database of its own (``qn_bench_<pid>_<rand>``), dropped
  after.
- ``pgqueuer``: PGQueuer through its own API: ``Queries.install``,
  ``Queries.enqueue`` (setup), ``Queries.dequeue(batch_size=...)`` (claims),
  with a 60 s heartbeat timeout as the lease, over its psycopg async driver
  (or its asyncpg driver: ``driver="asyncpg"``).
- ``redis_lua``: a sorted set scored by due time plus a hash of payloads; one
  Lua script (EVALSHA) moves up to ``batch`` due members into a "leased"
  sorted set scored by lease expiry and returns keys and payloads.

Stop rule: a claimer stops at the deadline or at its first empty claim (the
queue is drained: with 250,000 rows a fast variant at batch 64 drains them in
a few seconds). ``seconds`` is the measured window, from the common start to
the last claimer's stop; ``grants_per_s`` = grants / seconds; ``drained``
says whether the window was cut short. Latency percentiles are over the
non-empty claims of all claimers.

Results are printed as JSON lines and appended to bench/results/claims.jsonl.
Importing this module has no side effects; the run_* functions create what
they need and remove it afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
import uuid
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

PG_DSN = os.environ.get("QN_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("QN_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

LEASE_S = 60.0
SPREAD_S = 30 * 86400.0  # due times spread over the past 30 days
VARIANTS = ("postgres_skip_locked", "pgqueuer", "redis_lua")
START_DELAY_S = 0.2
JOIN_GRACE_S = 60.0


def key_of(i: int) -> str:
    """A key of about 55 characters, like a real item URL (as bench/common.py)."""
    return f"https://example.com/items/{i:010d}/some-slug-text-{i % 97:02d}"


def payload_of(i: int) -> str:
    return json.dumps({"route": f"route{i % 20:02d}", "job": f"job-{i % 7}", "n": i})


# A prime: row i's place in the due order is i * SCATTER mod rows, a
# permutation of the rows (rows not a multiple of it) that no key order follows.
SCATTER = 1_000_003


def due_of(i: int, rows: int, now: float, scattered: bool = False) -> float:
    """Row i's due time (epoch s): evenly over the past SPREAD_S, oldest first
    (row 0 first, in key order, or ``scattered``: the most overdue rows lie
    all over the key order, as real items' do)."""
    place = i * SCATTER % rows if scattered and rows > 0 else i
    return now - SPREAD_S + (SPREAD_S - 1.0) * place / max(rows, 1)


# --------------------------------------------------------------------------- harness


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[idx]


def _claim_loop(claim, start_at: float, seconds: float) -> dict:
    """Call claim() until the deadline or the first empty claim."""
    lat = array("d")
    grants = claims = empty = 0
    now = time.monotonic()
    if start_at > now:
        time.sleep(start_at - now)
    deadline = start_at + seconds
    t = time.monotonic()
    while t < deadline:
        n = claim()
        t2 = time.monotonic()
        claims += 1
        if n == 0:
            empty += 1
            t = t2
            break
        lat.append(t2 - t)
        grants += n
        t = t2
    return {
        "grants": grants,
        "claims": claims,
        "empty": empty,
        "stopped_at": t - start_at,
        "lat": lat.tobytes(),
    }


async def _claim_loop_async(claim, start_at: float, seconds: float) -> dict:
    import asyncio

    lat = array("d")
    grants = claims = empty = 0
    now = time.monotonic()
    if start_at > now:
        await asyncio.sleep(start_at - now)
    deadline = start_at + seconds
    t = time.monotonic()
    while t < deadline:
        n = await claim()
        t2 = time.monotonic()
        claims += 1
        if n == 0:
            empty += 1
            t = t2
            break
        lat.append(t2 - t)
        grants += n
        t = t2
    return {
        "grants": grants,
        "claims": claims,
        "empty": empty,
        "stopped_at": t - start_at,
        "lat": lat.tobytes(),
    }


def _child(kind: str, cfg: dict, idx: int, batch: int, seconds: float, ready, go, start, out):
    """One claimer process: connect, say ready, wait for the start, loop, report."""
    try:
        runner = _CLAIMERS[kind]
        res = runner(cfg, idx, batch, seconds, ready, go, start)
        out.put((idx, res, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((idx, None, traceback.format_exc()))
        try:
            ready.put(idx)  # never leave the parent waiting for us
        except Exception:
            pass


def _wait_start(ready, go, start, idx: int) -> float:
    ready.put(idx)
    go.wait()
    return start.value


def _wait_ready(kind: str, children: list, ready, out, timeout: float = 120.0) -> None:
    """Wait until every claimer is connected and prepared; fail fast if one dies."""
    pending = len(children)
    limit = time.monotonic() + timeout
    while pending:
        try:
            ready.get(timeout=0.2)
            pending -= 1
            continue
        except queue_mod.Empty:
            pass
        dead = [p for p in children if p.exitcode not in (None, 0)]
        if dead:
            try:
                _, _, err = out.get(timeout=1)
            except queue_mod.Empty:
                err = f"exit code {dead[0].exitcode} (is the caller's main module guarded "
                err += "by if __name__ == '__main__'?)"
            raise RuntimeError(f"{kind}: claimer failed to start:\n{err}")
        if time.monotonic() > limit:
            raise RuntimeError(f"{kind}: claimers not ready after {timeout:.0f} s")


def _measure(kind: str, cfg: dict, batch: int, procs: int, seconds: float) -> dict:
    """Spawn ``procs`` claimers, start them together, collect their figures."""
    load_1m = os.getloadavg()[0]  # other work on the host skews every figure
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    children = [
        ctx.Process(
            target=_child,
            args=(kind, cfg, i, batch, seconds, ready, go, start, out),
            name=f"claimer-{kind}-{i}",
            daemon=True,
        )
        for i in range(procs)
    ]
    for p in children:
        p.start()
    try:
        _wait_ready(kind, children, ready, out)
        start.value = time.monotonic() + START_DELAY_S
        go.set()
        results: dict[int, dict] = {}
        errors: list[str] = []
        limit = time.monotonic() + START_DELAY_S + seconds + JOIN_GRACE_S
        while len(results) + len(errors) < procs:
            try:
                idx, res, err = out.get(timeout=max(0.1, limit - time.monotonic()))
            except queue_mod.Empty:
                raise RuntimeError(f"{kind}: claimers did not report in time") from None
            if err:
                errors.append(err)
            else:
                results[idx] = res
        if errors:
            raise RuntimeError(f"{kind}: claimer failed:\n" + "\n".join(errors))
    finally:
        for p in children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    lat: list[float] = []
    for r in results.values():
        a = array("d")
        a.frombytes(r["lat"])
        lat.extend(a)
    lat.sort()
    grants = sum(r["grants"] for r in results.values())
    window = max(r["stopped_at"] for r in results.values())
    p50, p99 = _percentile(lat, 0.50), _percentile(lat, 0.99)
    return {
        "batch": batch,
        "procs": procs,
        "grants": grants,
        "seconds": round(window, 3),
        "grants_per_s": round(grants / window, 1) if window > 0 else 0.0,
        "p50_ms": round(p50 * 1e3, 3) if p50 is not None else None,
        "p99_ms": round(p99 * 1e3, 3) if p99 is not None else None,
        "claims": sum(r["claims"] for r in results.values()),
        "empty_claims": sum(r["empty"] for r in results.values()),
        "drained": any(r["empty"] for r in results.values()),
        "cpus": os.cpu_count(),
        "loadavg_1m": round(load_1m, 2),
    }


# --------------------------------------------------------------------------- PostgreSQL


def _pg_dsn(dbname: str, base: str | None = None) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(base or PG_DSN, dbname=dbname)


def _pg_create_db(base: str | None = None) -> str:
    import psycopg

    name = f"qn_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(base or PG_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def _pg_drop_db(name: str, base: str | None = None) -> None:
    import psycopg

    with psycopg.connect(base or PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pg_server(dsn: str) -> dict:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version'), current_setting('synchronous_commit'),"
            " current_setting('autovacuum')"
        ).fetchone()
    assert row is not None
    return {"server": row[0], "synchronous_commit": row[1], "autovacuum": row[2]}


# The claim of the issue: one statement, the most overdue free rows, in order.
PG_CLAIM_OR = """
UPDATE claims SET lease_until = now() + make_interval(secs => %(lease)s), holder = %(holder)s
WHERE key IN (
    SELECT key FROM claims
    WHERE due_at <= now() AND (lease_until IS NULL OR lease_until < now())
    ORDER BY due_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED)
RETURNING key, payload
"""

# The same claim split in two index-friendly legs (never leased / lease
# expired), merged in due order, so that a claim does not walk over the rows
# already leased (the OR form does: its due_at scan filters them one by one).
_PG_CLAIM_SPLIT = """
WITH free AS (
    SELECT key, due_at FROM claims
    WHERE {free} AND due_at <= now()
    ORDER BY due_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT key, due_at FROM claims
    WHERE {expired} AND due_at <= now()
    ORDER BY due_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
), pick AS (
    SELECT key FROM (SELECT * FROM free UNION ALL SELECT * FROM expired) c
    ORDER BY due_at LIMIT %(batch)s
)
UPDATE claims SET lease_until = now() + make_interval(secs => %(lease)s), holder = %(holder)s
FROM pick WHERE claims.key = pick.key
RETURNING claims.key, claims.payload
"""

# PostgreSQL 15 does not take `lease_until IS NULL` as an equality for the
# order of a (lease_until, due_at) index, so that layout indexes NULL as
# -infinity: an equality on the first column gives due order on the second.
_NO_LEASE = "coalesce(lease_until, '-infinity'::timestamptz)"

# layout -> (indexes, claim statement)
PG_LAYOUTS: dict[str, tuple[list[str], str]] = {
    # the claim as the issue writes it, on an index on due_at
    "due_at": (["CREATE INDEX claims_due ON claims (due_at)"], PG_CLAIM_OR),
    # one composite index serving both legs
    "lease_until_due_at": (
        [f"CREATE INDEX claims_lease_due ON claims (({_NO_LEASE}), due_at)"],
        _PG_CLAIM_SPLIT.format(
            free=f"{_NO_LEASE} = '-infinity'::timestamptz",
            expired=f"{_NO_LEASE} > '-infinity'::timestamptz AND {_NO_LEASE} < now()",
        ),
    ),
    # a partial index that leased rows leave, plus one on the leased rows
    "partial_free_due_at": (
        [
            "CREATE INDEX claims_free_due ON claims (due_at) WHERE lease_until IS NULL",
            "CREATE INDEX claims_leased ON claims (lease_until) WHERE lease_until IS NOT NULL",
        ],
        _PG_CLAIM_SPLIT.format(free="lease_until IS NULL", expired="lease_until < now()"),
    ),
}


def _pg_setup(dsn: str, rows: int, layout: str) -> None:
    import psycopg

    indexes, _ = PG_LAYOUTS[layout]
    now = time.time()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS claims")
        conn.execute(
            """CREATE TABLE claims (
                key text PRIMARY KEY,
                due_at timestamptz NOT NULL,
                lease_until timestamptz,
                holder text,
                payload jsonb NOT NULL)"""
        )
        # Same keys, due times and payloads as key_of / due_of / payload_of.
        conn.execute(
            """INSERT INTO claims (key, due_at, payload)
            SELECT 'https://example.com/items/' || lpad(i::text, 10, '0')
                       || '/some-slug-text-' || lpad((i %% 97)::text, 2, '0'),
                   to_timestamp(%(now)s - %(spread)s + (%(spread)s - 1.0) * i / %(rows)s),
                   jsonb_build_object('route', 'route' || lpad((i %% 20)::text, 2, '0'),
                                      'job', 'job-' || (i %% 7), 'n', i)
            FROM generate_series(0, %(rows)s - 1) AS i
            ORDER BY i""",
            {"now": now, "spread": SPREAD_S, "rows": rows},
        )
        for ddl in indexes:
            conn.execute(ddl)
        conn.execute("VACUUM ANALYZE claims")


def _pg_claimer(cfg, idx, batch, seconds, ready, go, start):
    import psycopg

    _, stmt = PG_LAYOUTS[cfg["layout"]]
    params = {"lease": LEASE_S, "holder": f"claimer-{idx}", "batch": batch}
    with psycopg.connect(cfg["dsn"], autocommit=True) as conn:
        cur = conn.cursor()
        # Prepare the statement server-side before the clock starts (LIMIT 0).
        cur.execute(stmt, {**params, "batch": 0}, prepare=True)
        cur.fetchall()

        def claim() -> int:
            cur.execute(stmt, params, prepare=True)
            return len(cur.fetchall())

        start_at = _wait_start(ready, go, start, idx)
        return _claim_loop(claim, start_at, seconds)


def run_postgres_skip_locked_layout(
    rows: int, batch: int, procs: int, seconds: float, layout: str, *, dsn: str | None = None
) -> dict:
    """One index layout of the PostgreSQL variant (see PG_LAYOUTS)."""
    db = _pg_create_db(dsn)
    try:
        bench_dsn = _pg_dsn(db, dsn)
        t0 = time.perf_counter()
        _pg_setup(bench_dsn, rows, layout)
        setup_s = time.perf_counter() - t0
        res = _measure(
            "postgres_skip_locked", {"dsn": bench_dsn, "layout": layout}, batch, procs, seconds
        )
        info = _pg_server(bench_dsn)
    finally:
        _pg_drop_db(db, dsn)
    return {
        "variant": "postgres_skip_locked",
        **res,
        "layout": layout,
        "rows": rows,
        "setup_s": round(setup_s, 2),
        "postgres": info["server"],
        "synchronous_commit": info["synchronous_commit"],
    }


def run_postgres_skip_locked(
    rows: int,
    batch: int,
    procs: int,
    seconds: float,
    *,
    layouts: list[str] | None = None,
    dsn: str | None = None,
) -> dict:
    """The best PostgreSQL FOR UPDATE SKIP LOCKED layout (highest grants/s).

    Every layout in ``layouts`` (default: all of PG_LAYOUTS) is measured on
    fresh rows; the result is the best one, with the others in ``tried``.
    """
    results = [
        run_postgres_skip_locked_layout(rows, batch, procs, seconds, layout, dsn=dsn)
        for layout in (layouts or list(PG_LAYOUTS))
    ]
    best = max(results, key=lambda r: r["grants_per_s"])
    best = dict(best)
    best["tried"] = {
        r["layout"]: {k: r[k] for k in ("grants_per_s", "p50_ms", "p99_ms", "seconds", "drained")}
        for r in results
    }
    return best


# --------------------------------------------------------------------------- PGQueuer

PGQ_ENTRYPOINT = "claim"


async def _pgq_setup(dsn: str, rows: int) -> None:
    from datetime import timedelta

    import psycopg
    from pgqueuer import Queries

    now = time.time()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        q = Queries.from_psycopg_connection(conn)
        await q.install()
        chunk = 5000
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            n = hi - lo
            # execute_after is relative to the insert's now(): due times in the
            # past, enqueued in due order, so PGQueuer's id order is due order.
            t_ins = time.time()
            await q.enqueue(
                [PGQ_ENTRYPOINT] * n,
                [payload_of(i).encode() for i in range(lo, hi)],
                [0] * n,
                [timedelta(seconds=due_of(i, rows, now) - t_ins) for i in range(lo, hi)],
                [key_of(i) for i in range(lo, hi)],
            )
        await conn.execute("VACUUM ANALYZE")


def _pgq_claimer(cfg, idx, batch, seconds, ready, go, start):
    import asyncio

    return asyncio.run(_pgq_claimer_async(cfg, idx, batch, seconds, ready, go, start))


async def _pgq_claimer_async(cfg, idx, batch, seconds, ready, go, start):
    import asyncio
    from datetime import timedelta

    from pgqueuer import Queries
    from pgqueuer.queries import EntrypointExecutionParameter
    from pgqueuer.types import QueueManagerId

    entrypoints = {PGQ_ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}
    qm_id = QueueManagerId(uuid.uuid4())
    lease = timedelta(seconds=LEASE_S)
    if cfg["driver"] == "asyncpg":
        import asyncpg
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(cfg["dsn"])
        conn = await asyncpg.connect(
            host=params.get("host"),
            port=params.get("port"),
            user=params.get("user"),
            password=params.get("password"),
            database=params.get("dbname"),
        )
        q = Queries.from_asyncpg_connection(conn)
    else:
        import psycopg

        conn = await psycopg.AsyncConnection.connect(cfg["dsn"], autocommit=True)
        q = Queries.from_psycopg_connection(conn)
    try:

        async def claim() -> int:
            jobs = await q.dequeue(
                batch_size=batch,
                entrypoints=entrypoints,
                queue_manager_id=qm_id,
                global_concurrency_limit=None,
                heartbeat_timeout=lease,
            )
            return len(jobs)

        loop = asyncio.get_running_loop()
        start_at = await loop.run_in_executor(None, _wait_start, ready, go, start, idx)
        return await _claim_loop_async(claim, start_at, seconds)
    finally:
        await conn.close()


PGQ_DRIVERS = ("psycopg", "asyncpg")


def run_pgqueuer(
    rows: int,
    batch: int,
    procs: int,
    seconds: float,
    *,
    driver: str = "psycopg",
    dsn: str | None = None,
) -> dict:
    """PGQueuer through its own API (Queries.enqueue / Queries.dequeue).

    ``driver``: PGQueuer's driver for the claimers, "psycopg" (its
    PsycopgDriver over an async psycopg connection) or "asyncpg" (its
    AsyncpgDriver; needs the asyncpg package, pgqueuer's "asyncpg" extra).
    """
    if driver not in PGQ_DRIVERS:
        raise ValueError(f"driver must be one of {PGQ_DRIVERS}")
    import asyncio
    from importlib.metadata import version

    db = _pg_create_db(dsn)
    try:
        bench_dsn = _pg_dsn(db, dsn)
        t0 = time.perf_counter()
        asyncio.run(_pgq_setup(bench_dsn, rows))
        setup_s = time.perf_counter() - t0
        res = _measure("pgqueuer", {"dsn": bench_dsn, "driver": driver}, batch, procs, seconds)
        info = _pg_server(bench_dsn)
    finally:
        _pg_drop_db(db, dsn)
    return {
        "variant": "pgqueuer",
        **res,
        "rows": rows,
        "setup_s": round(setup_s, 2),
        "pgqueuer": version("pgqueuer"),
        "driver": f"{driver} {version(driver)}",
        "postgres": info["server"],
        "synchronous_commit": info["synchronous_commit"],
    }


# --------------------------------------------------------------------------- Redis

# KEYS: due zset, leased zset, payload hash. ARGV: now, batch, lease expiry.
# Leases that have expired are granted again first (scored by their old
# expiry), then the most overdue due members; a claim moves its members to
# the leased set and returns key, payload pairs.
REDIS_CLAIM_LUA = """
local now = ARGV[1]
local n = tonumber(ARGV[2])
local expiry = ARGV[3]
local keys = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. now, 'LIMIT', 0, n)
if #keys < n then
    local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, n - #keys)
    if #due > 0 then
        redis.call('ZREM', KEYS[1], unpack(due))
        for _, k in ipairs(due) do keys[#keys + 1] = k end
    end
end
if #keys == 0 then return {} end
local zargs = {}
for i, k in ipairs(keys) do
    zargs[2 * i - 1] = expiry
    zargs[2 * i] = k
end
redis.call('ZADD', KEYS[2], unpack(zargs))
local payloads = redis.call('HMGET', KEYS[3], unpack(keys))
local out = {}
for i, k in ipairs(keys) do
    out[2 * i - 1] = k
    out[2 * i] = payloads[i]
end
return out
"""


def _redis_keys(prefix: str) -> list[str]:
    return [f"{prefix}:due", f"{prefix}:leased", f"{prefix}:payload"]


def _redis_setup(url: str, prefix: str, rows: int) -> None:
    import redis

    r = redis.Redis.from_url(url)
    due_k, leased_k, payload_k = _redis_keys(prefix)
    r.delete(due_k, leased_k, payload_k)
    now = time.time()
    chunk = 10_000
    for lo in range(0, rows, chunk):
        hi = min(rows, lo + chunk)
        pipe = r.pipeline(transaction=False)
        pipe.zadd(due_k, {key_of(i): due_of(i, rows, now) for i in range(lo, hi)})
        pipe.hset(payload_k, mapping={key_of(i): payload_of(i) for i in range(lo, hi)})
        pipe.execute()
    r.close()


def _redis_claimer(cfg, idx, batch, seconds, ready, go, start):
    import redis

    r = redis.Redis.from_url(cfg["url"])
    keys = _redis_keys(cfg["prefix"])
    sha = r.script_load(REDIS_CLAIM_LUA)
    r.evalsha(sha, 3, *keys, time.time(), 0, time.time() + LEASE_S)  # warm the connection

    def claim() -> int:
        now = time.time()
        out = r.evalsha(sha, 3, *keys, now, batch, now + LEASE_S)
        return len(out) // 2

    try:
        start_at = _wait_start(ready, go, start, idx)
        return _claim_loop(claim, start_at, seconds)
    finally:
        r.close()


def run_redis_lua(
    rows: int, batch: int, procs: int, seconds: float, *, url: str | None = None
) -> dict:
    """Redis: a due sorted set, a leased sorted set and a Lua claim (EVALSHA)."""
    from importlib.metadata import version

    import redis

    url = url or REDIS_URL
    prefix = f"qn_bench:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    try:
        t0 = time.perf_counter()
        _redis_setup(url, prefix, rows)
        setup_s = time.perf_counter() - t0
        res = _measure("redis_lua", {"url": url, "prefix": prefix}, batch, procs, seconds)
    finally:
        r = redis.Redis.from_url(url)
        server = r.info("server").get("redis_version")
        r.delete(*_redis_keys(prefix))
        r.close()
    return {
        "variant": "redis_lua",
        **res,
        "rows": rows,
        "setup_s": round(setup_s, 2),
        "redis": server,
        "redis_py": version("redis"),
    }


_CLAIMERS = {
    "postgres_skip_locked": _pg_claimer,
    "pgqueuer": _pgq_claimer,
    "redis_lua": _redis_claimer,
}

# variant -> run_<variant>(rows, batch, procs, seconds) -> dict
RUNNERS: dict[str, Callable[[int, int, int, float], dict]] = {
    "postgres_skip_locked": run_postgres_skip_locked,
    "pgqueuer": run_pgqueuer,
    "redis_lua": run_redis_lua,
}


# --------------------------------------------------------------------------- CLI


def _report(doc: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), **doc}
    line = json.dumps(doc)
    print(line, flush=True)
    with open(RESULTS / "claims.jsonl", "a") as f:
        f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", nargs="+", default=["all"], choices=["all", *VARIANTS])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--procs", nargs="+", type=int, default=[2])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rows", type=int, default=250_000)
    ap.add_argument(
        "--pg-layout",
        nargs="+",
        choices=list(PG_LAYOUTS),
        default=None,
        help="PostgreSQL index layouts to try (default: all; best is reported)",
    )
    ap.add_argument(
        "--pgq-driver",
        choices=PGQ_DRIVERS,
        default="psycopg",
        help="PGQueuer driver for the claimers (default: psycopg)",
    )
    args = ap.parse_args(argv)
    variants = list(VARIANTS) if "all" in args.variant else args.variant
    for variant in variants:
        for procs in args.procs:
            for batch in args.batch:
                if variant == "postgres_skip_locked":
                    res = run_postgres_skip_locked(
                        args.rows, batch, procs, args.seconds, layouts=args.pg_layout
                    )
                elif variant == "pgqueuer":
                    res = run_pgqueuer(
                        args.rows, batch, procs, args.seconds, driver=args.pgq_driver
                    )
                else:
                    res = RUNNERS[variant](args.rows, batch, procs, args.seconds)
                _report(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
