"""node/fleet/dialer.py: connections opened on threads of their own, a new
dial every ``every_s`` while none answers, the newest handed out."""

from __future__ import annotations

import threading
import time

import pytest

from node.fleet.dialer import Dialer
from node.testing import wait_for

pytestmark = pytest.mark.timeout(30)


class Conn:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Network:
    """A connect that waits until the cut heals, as a SYN into a cut does:
    a dial started during the cut answers only when it heals (or never,
    ``lost``); ``fail`` makes a dial fail at once."""

    def __init__(self) -> None:
        self.healed = threading.Event()
        self.fail = False
        self.opened: list[Conn] = []
        self.lock = threading.Lock()

    def connect(self) -> Conn:
        if self.fail:
            raise OSError("connection refused")
        self.healed.wait(10)
        with self.lock:
            conn = Conn(len(self.opened))
            self.opened.append(conn)
            return conn


def test_take_never_waits_and_a_dial_after_the_heal_answers():
    net = Network()
    dialer = Dialer(net.connect, every_s=0.05, most=3)
    t0 = time.monotonic()
    assert dialer.take() is None  # a dial started; the caller does not wait
    assert time.monotonic() - t0 < 0.05
    assert dialer.take() is None  # too soon for a second dial
    assert dialer.under_way == 1
    wait_for(lambda: dialer.take() is None and dialer.under_way >= 3, 5, "three dials")
    assert dialer.dials == 3  # at most ``most`` at once
    net.healed.set()
    wait_for(lambda: len(net.opened) == 3 and dialer.under_way == 0, 5, "every dial back")
    # One handed out (the newest), the two others closed: one connection in use.
    conn = dialer.take()
    assert isinstance(conn, Conn) and not conn.closed
    assert sorted(c.closed for c in net.opened) == [False, True, True]
    dialer.close()
    assert not conn.closed  # the caller's now


def test_a_failed_dial_is_said_and_dialed_again():
    net = Network()
    net.fail = True
    dialer = Dialer(net.connect, every_s=0.01)
    assert dialer.take() is None
    wait_for(lambda: dialer.last_error == "connection refused", 5, "the error")
    net.fail = False
    net.healed.set()
    conn = wait_for(lambda: dialer.take(), 5, "a connection after the failure")
    assert isinstance(conn, Conn)
    dialer.close()


def test_a_dial_that_answers_after_close_is_closed():
    net = Network()
    dialer = Dialer(net.connect)
    assert dialer.take() is None
    dialer.close()
    net.healed.set()
    wait_for(lambda: net.opened and net.opened[0].closed, 5, "the late connection closed")
    assert dialer.take() is None
