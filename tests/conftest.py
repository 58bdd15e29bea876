import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tests use tiny shapes that gain nothing from intra-op threads; on a busy 2-core machine threads that
    wait for each other are many times slower. Spawned ranks set one thread themselves (tests/support/dist.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
