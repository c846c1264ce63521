"""Job retention (``[jobs.NAME] retention_s``): results not acknowledged in
time are discarded by the ledger, counted, never silently, and stay gone.

The node test runs a real ``python -m node run`` with a 2-second retention
for one job and none for another, completes over HTTP, and polls
``/accounting`` to a deadline (the ledger sweeps retention every second).
The configuration tests run the CLI and ``load_config``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.client import Client, ClientError
from node.config import Config, load_config
from node.core.errors import ConfigError
from node.testing import ROOT, NodeProcess, finish, wait_for

RETENTION_S = 2
CADENCE_30D = 30 * 86400


@pytest.fixture
def node_dir(tmp_path, node_name):
    started: list[NodeProcess] = []

    def start(*args: str) -> NodeProcess:
        node = NodeProcess(tmp_path / "data", node_name, *args)
        started.append(node)
        return node.start()

    yield start
    finish(started, node_name)


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(f'[jobs.short]\nretention_s = "{RETENTION_S}s"\n\n[jobs.keep]\n')
    return path


def _seed(client: Client, keys_by_job: dict[str, list[str]]) -> None:
    due = time.time() - 3600
    rows = [
        {"key": k, "route": "r", "cadence_s": CADENCE_30D, "due_at": due, "job": job}
        for job, keys in keys_by_job.items()
        for k in keys
    ]
    assert client.upsert(rows) == len(rows)


def _claim_all(client: Client, n: int) -> list:
    got: dict[str, object] = {}

    def more() -> bool:
        try:
            grants = client.claim(n - len(got), lease_s=120, consumer="t")
        except ClientError as exc:
            if exc.status == 503:  # not_ready: the keeper has not published yet
                return False
            raise
        for g in grants:
            assert g.key not in got
            got[g.key] = g
        return len(got) == n

    wait_for(more, 20, f"{n} leases")
    return list(got.values())


def _accounting_until(client: Client, what: str, cond) -> dict:
    box: list[dict] = []

    def check() -> bool:
        box[:] = [client.accounting()]
        return bool(cond(box[0]))

    try:
        wait_for(check, 20, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: last answer {box}") from None
    return box[0]


def _discard_lines(node: NodeProcess) -> dict[str, int]:
    """Sum of the per-job counts of every ``retention_discarded`` log line."""
    total: dict[str, int] = {}
    for m in re.finditer(r"action=retention_discarded total=\d+ jobs=(\{.*?\})", node.log()):
        for job, n in json.loads(m.group(1)).items():
            total[job] = total.get(job, 0) + n
    return total


@pytest.mark.timeout(120)
def test_unacked_results_past_their_retention_are_discarded_counted_and_stay_gone(
    node_dir, tmp_path
):
    config = _config(tmp_path)
    node = node_dir("--config", str(config))
    client = Client(node.base_url)
    short = [f"short/{i}" for i in range(4)]
    keep = [f"keep/{i}" for i in range(2)]
    _seed(client, {"short": short, "keep": keep})
    ids: dict[str, int] = {}
    for g in _claim_all(client, 6):
        ids[g.key] = client.complete(g.lease_id, g.key, {"k": g.key})
    finished_at = time.time()

    # One short result is out on an offer when retention drops it.
    offered = client.poll("short", max=1)
    assert len(offered) == 1 and offered[0]["key"] in short

    acct = _accounting_until(
        client, "4 results discarded", lambda a: a["discarded"] == 4 and a["balanced"]
    )
    assert time.time() - finished_at >= RETENTION_S - 0.5  # not before their time
    assert (acct["finished"], acct["acknowledged"], acct["awaiting_ack"]) == (6, 0, 2), acct
    assert acct["finished"] == acct["acknowledged"] + acct["discarded"] + acct["awaiting_ack"]
    assert _discard_lines(node) == {"short": 4}

    # The offer that was out: its ack is answered 200 and retires nothing.
    assert client.ack("short", [offered[0]["id"]]) == 0
    assert client.poll("short", max=100) == []
    # Acking an id never offered is still refused.
    with pytest.raises(ClientError) as refused:
        client.ack("keep", [ids["keep/0"]])
    assert (refused.value.status, refused.value.code) == (409, "never_offered")
    # A job without retention keeps its results.
    assert sorted(r["key"] for r in client.poll("keep", max=100)) == keep

    # A restart reads the DISCARD records: nothing comes back, counts hold.
    client.close()
    assert node.stop() == 0
    node = node_dir("--config", str(config))
    client = Client(node.base_url)
    acct = _accounting_until(client, "a balanced ledger", lambda a: a["balanced"])
    assert (acct["finished"], acct["discarded"], acct["awaiting_ack"]) == (6, 4, 2), acct
    assert client.poll("short", max=100) == []
    again = client.poll("keep", max=100)
    assert sorted(r["key"] for r in again) == keep
    assert client.ack("keep", [r["id"] for r in again]) == 2
    acct = _accounting_until(client, "2 acknowledged", lambda a: a["acknowledged"] == 2)
    assert (acct["finished"], acct["discarded"], acct["awaiting_ack"]) == (6, 4, 0), acct
    assert acct["balanced"], acct
    client.close()
    assert node.stop() == 0


# -- configuration -------------------------------------------------------------------------


def test_retention_is_read_from_jobs_tables(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(
        '[jobs.crawl]\nretention_s = "7d"\n\n[jobs."a.b"]\nretention_s = 90\n\n[jobs.x]\n'
    )
    config = load_config({}, env={}, config_file=path)
    assert config.jobs["crawl"].retention_s == 7 * 86400
    assert config.jobs["a.b"].retention_s == 90
    assert config.jobs["x"].retention_s is None
    assert Config.from_json(config.to_json()).jobs == config.jobs  # handed to the ledger
    assert load_config({}, env={}).jobs == {}  # absent: keep until acked


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "out of range"),
        ('"0s"', "out of range"),
        ('"-1s"', "not a duration"),
        ('"soon"', "not a duration"),
        ("true", "duration"),
        ('"4000d"', "out of range"),
    ],
)
def test_a_bad_retention_is_a_config_error_naming_the_line(tmp_path, value, message):
    path = tmp_path / "node.toml"
    path.write_text(f'[routes.r]\ncadence_s = "1h"\n\n[jobs.crawl]\nretention_s = {value}\n')
    with pytest.raises(ConfigError, match=message) as err:
        load_config({}, env={}, config_file=path)
    assert f"{path}:5" in str(err.value)


def test_an_unknown_job_setting_is_refused(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("[jobs.crawl]\nretain = 5\n")
    with pytest.raises(ConfigError, match="unknown setting jobs.crawl.retain") as err:
        load_config({}, env={}, config_file=path)
    assert f"{path}:2" in str(err.value)


def test_the_cli_exits_2_on_a_bad_retention(tmp_path, node_name):
    path = tmp_path / "node.toml"
    path.write_text('[jobs.crawl]\nretention_s = "soon"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "node", "run", "--config", str(path),
         "--data-dir", str(tmp_path / "data"), "--name", node_name],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc
    assert f"{path}:2" in proc.stderr and "retention_s" in proc.stderr, proc.stderr
