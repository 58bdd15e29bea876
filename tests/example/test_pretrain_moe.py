"""Expert parallelism in examples/pretrain/pretrain_hybrid.py on converted tiny Hugging Face checkpoints.

Tiny random Qwen3-Next (softmax router, shared-expert gate; trained here with megatron-core's aux loss,
``--moe-aux-loss-coeff``) and DeepSeek-V3 (grouped sigmoid router with expert bias, aux-loss-free balancing),
converted with ``hp_megatron.convert`` and trained from ``--load``. Each layout's first iteration equals a
single-rank run of the same model (relative 1e-4): the lm loss, the gradient norm (megatron-core DDP's
data-parallel and expert-data-parallel reductions, the norm over dense and expert parameters), the logged
load-balancing loss and the expert-bias update (the router loads all-reduced before the update):

* DeepSeek-V3 at EP2 on 4 ranks (DP4, each expert on 2 data-parallel ranks) and at EP2 x PP2;
* Qwen3-Next at EP2 x TP2 with sequence parallelism, experts split over TP too (ETP2, the default) and whole
  (``--expert-tensor-parallel-size 1``: expert data parallel 2);
* the dense OLMo-Hybrid (GDN with negative eigenvalues, post-norm attention with whole-projection q/k norms) at
  TP2 x CP2 with sequence parallelism;
* Ling 3.0 (KDA + output-gated MLA, grouped sigmoid router with expert bias, clipped SwiGLU experts) at EP2 and at
  TP2 x CP2 with sequence parallelism, and with packed documents (``--reset-position-ids --reset-attention-mask
  --eod-mask-loss``) at CP2 with the KDA CP methods ``p2p`` and ``ulysses`` against one rank with the same flags,
  and with its multi-token-prediction layer (a released-style ``model.layers.<num_hidden_layers>.*`` MLA + MoE layer,
  converted and trained with ``--mtp-num-layers 1``) at TP2 x CP2 with sequence parallelism: also the logged
  ``mtp_1 loss``;
all in the same two spawns.

Two spawns: 4 ranks for the three layouts (each case streamed, so a failing layout fails its own test only),
1 rank for both references. The flags' checks (EP not dividing the experts, EP without experts...) are parse-time
cases without a launch.
"""
import os

import pytest

from tests.support.converted_runs import example, example_argv, layouts_and_references, write_converted

LING_MTP = "bailing_hybrid_mtp"   # the tiny Ling 3.0 with an MTP layer (<root>/bailing_hybrid_mtp_{hf,ckpt})
ARCH_FLAGS = {"deepseek_v3": [], "qwen3_next": ["--moe-aux-loss-coeff", "1e-2"], "olmo_hybrid": [],
              "bailing_hybrid": [], LING_MTP: ["--mtp-num-layers", "1"]}
# 128 tokens and seed 1: the first global batch holds a document end (test_packed_batch_crosses_a_document_end);
# per-token loss: with --eod-mask-loss the CP ranks hold different numbers of loss tokens, and only the global
# token mean is the one-rank gradient (Megatron's default averages each rank's own mean)
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--calculate-per-token-loss",
          "--seq-length", "128", "--seed", "1"]
# single-rank references beyond each architecture's plain run: {name: (arch, flags)}
REFERENCES = {"bailing_hybrid_packed": ("bailing_hybrid", PACKED)}
LAYOUTS = {
    "ep2": ("deepseek_v3", ["--expert-model-parallel-size", "2"]),
    "ep2_pp2": ("deepseek_v3", ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "ep2_tp2": ("qwen3_next", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel"]),
    "ep2_tp2_etp1": ("qwen3_next", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                    "--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
    "olmo_hybrid_tp2_cp2": ("olmo_hybrid", ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                            "--sequence-parallel"]),
    "ling_ep2": ("bailing_hybrid", ["--expert-model-parallel-size", "2"]),
    "ling_tp2_cp2": ("bailing_hybrid", ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                        "--sequence-parallel"]),
    "ling_packed_cp2_p2p": ("bailing_hybrid", ["--context-parallel-size", "2", "--hp-cp-method", "p2p", *PACKED]),
    "ling_packed_cp2_ulysses": ("bailing_hybrid", ["--context-parallel-size", "2", "--hp-cp-method", "ulysses",
                                                   *PACKED]),
    "ling_mtp_tp2_cp2": (LING_MTP, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                    "--sequence-parallel"]),
}
REFERENCE_OF = {"ling_packed_cp2_p2p": "bailing_hybrid_packed", "ling_packed_cp2_ulysses": "bailing_hybrid_packed"}


def _argv(root, arch, extra=()):
    return example_argv(root, arch, *ARCH_FLAGS[arch], *extra)


@pytest.fixture(scope="module")
def root(pydoc_data, tmp_path_factory):
    """The data and, per architecture, the tiny HF checkpoint and its conversion; Ling also with an MTP layer."""
    from prepare_data import BPETokenizer

    from tests.support.models_case import converted_tiny_model

    root = write_converted(str(tmp_path_factory.mktemp("pretrain_moe")), pydoc_data,
                           [arch for arch in ARCH_FLAGS if arch != LING_MTP])
    vocab = BPETokenizer(os.path.join(root, "data", "tokenizer.json")).vocab_size
    converted_tiny_model("bailing_hybrid", os.path.join(root, f"{LING_MTP}_hf"), os.path.join(root, f"{LING_MTP}_ckpt"),
                         seed=3, vocab_size=vocab, mtp_num_layers=1, mtp_seed=4)
    return root


