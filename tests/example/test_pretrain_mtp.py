"""Multi-token prediction in examples/pretrain/pretrain_hybrid.py (``--mtp-num-layers 1``) on converted tiny
Hugging Face checkpoints that carry a released-style MTP layer (DeepSeek-V3: MLA + MoE; Qwen3-Next: gated
attention + MoE), trained from ``--load``. Each layout's first iteration equals a single-rank run of the same
model and batch (relative 1e-4): the lm loss, the logged ``mtp_1 loss`` and the gradient norm (which includes
the MTP layer's parameters and the MTP loss's gradient through the whole model; under CP a known defect of the
MTP loss's gradient scale, marked below):

* DeepSeek-V3 at TP2 x CP2 with sequence parallelism (the MTP token shift crosses the CP ranks' zigzag shares);
* DeepSeek-V3 at EP2 x PP2 (the MTP block on the last stage, its embedding shared with the first stage's);
* Qwen3-Next with packed documents (``--reset-attention-mask``) at TP2 x CP2 with sequence parallelism (no
  prediction across a document end; reference: the same packing on one rank).

Two spawns: 4 ranks for the three layouts (each case streamed), 1 rank for both references.
"""
import pytest

from tests.support.converted_runs import example, example_argv, layouts_and_references, write_converted

MTP = ["--mtp-num-layers", "1"]
PACKED = ["--reset-position-ids", "--reset-attention-mask"]
TP2_CP2_SP = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]
REFERENCES = {"deepseek_v3": ("deepseek_v3", []), "qwen3_next_packed": ("qwen3_next", PACKED)}
LAYOUTS = {  # name: (reference, layout flags)
    "tp2_cp2_sp": ("deepseek_v3", TP2_CP2_SP),
    "ep2_pp2": ("deepseek_v3", ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2_cp2_sp_packed": ("qwen3_next_packed", TP2_CP2_SP),
}


def _argv(root, reference, extra=()):
    arch, flags = REFERENCES[reference]
    return example_argv(root, arch, *MTP, *flags, *extra)


@pytest.fixture(scope="module")
def root(pydoc_data, tmp_path_factory):
    """The data and the tiny DeepSeek-V3 / Qwen3-Next checkpoints with an MTP layer, converted with it."""
    return write_converted(str(tmp_path_factory.mktemp("pretrain_mtp")), pydoc_data, ("deepseek_v3", "qwen3_next"),
                           mtp_num_layers=1)


@pytest.fixture(scope="module")
def runs(root):
    """(layout reader: the last rank's first iteration, {reference: single-rank first iteration})."""
    return layouts_and_references({name: _argv(root, ref, flags) for name, (ref, flags) in LAYOUTS.items()},
                                  {name: _argv(root, name) for name in REFERENCES})


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", LAYOUTS)
def test_mtp_layout_first_iteration_losses_match_single_rank(runs, name):
    layout, single = runs
    got, ref = layout(name), single[LAYOUTS[name][0]]
    assert ref["mtp_1 loss"] > 0, ref
    for key in ("lm_loss", "mtp_1 loss"):
        assert _rel(got[key], ref[key]) <= 1e-4, (key, got, ref)


@pytest.mark.parametrize("name", LAYOUTS)
def test_mtp_layout_first_iteration_grad_norm_matches_single_rank(runs, name):
    layout, single = runs
    got, ref = layout(name), single[LAYOUTS[name][0]]
    assert _rel(got["grad_norm"], ref["grad_norm"]) <= 1e-4, (got, ref)


def test_mtp_flags_checked_at_parse_time(root):
    parse = example().parse_args
    args = parse(_argv(root, "deepseek_v3"))
    assert (args.mtp_num_layers, args.mtp_loss_scaling_factor) == (1, 0.1)  # Megatron-LM's default factor
    data = ["--data-path", f"{root}/data/pydoc_text_document", "--tokenizer", f"{root}/data/tokenizer.json"]
    assert parse(data).mtp_num_layers is None
    with pytest.raises(ValueError, match=r"^--mtp-num-layers 1 with --hp-layer-pattern KKKM: the MTP layers have "
                                         r"one fixed kind; add --hp-mtp-layer-symbol \(A or D or M\)$"):
        parse(data + MTP)
    with pytest.raises(ValueError, match=r"^KDA \(K, the multi-token-prediction layers' mixer of --hp-layer-pattern "
                                         r"KKKK\) cannot be megatron-core's MTP layer .*mixers with MTP: M=MLA, A="):
        parse(data + MTP + ["--hp-layer-pattern", "KKKK"])
    assert parse(data + MTP + ["--hp-mtp-layer-symbol", "A"]).hp_mtp_layer_symbol == "A"
    with pytest.raises(ValueError,
                       match=r"--hp-mtp-layer-symbol A conflicts with --hp-hf-config .*hp_mtp_layer_symbol M"):
        parse(_argv(root, "deepseek_v3", ["--hp-mtp-layer-symbol", "A"]))
