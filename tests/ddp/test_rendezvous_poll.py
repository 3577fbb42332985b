"""The DDP agent's c10d rendezvous reads its state every RENDEZVOUS_POLL_SECONDS, not every second."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from kubetrain.trainer.ddp import agent


@pytest.fixture
def recorded(monkeypatch):
    """torch's delay replaced by a recorder (no sleeping), then the agent's patch on top of it."""
    calls = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda seconds: calls.append(seconds))
    agent.poll_rendezvous_faster()
    return calls


def test_the_state_poll_is_shortened_and_the_random_delays_are_kept(recorded):
    dynamic_rendezvous._delay(seconds=1)  # the poll while waiting for the other nodes
    dynamic_rendezvous._delay(seconds=(0, 0.3))  # the first join's random skew
    dynamic_rendezvous._delay(seconds=2)  # any other fixed delay
    assert recorded == [agent.RENDEZVOUS_POLL_SECONDS, (0, 0.3), 2]
    assert 0 < agent.RENDEZVOUS_POLL_SECONDS < 1


def test_patching_twice_wraps_once(recorded):
    agent.poll_rendezvous_faster()
    dynamic_rendezvous._delay(seconds=1)
    assert recorded == [agent.RENDEZVOUS_POLL_SECONDS]