@pytest.fixture(scope="module")
def runs(root):
    """(layout reader: the last rank's first iteration, {arch: single-rank first iteration})."""
    references = {arch: _argv(root, arch) for arch in ARCH_FLAGS}
    references.update({name: _argv(root, arch, flags) for name, (arch, flags) in REFERENCES.items()})
    return layouts_and_references({name: _argv(root, arch, flags) for name, (arch, flags) in LAYOUTS.items()},
                                  references)


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_first_iteration_matches_single_rank(runs, name):
    layout, single = runs
    got, ref = layout(name), single[REFERENCE_OF.get(name, LAYOUTS[name][0])]
    for key in ("lm_loss", "grad_norm"):
        assert _rel(got[key], ref[key]) <= 1e-4, (key, got, ref)
    if LAYOUTS[name][0] == "olmo_hybrid":  # dense
        assert "load_balancing_loss" not in ref and "expert bias update" not in ref, ref
    elif LAYOUTS[name][0] == "qwen3_next":  # softmax router with the aux loss
        assert ref["load_balancing_loss"] > 0 and "expert bias update" not in ref, ref
        assert _rel(got["load_balancing_loss"], ref["load_balancing_loss"]) <= 1e-4, (got, ref)
    else:  # sigmoid router with expert bias, no aux loss: every expert's bias moved by the rate (none at the mean)
        assert "load_balancing_loss" not in ref, ref
        assert ref["expert bias update"] == pytest.approx(1e-3, rel=1e-4), ref
        assert got["expert bias update"] == pytest.approx(ref["expert bias update"], rel=1e-6), (got, ref)


def test_ling_mtp_loss_matches_single_rank(runs):
    """Ling's MTP layer trains at TP2 x CP2 + SP: the logged depth-1 loss is the single rank's."""
    layout, single = runs
    got, ref = layout("ling_mtp_tp2_cp2"), single[LING_MTP]
    assert ref["mtp_1 loss"] > 0 and "mtp_1 loss" not in single["bailing_hybrid"], (ref, single["bailing_hybrid"])
    assert _rel(got["mtp_1 loss"], ref["mtp_1 loss"]) <= 1e-4, (got, ref)


def test_packed_batch_crosses_a_document_end(root):
    """The packed runs' first global batch (what their first iteration trains on) has a document end inside a
    sample, so the CP layouts split documents and restart positions there."""
    import torch

    from prepare_data import BPETokenizer
    from pretrain_hybrid import build_datasets

    args = example().parse_args(_argv(root, "bailing_hybrid", PACKED))
    train, _ = build_datasets(args, BPETokenizer(args.tokenizer))
    restarts = sum(int((torch.as_tensor(train[i]["position_ids"])[1:] == 0).sum())
                   for i in range(args.global_batch_size))
    assert restarts >= 1


def _parse(root, arch, flags, world_size):
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        return example().parse_args(_argv(root, arch, flags))
    finally:
        if old is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = old


def test_moe_flags_checked_at_parse_time(root):
    args = _parse(root, "qwen3_next", ["--expert-model-parallel-size", "4"], 4)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.expert_tensor_parallel_size,
            args.moe_aux_loss_coeff, args.moe_router_load_balancing_type) == (4, 2, 16, 1, 1e-2, "aux_loss")
    with pytest.raises(ValueError, match=r"^--num-experts 8 is not divisible by --expert-model-parallel-size 3$"):
        _parse(root, "deepseek_v3", ["--expert-model-parallel-size", "3", "--global-batch-size", "12"], 3)
    with pytest.raises(ValueError, match=r"--num-experts 6 conflicts with --hp-hf-config .*num_experts 4"):
        _parse(root, "qwen3_next", ["--num-experts", "6"], 1)
    with pytest.raises(ValueError, match=r"needs --sequence-parallel"):
        _parse(root, "qwen3_next", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 4)
    pretrain_hybrid = example()  # the flags' own model (no --hp-hf-config): dense unless --num-experts
    base = ["--data-path", f"{root}/data/pydoc_text_document", "--tokenizer", f"{root}/data/tokenizer.json"]
    with pytest.raises(ValueError, match=r"^--expert-model-parallel-size 2 needs a model with experts "
                                         r"\(no --num-experts\)$"):
        pretrain_hybrid.parse_args(base + ["--expert-model-parallel-size", "2"])
    with pytest.raises(ValueError, match=r"--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"):
        pretrain_hybrid.parse_args(base + ["--num-experts", "4", "--moe-router-enable-expert-bias"])
    args = pretrain_hybrid.parse_args(base + ["--num-experts", "4", "--ffn-hidden-size", "96"])
    assert (args.moe_ffn_hidden_size, args.moe_router_topk, args.expert_model_parallel_size) == (96, 2, 1)
