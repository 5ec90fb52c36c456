"""Fixtures of the end-to-end fault tests: real PostgreSQL (committed data, ``transaction=True``), real Redis,
our real HTTP API on pytest-django's live server, the provider simulator and the gateway client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from budgeting.provisioning.apply import apply_config
from budgeting.provisioning.source import load_file
from simulation.provider import Simulator
from tests.e2e_faults.harness import DEMO, Platform, point_pools_at


@pytest.fixture
def sim() -> Iterator[Simulator]:
    simulator = Simulator(seed=11, max_words_per_chunk=3)
    simulator.start()
    yield simulator
    simulator.stop()


@pytest.fixture
def platform(live_server, redis_db, sim: Simulator) -> Platform:
    """The demo configuration applied, its pools' provider adapter pointed at the simulator."""
    apply_config(load_file(DEMO))
    point_pools_at(sim.base_url)
    return Platform(api_url=live_server.url, sim=sim)
