"""Multi-token prediction through Megatron-LM's own ``pretrain_gpt.py`` with our specs (``--mtp-num-layers 1``):
``train_qwen3_next_like.sh`` (``--spec hp_megatron.specs qwen3_next_spec``, whose MTP layers are gated attention
as Qwen3-Next's) on one rank and at CP2, on CPU/gloo as tests/megatron_lm/test_megatron_lm_pretrain.py. The CP2
run's first iteration equals the single rank's: lm loss and gradient norm (relative 1e-5, full precision from
tests/megatron_lm/record.py; the gradient norm under a known defect of the MTP gradient's scale under CP, marked
below) and the ``mtp_1 loss`` Megatron-LM logs (relative 1e-5 at its 7 printed digits);
no run reaches a CUDA call site that tests/megatron_lm/cpu_mode.py does not list. Needs Megatron-LM's training
code (MEGATRON_LM_PATH, default ../shared/megatron-lm).
"""
import re

import pytest

from tests.support.megatron_lm_runs import NO_SAVE, cuda_sites, run_script
from tests.support.paths import megatron_lm_skip

# Megatron-LM core_v0.16.1's training code: tests/megatron_lm/cpu_mode.py lists its CUDA call sites.
SKIP = megatron_lm_skip((0, 16))
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))

SCRIPT = "train_qwen3_next_like.sh"
DIMS = ["--kv-channels", "8", "--hp-linear-num-value-heads", "8", "--mtp-num-layers", "1"]
LAYOUTS = {"single": {}, "cp2": {"CP": "2", "CP_METHOD": "allgather"}}
# The single rank saves its checkpoint at exit; the CP2 run's would differ only in the distributed optimizer's
# sharding over CP, which the CP2 runs of test_megatron_lm_pretrain.py save.
SAVING = ("single",)


@pytest.fixture(scope="module")
def runs(data, sites_dir, tmp_path_factory):
    """``{layout: (first-iteration record, its log line, log)}`` and the CUDA-sites folder."""
    out = {}
    for name, env_vars in LAYOUTS.items():
        records, log = run_script(SCRIPT, DIMS, str(tmp_path_factory.mktemp(name)), sites_dir, {**data, **env_vars},
                                  ["--exit-interval", "1", "--eval-iters", "1", *([] if name in SAVING else NO_SAVE)])
        lines = re.findall(r"iteration\s+1/.*", log)
        assert len(records) == 1 and len(lines) == 1, log[-3000:]
        out[name] = (records[0], lines[0], log)
    return out, sites_dir


def _mtp_loss(line):
    found = re.findall(r"mtp_1 loss: ([0-9.E+-]+)", line)
    assert len(found) == 1, line
    return float(found[0])


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_mtp_through_megatron_lm_cp2_losses_match_single_rank(runs):
    (single, single_line, _), (cp2, cp2_line, cp2_log) = runs[0]["single"], runs[0]["cp2"]
    assert "context-parallel size: 2" in cp2_log
    assert _mtp_loss(single_line) > 0
    assert _rel(_mtp_loss(cp2_line), _mtp_loss(single_line)) <= 1e-5, (cp2_line, single_line)
    assert _rel(cp2["lm loss"], single["lm loss"]) <= 1e-5, (cp2, single)


def test_mtp_through_megatron_lm_cp2_grad_norm_matches_single_rank(runs):
    single, cp2 = runs[0]["single"][0], runs[0]["cp2"][0]
    assert _rel(cp2["grad_norm"], single["grad_norm"]) <= 1e-5, (cp2, single)


def test_mtp_runs_reach_only_listed_cuda_sites(runs):
    _, unlisted = cuda_sites(runs[1])
    assert not unlisted
