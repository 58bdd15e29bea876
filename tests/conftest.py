"""What every test folder shares: one torch thread per test process, the single-rank megatron fixture and the
example's pydoc dataset."""
import sys

import pytest
import torch

from hp_megatron.platform import single_rank_megatron
from tests.support import background
from tests.support.dist import select_shared_modules
from tests.support.paths import EXAMPLE


def pytest_collection_modifyitems(items):
    """Tests that await a background run (tests/support/background.py) go last, giving the run the whole session."""
    items[:] = background.last(items)


def pytest_collection_finish(session):
    """Shared spawns (tests/support/dist.py ``share_spawn``) run only the jobs of modules with selected tests, and
    those modules' background runs start now (tests/support/background.py)."""
    modules = {item.module.__name__ for item in session.items if getattr(item, "module", None)}
    select_shared_modules(modules)
    background.start_selected(modules)


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


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory):
    """The folder of examples/pretrain/prepare_data.py's pydoc dataset at vocabulary 512 (``tokenizer.json``,
    ``pydoc_text_document.{bin,idx}``), built once per session for every test that trains on it. Tests only
    read it; runs on it add megatron-core's GPTDataset index cache there (file names keyed by their settings)."""
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    from prepare_data import build

    path = str(tmp_path_factory.mktemp("pydoc512"))
    build(path, vocab_size=512)
    return path
