"""What every test folder shares: one torch thread per test process and the single-rank megatron fixture."""
import pytest
import torch

from hp_megatron.platform import single_rank_megatron
from tests.support.dist import select_shared_modules


def pytest_collection_finish(session):
    """Shared spawns (tests/support/dist.py ``share_spawn``) run only the jobs of modules with selected tests."""
    select_shared_modules({item.module.__name__ for item in session.items if getattr(item, "module", None)})


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tests use tiny shapes that gain nothing from intra-op threads; on a busy 2-core machine threads that
    wait for each other are many times slower. Spawned ranks set one thread themselves (tests/support/dist.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def single_rank():
    """One process as a whole megatron-core world for a test module: a one-rank gloo group (yielded), megatron's
    parallel state at TP=PP=CP=EP=1 and the CPU shims, torch's RNG seeded 0 (hp_megatron.platform)."""
    with single_rank_megatron(0) as group:
        yield group
