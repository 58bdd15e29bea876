"""examples/pretrain/pretrain_hybrid.py ``--model-class hybrid`` (megatron-core's HybridModel; skipped before 0.19)
against ``--model-class gpt`` on the same weights: tiny Kimi Linear (KDA + MLA, MoE) and Qwen3-Next (GDN + gated
attention, MoE, one MTP layer) transformers models converted twice (``hf-to-mcore`` and ``--model-class hybrid``).

* One rank: HybridModel's iteration losses and gradient norms equal GPTModel's (Qwen3-Next with MTP and packed
  documents: lm loss, ``mtp_1 loss``, grad norm; Kimi Linear after two optimizer steps: the migration case below).
* Four ranks, HybridModel: TP2 x CP2 + SP (Kimi Linear, against the one-rank GPTModel run; Qwen3-Next with MTP and
  packed documents) and EP2 x PP2 (Qwen3-Next with MTP: ``|`` in the derived pattern, the MTP block on the last
  stage): the first iteration equals the one-rank run (relative 1e-4).
* Resume: the Qwen3-Next (MTP) EP2 x PP2 run saves after iterations 2 and 3; resumed from iteration 2 on one rank,
  its iteration 3 equals the EP2 x PP2 run's (the layouts differ in that one iteration only; comparing with an
  uninterrupted one-rank run would compare two steps of layout rounding, which MoE routing and Adam amplify).
* Migration (``python -m hp_megatron.convert gpt-to-hybrid``): the one-rank GPTModel Kimi Linear run's checkpoint
  after iteration 2 (KDA, MLA, dense and MoE MLPs; weights and Adam state) resumed as HybridModel continues the GPT
  run's iteration 3 (relative 1e-6).
Two spawns (4 ranks, then 1 rank), every case streamed.
"""
import os

import pytest

from tests.support.converted_runs import example_argv, layouts_and_references, write_converted

try:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
except ImportError:  # megatron-core before 0.19
    HybridModel = None

pytestmark = pytest.mark.skipif(HybridModel is None, reason="megatron-core's HybridModel is 0.19+")

MTP = ["--mtp-num-layers", "1"]
PACKED = ["--reset-position-ids", "--reset-attention-mask"]
TP2_CP2_SP = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"]
EP2_PP2 = ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# reference name -> (architecture, flags); one-rank runs "<name>_<model class>" (the fixture's); those of COMPARED as
# both classes
REFERENCES = {"kimi": ("kimi_linear", []), "qwen_mtp": ("qwen3_next", MTP),
              "qwen_mtp_packed": ("qwen3_next", MTP + PACKED)}
COMPARED = ("qwen_mtp_packed",)
LAYOUTS = {  # name: (reference, layout flags), HybridModel
    "kimi_tp2_cp2_sp": ("kimi", TP2_CP2_SP),
    "qwen_mtp_ep2_pp2": ("qwen_mtp", EP2_PP2 + ["--train-iters", "3", "--save-interval", "2"]),
    "qwen_mtp_packed_tp2_cp2_sp": ("qwen_mtp_packed", TP2_CP2_SP),
}


def _argv(root, reference, model_class, extra=()):
    arch, flags = REFERENCES[reference]
    return example_argv(root, arch, *flags, *extra, model_class=model_class)


