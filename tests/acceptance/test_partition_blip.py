"""A short cut between a node and its database, under the grant deadline,
as a keeper's heartbeat sees it (docs/reliability.md, "Found by the
campaign", finding 4): the heartbeat runs in the keeper's loop, so a
reconnect must not block it, and the first heartbeat after the heal must
not wait for the kernel's retries of a SYN sent into the cut.

The heartbeats run as the keeper runs them (node/fleet/membership.py with
keeper/fleet.py's bounds: statements and unacknowledged sends 0.5 s, the
connect 2 s) in a process of their own in a network namespace
(tests/netns.py), every 0.2 s, each one timed. The cut drops every packet
between that namespace and the database's for 1.6 s, then heals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.testing import wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CUT_S = 1.6

BEATS = r"""
import json, sys, time
from keeper.fleet import CONNECT_TIMEOUT_S, STATEMENT_TIMEOUT_S
from node.fleet.membership import Membership
from node.core.errors import StoreError

url, name, background = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
m = Membership(url, name, "", membership_timeout_s=4.0, connect_timeout_s=CONNECT_TIMEOUT_S,
               statement_timeout_s=STATEMENT_TIMEOUT_S, reconnect_in_background=background)
m.ensure_schema()
m.join()
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    t0 = time.monotonic()
    try:
        m.heartbeat()
        ok = True
    except StoreError:
        ok = False
    took = time.monotonic() - t0
    print(json.dumps({"t": time.time(), "ok": ok, "took": round(took, 4)}), flush=True)
    time.sleep(max(0.0, 0.2 - took))  # the heartbeat's own pace, as keeper/fleet.py's
m.close()
"""


def _beats(host, db_url: str, run_s: float) -> subprocess.Popen:
    argv = host.exec_argv([sys.executable, "-c", BEATS, db_url, f"blip-{host.ns}", "1",
                           str(run_s)])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def test_a_short_cut_blocks_no_heartbeat_and_the_first_after_the_heal_is_prompt(net, pg_url):
    host = net.add_host()
    proc = _beats(host, net.db_url(pg_url), run_s=12.0)
    lines: list[dict] = []
    try:
        assert proc.stdout is not None

        def read_until(cond) -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(json.loads(line))
                if cond():
                    return
            raise AssertionError(f"the heartbeats ended early: {lines[-5:]}")

        read_until(lambda: sum(b["ok"] for b in lines) >= 5)  # joined and beating
        cut_at = time.time()
        net.cut(host, net.db)
        wait_for(lambda: time.time() >= cut_at + CUT_S, CUT_S + 1, "the cut's length")
        healed_at = time.time()
        net.heal(host, net.db)
        read_until(lambda: lines[-1]["t"] >= healed_at + 3.0)
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    during = [b for b in lines if b["t"] >= cut_at]
    assert any(not b["ok"] for b in during), "the cut failed no heartbeat"
    # The heartbeat in flight at the cut fails by the connection's bound
    # (tcp_user_timeout 0.5 s, checked at the kernel's retransmissions: up to
    # about 1 s); after it, none waits on a connect: each fails at once until
    # a dial made after the heal answers.
    first_failed = next(i for i, b in enumerate(during) if not b["ok"])
    slowest = max(b["took"] for b in during[first_failed + 1 :])
    assert slowest < 0.1, f"a heartbeat blocked the loop for {slowest} s on a reconnect"
    first_ok = min(b["t"] for b in during if b["ok"] and b["t"] > healed_at)
    after_heal = first_ok - healed_at
    assert after_heal < 0.6, f"the first heartbeat {after_heal:.2f} s after the heal"
    oks = [b["t"] for b in lines if b["ok"]]
    gap = max(b - a for a, b in zip(oks, oks[1:], strict=False))
    # The grant deadline lapses 3.2 s after a heartbeat is sent: a 1.6 s cut
    # must stay well inside it.
    assert gap < CUT_S + 0.9, f"{gap:.2f} s without a heartbeat"
    print(f"\ncut {CUT_S} s: in flight at the cut {during[first_failed]['took']:.3f} s, slowest "
          f"after it {slowest:.4f} s, first after the heal {after_heal:.3f} s, "
          f"longest without one {gap:.3f} s")  # fmt: skip


READS = r"""
import json, sys, time
from node.core.errors import StoreError
from node.store import open_store

url, bound = sys.argv[1], float(sys.argv[2])
store = open_store(url, node_name="blip-reader", network_timeout_s=bound)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    t0 = time.monotonic()
    try:
        store.last_seq()
        ok = True
    except StoreError:
        ok = False
    print(json.dumps({"t": time.time(), "ok": ok, "took": round(time.monotonic() - t0, 4)}),
          flush=True)
    if not ok:
        break  # a keeper goes into its outage here: it reads this store no more
    time.sleep(0.05)
"""


def test_a_keepers_store_read_in_a_cut_fails_within_its_bound(net, pg_url):
    """A fleet keeper's store is opened with a network bound of a quarter of
    the membership timeout (keeper/loop.py): a read in flight when the
    database is cut off fails within about that long, and the keeper goes
    into its outage (serving its copy, heartbeating on), instead of holding
    its loop until TCP's retransmissions get through after the heal."""
    host = net.add_host()
    bound_s, cut_s = 1.0, 3.0
    argv = host.exec_argv([sys.executable, "-c", READS, net.db_url(pg_url), str(bound_s), "15"])
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[dict] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(json.loads(line))
            if len(lines) >= 5:
                break
        cut_at = time.time()
        net.cut(host, net.db)
        for line in proc.stdout:
            lines.append(json.loads(line))
            if not lines[-1]["ok"] or lines[-1]["t"] > cut_at + cut_s + 5:
                break
        net.heal(host, net.db)
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    failed = [b for b in lines if not b["ok"]]
    assert failed, f"no read failed in a {cut_s} s cut: {lines[-3:]}"
    since_cut = failed[0]["t"] - cut_at
    assert since_cut < bound_s + 1.2, f"the read failed {since_cut:.2f} s after the cut"
    assert failed[0]["t"] < cut_at + cut_s  # inside the cut: not held until the heal
    print(f"\nbound {bound_s} s, cut {cut_s} s: the read in flight failed {since_cut:.3f} s "
          f"after the cut (it took {failed[0]['took']:.3f} s)")  # fmt: skip
