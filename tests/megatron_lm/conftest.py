"""The Megatron-LM launches' shared fixtures: the pydoc data with its HF tokenizer directory and the folder their
CUDA-site records go to, one each per test module (tests/support/megatron_lm_runs.py)."""
import pytest

from tests.support.megatron_lm_runs import write_data


@pytest.fixture(scope="module")
def data(pydoc_data, tmp_path_factory):
    """``{"DATA": prefix, "TOKENIZER": directory}``: the launch scripts' variables."""
    return write_data(pydoc_data, str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def sites_dir(tmp_path_factory):
    """The folder every launch of the module writes its ``sites-<pid>.json`` to (tests/megatron_lm/cpu_mode.py)."""
    return str(tmp_path_factory.mktemp("cuda_sites"))