@pytest.fixture(scope="module")
def runs(pydoc_data, tmp_path_factory):
    """(layout reader: the last rank's iterations, {reference: one-rank iterations})."""
    root = write_converted(str(tmp_path_factory.mktemp("pretrain_hybrid_model")), pydoc_data, ("kimi_linear",),
                           model_classes=("gpt", "hybrid"))
    mtp_root = str(tmp_path_factory.mktemp("pretrain_hybrid_model_mtp"))
    write_converted(mtp_root, pydoc_data, ("qwen3_next",), mtp_num_layers=1, model_classes=("gpt", "hybrid"))
    roots = {"kimi": root, "qwen_mtp": mtp_root, "qwen_mtp_packed": mtp_root}
    saved = str(tmp_path_factory.mktemp("hybrid_saved"))
    layouts = {name: _argv(roots[ref], ref, "hybrid", flags) for name, (ref, flags) in LAYOUTS.items()}
    layouts["qwen_mtp_ep2_pp2"] += ["--save", saved]
    one_rank = (("qwen_mtp", "hybrid"), ("qwen_mtp_packed", "gpt"), ("qwen_mtp_packed", "hybrid"))
    references = {f"{ref}_{cls}": _argv(roots[ref], ref, cls) for ref, cls in one_rank}
    resumed = _argv(mtp_root, "qwen_mtp", "hybrid", ["--train-iters", "3"])
    resumed[resumed.index("--load") + 1] = saved
    references["resumed"] = resumed
    gpt_saved, migrated = str(tmp_path_factory.mktemp("gpt_saved")), str(tmp_path_factory.mktemp("migrated"))
    references = {"kimi_gpt": _argv(root, "kimi", "gpt", ["--train-iters", "3", "--save", gpt_saved,
                                                          "--save-interval", "2"]), **references}
    references["migrate"] = ["convert", "gpt-to-hybrid", "--load", os.path.join(gpt_saved, "iter_0000002"),
                             "--save", migrated, "--overwrite"]
    from_gpt = _argv(root, "kimi", "hybrid", ["--train-iters", "3"])
    from_gpt[from_gpt.index("--load") + 1] = migrated
    references["resumed_from_gpt"] = from_gpt

    def resume_from_iteration_2():   # the run saved iterations 2 and 3; the tracker names the latest
        with open(os.path.join(saved, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")

    return layouts_and_references(layouts, references, every=True, between=resume_from_iteration_2)


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("reference", COMPARED)
def test_hybrid_model_run_equals_gpt_model_run(runs, reference):
    _, single = runs
    gpt, hybrid = single[f"{reference}_gpt"], single[f"{reference}_hybrid"]
    assert len(hybrid) == len(gpt) == 1
    keys = ("lm_loss", "grad_norm") + (("mtp_1 loss",) if "mtp" in reference else ())
    for got, ref in zip(hybrid, gpt):
        assert got["iteration"] == ref["iteration"]
        for key in keys:
            assert ref[key] > 0 and _rel(got[key], ref[key]) <= 1e-5, (key, got, ref)


@pytest.mark.parametrize("name", LAYOUTS)
def test_hybrid_model_layout_equals_one_rank(runs, name):
    layout, single = runs
    reference = LAYOUTS[name][0]
    got, ref = layout(name)[0], single[f"{reference}_{'gpt' if reference == 'kimi' else 'hybrid'}"][0]
    for key in ("lm_loss", "grad_norm") + (("mtp_1 loss",) if "mtp" in name else ()):
        assert _rel(got[key], ref[key]) <= 1e-4, (key, got, ref)


def test_hybrid_model_resume_at_another_layout_continues_the_losses(runs):
    layout, single = runs
    saved, resumed = layout("qwen_mtp_ep2_pp2"), single["resumed"]
    assert [h["iteration"] for h in saved] == [1, 2, 3] and [h["iteration"] for h in resumed] == [3]
    for key in ("lm_loss", "grad_norm", "mtp_1 loss"):
        assert _rel(resumed[0][key], saved[2][key]) <= 1e-4, (key, resumed, saved)


def test_migrated_gpt_checkpoint_resumes_as_hybrid_model(runs):
    _, single = runs
    assert single["migrate"] == 0
    gpt, resumed = single["kimi_gpt"], single["resumed_from_gpt"]
    assert [h["iteration"] for h in gpt] == [1, 2, 3] and [h["iteration"] for h in resumed] == [3]
    for key in ("lm_loss", "grad_norm"):
        assert _rel(resumed[0][key], gpt[2][key]) <= 1e-6, (key, resumed, gpt)


def test_model_class_flags_checked_at_parse_time(pydoc_data):
    from tests.support.converted_runs import example

    parse = example().parse_args
    data = ["--data-path", f"{pydoc_data}/pydoc_text_document", "--tokenizer", f"{pydoc_data}/tokenizer.json"]
    assert parse(data).model_class == "gpt"
    args = parse(data + ["--model-class", "hybrid", "--hybrid-layer-pattern", "G-GE|*-*E/*E",
                         "--num-experts", "4"])
    assert (args.num_layers, args.hp_layer_pattern) == (4, "GGAA")
    assert (args.mtp_num_layers, args.hp_mtp_layer_symbol) == (1, "A")
    args = parse(data + ["--model-class", "hybrid", "--hybrid-layer-pattern", "G-G-+-", "--hp-layer-pattern", "KGM"])
    assert (args.num_layers, args.hp_layer_pattern) == (3, "KGM")
    with pytest.raises(ValueError, match=r"^--hybrid-layer-pattern G-\*- is for --model-class hybrid"):
        parse(data + ["--hybrid-layer-pattern", "G-*-"])
    with pytest.raises(ValueError, match=r"^--hp-layer-pattern KM \(HybridModel layers G\+\) does not match the mixer "
                                         r"layers G\* of --hybrid-layer-pattern G-\*-$"):
        parse(data + ["--model-class", "hybrid", "--hybrid-layer-pattern", "G-*-", "--hp-layer-pattern", "KM"])
    with pytest.raises(ValueError, match=r"^--num-layers 4 conflicts with --hybrid-layer-pattern G-\*- \(2 mixer"):
        parse(data + ["--model-class", "hybrid", "--hybrid-layer-pattern", "G-*-", "--num-layers", "4"])
    with pytest.raises(ValueError, match=r"^--model-class hybrid: the layer pattern GKMA has attention and MLA layers, "
                                         r"which megatron-core's HybridModel refuses in one model"):
        parse(data + ["--model-class", "hybrid", "--hp-layer-pattern", "GKMA"])
    with pytest.raises(ValueError, match=r"^--hybrid-layer-pattern G-\*E has MoE layers \(E\) but no --num-experts is"):
        parse(data + ["--model-class", "hybrid", "--hybrid-layer-pattern", "G-*E"])
    with pytest.raises(ValueError, match=r"symbols \['M'\] have none of our layers"):
        parse(data + ["--model-class", "hybrid", "--hybrid-layer-pattern", "M-*-"])
