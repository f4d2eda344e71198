"""How often membership checks its peers: quickly while a proposed peer has never answered early on (a cluster's
nodes start a second or two apart), then every interval (node/runtime/membership.py)."""

from node.runtime.membership import STARTUP_PROBE, STARTUP_WINDOW, Membership


def membership(interval=1.0):
    return Membership("a", "127.0.0.1:1", transport=None, discoveries=[], on_change=lambda *_: None, interval=interval)


def test_a_peer_not_up_yet_is_probed_again_soon_after_start():
    m = membership()
    m.proposed = ["127.0.0.1:2", "127.0.0.1:3"]
    m.answered = {"127.0.0.1:2": object()}
    assert m.pause(since_start=1.0) == STARTUP_PROBE


def test_once_every_peer_answered_or_the_start_is_over_rounds_come_every_interval():
    m = membership()
    m.proposed = ["127.0.0.1:2"]
    m.answered = {"127.0.0.1:2": object()}
    assert m.pause(since_start=1.0) == 1.0
    m.answered = {}
    assert m.pause(since_start=STARTUP_WINDOW + 1) == 1.0  # a peer that never comes is not probed fast forever


def test_a_short_interval_is_never_lengthened():
    m = membership(interval=0.05)
    m.proposed = ["127.0.0.1:2"]
    assert m.pause(since_start=0.0) == 0.05
