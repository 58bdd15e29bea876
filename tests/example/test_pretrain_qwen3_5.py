"""Qwen3.5 in examples/pretrain/pretrain_hybrid.py, trained from converted tiny Hugging Face checkpoints
(``--hp-hf-config HF_DIR --load CKPT``): each layout's first iteration equals a single-rank run of the same model
and batch (relative 1e-4): the lm loss and the gradient norm (megatron-core DDP's data / expert-data-parallel
reductions, the norm over dense and expert parameters).

* dense Qwen3.5 (``qwen3_5_text``) at TP2 x CP2 with sequence parallelism;
* the Qwen3.5-MoE VL checkpoint (``qwen3_5_moe``: its language model; the vision tower dropped in the conversion)
  at TP2 x CP2 + SP x EP2 (experts whole, ``--expert-tensor-parallel-size 1``: expert data parallel 2);
* packed documents (``--reset-position-ids --reset-attention-mask --eod-mask-loss --calculate-per-token-loss``: without
  the last, Megatron's default divides each CP rank's loss by its own token count, which the EOD mask makes unequal,
  so the gradient is not the single rank's: about 10% off in grad norm here) for Qwen3.5-MoE
  (``qwen3_5_moe_text``) at CP4 with every CP method of the GDN layers and at TP2 x CP2 + SP, against the same
  packing on one rank. The data are short documents (3 to 20 tokens, so every 32-token sample holds several and
  documents cross CP ranks' shares), written for this module from the pydoc dataset's tokens.

Two spawns: 4 ranks for every layout (each case streamed, so a failing layout fails its own test only), 1 rank for
the three references.
"""
import os

import pytest

from tests.support.converted_runs import example_argv, layouts_and_references, write_converted
from tests.support.short_documents import write_short_documents

CP_METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling", "ulysses")
# the global token mean (Megatron's default weighs each CP rank by its own loss-token count, unequal here)
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--calculate-per-token-loss"]
TP2_CP2_SP = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]
REFERENCES = {"dense": ("qwen3_5_text", []), "moe_vl": ("qwen3_5_moe", []), "moe_packed": ("qwen3_5_moe_text", PACKED)}
LAYOUTS = {  # name: (reference, layout flags)
    "dense_tp2_cp2_sp": ("dense", TP2_CP2_SP),
    "moe_vl_tp2_cp2_sp_ep2": ("moe_vl", TP2_CP2_SP + ["--expert-model-parallel-size", "2",
                                                      "--expert-tensor-parallel-size", "1"]),
    **{f"moe_packed_cp4_{method}": ("moe_packed", ["--context-parallel-size", "4", "--hp-cp-method", method,
                                                   *(["--hp-cp-group-size", "2"] if method == "grouped_allgather_p2p"
                                                     else [])])
       for method in CP_METHODS},
    "moe_packed_tp2_cp2_sp": ("moe_packed", TP2_CP2_SP),
}


@pytest.fixture(scope="module")
def root(pydoc_data, tmp_path_factory):
    """The short-document data and the three converted tiny Qwen3.5 checkpoints."""
    top = tmp_path_factory.mktemp("pretrain_qwen3_5")
    data = write_short_documents(pydoc_data, str(top / "short_documents"))
    os.makedirs(top / "run")
    return write_converted(str(top / "run"), data, sorted({arch for arch, _ in REFERENCES.values()}))


def _argv(root, reference, extra=()):
    arch, flags = REFERENCES[reference]
    return example_argv(root, arch, *flags, *extra, "--global-batch-size", "2")   # two micro-batches: half the time


@pytest.fixture(scope="module")
def runs(root):
    """(layout reader: the last rank's first iteration, {reference: single-rank first iteration})."""
    return layouts_and_references({name: _argv(root, ref, flags) for name, (ref, flags) in LAYOUTS.items()},
                                  {name: _argv(root, name) for name in REFERENCES})


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_first_iteration_matches_single_rank(runs, name):
    layout, single = runs
    got, ref = layout(name), single[LAYOUTS[name][0]]
    for key in ("lm_loss", "grad_norm"):
        assert _rel(got[key], ref[key]) <= 1e-4, (key, got, ref)
