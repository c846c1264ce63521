"""A fleet's settings: membership_timeout_s, heartbeat_s and peers, from the
file, the environment and the command line, validated before anything starts
(docs/api.md, "Defaults that users tune"; docs/fleet.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node.config import Config, load_config
from node.core.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_every_source():
    config = load_config(env={"QUEUE_NODE_NAME": "a"})
    assert (config.membership_timeout_s, config.heartbeat_s, config.peers) == (10.0, 1.0, ())
    config = load_config(
        env={"QUEUE_NODE_NAME": "a", "QUEUE_NODE_PEERS": "b, 10.0.0.3:8470,,[::1]:9"}
    )
    assert config.peers == ("b", "10.0.0.3:8470", "[::1]:9")
    config = load_config({"membership_timeout_s": "30s", "heartbeat_s": "2"}, env={})
    assert (config.membership_timeout_s, config.heartbeat_s) == (30.0, 2.0)
    assert Config.from_json(config.to_json()) == config
    assert load_config(env={"QUEUE_NODE_NAME": "a"}).peer_wait_s == 120.0
    assert load_config(env={"QUEUE_NODE_NAME": "a", "QUEUE_NODE_PEER_WAIT_S": "5"}).peer_wait_s == 5


def test_peers_from_the_file(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('name = "a"\npeers = ["b", "c.example:8470"]\nmembership_timeout_s = "20s"\n')
    config = load_config(config_file=cfg, env={})
    assert config.peers == ("b", "c.example:8470") and config.membership_timeout_s == 20.0
    assert Config.from_json(config.to_json()).peers == config.peers


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (
            {"heartbeat_s": "5"},
            "heartbeat_s = 5 is too long for membership_timeout_s = 10: at most 4",
        ),
        ({"membership_timeout_s": "0.5"}, "out of range: allowed 1 to 3600"),
        ({"heartbeat_s": "0"}, "out of range: allowed 0.05 to 600"),
        ({"peer_wait_s": "0.5"}, "out of range: allowed 1 to 3600"),
        ({"peers": "b,not a name"}, "expected a list of node names or HOST:PORT addresses"),
        ({"peers": "a,b"}, "peers names this node ('a')"),
    ],
)
def test_bad_fleet_settings_are_refused_with_what_is_allowed(options, words):
    with pytest.raises(ConfigError) as refused:
        load_config({"name": "a", **options}, env={})
    assert words in str(refused.value)


def test_a_bad_peer_in_the_file_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('lease_s = 30\npeers = ["b", 7]\n')
    out = subprocess.run(
        [sys.executable, "-m", "node", "run", "--config", str(cfg), "--data-dir",
         str(tmp_path / "d")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{cfg}:2" in lines[0], out.stderr
    assert "expected a list of node names or HOST:PORT addresses" in lines[0], out.stderr
    assert not (tmp_path / "d").exists()
