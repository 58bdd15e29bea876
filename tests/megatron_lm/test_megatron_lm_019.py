"""Megatron-LM 0.19's own ``pretrain_gpt.py`` (GPTModel) and ``pretrain_hybrid.py`` (megatron-core's HybridModel) with
our layers, through the documented launch scripts, on CPU/gloo.

Every run but one is ``bash examples/pretrain/megatron_lm/train_*.sh`` (torchrun -> pretrain_gpt_hp.py /
pretrain_hybrid_hp.py -> Megatron-LM's ``pretrain``) with tiny dims and the CPU flags of docs/usage.md, in the CPU
mode of tests/megatron_lm/cpu_mode.py (its core_v0.19.0 site table). Three models:

* ``gpt``: ``pretrain_gpt.py --spec hp_megatron.specs kimi_linear_spec`` (KKKM: our KDA and MLA);
* ``hybrid_kda``: ``pretrain_hybrid.py --spec hp_megatron.specs kda_hybrid_stack_spec --hybrid-layer-pattern
  G-G-G-+-`` (our KDA in the ``G`` slot, our MLA in ``+``, MLP layers ``-``);
* ``hybrid_kda_mtp``: the same with an MTP part, ``--hybrid-layer-pattern G-G-G-+-/+-`` (one MTP depth of MLA +
  MLP: our ``MTPHybridModel``, examples/pretrain/megatron_lm/hp_hybrid_model.py);
* ``hybrid_gdn``: ``--spec hp_megatron.specs hybrid_stack_spec --hybrid-layer-pattern G-G-G-*-`` (our GDN, RoPE
  attention with GQA); its reference is Megatron-LM's unmodified ``pretrain_hybrid.py`` with Megatron-LM's own
  flags (``--linear-*`` for the GDN dims, no ``--hp-*`` flag).

Fourteen launches, each feeding the tests named:

* ``gpt`` reference, one rank: 3 iterations, evaluation at 2, torch_dist checkpoints at 2 and 3 (trains, evaluates
  and saves; the example's first loss; the iterations TP2 / CP2 compare with);
* ``gpt`` TP2 (sequence parallel) from scratch, its first iteration, saving its TP-sharded checkpoint at exit;
* ``gpt`` CP2 (allgather) resumed from the reference's iteration-2 checkpoint (weights only: ``--no-load-optim
  --no-load-rng``), its iteration 3: pretrain_gpt.py's CP2 and checkpoint resume;
* ``hybrid_kda`` reference, one rank, as ``gpt``'s (pretrain_hybrid.py with our KDA / MLA stack trains, evaluates,
  saves; the HybridModel it builds), its TP2 from scratch and its CP2 (allgather) and PP2 (HybridModel's two
  pipeline stages, the pattern split in halves) resumed from the reference's iteration-2 checkpoint:
  pretrain_hybrid.py's TP2, CP2, PP2 and checkpoint resume across layouts (PP from scratch draws megatron's
  initial weights in another RNG order, docs/usage.md, so PP2 is compared on the same loaded weights);
* ``hybrid_kda_mtp`` one rank and CP2 (allgather), their first iteration: = the example's MTP losses, CP2 = one
  rank;
* ``hybrid_gdn`` reference: the unmodified script's first iteration (builds our stack from ``--spec`` alone);
* ``hybrid_gdn`` TP2 and CP2 (``p2p``) from scratch through the launch script, their first iteration:
  pretrain_hybrid.py's TP2 and CP2;
* ``hybrid_gdn_packed``: the same model on short documents, packed (``--reset-position-ids --reset-attention-mask
  --eod-mask-loss --calculate-per-token-loss``: our THD rows, hp_packed.py), one rank and CP2 (``p2p``).

Loss and gradient norm equal the single rank's (relative 1e-5, full precision from tests/megatron_lm/record.py); the
GPT path's first loss equals examples/pretrain/pretrain_hybrid.py's; every listed CUDA site is reached, no unlisted
one. 2:00 wall on an idle 2-core machine.
Skips unless the installed megatron-core is 0.19.x with its Megatron-LM checkout (tests/support/paths.py).
"""
import os
import re
import sys

import pytest

from tests.support.megatron_lm_runs import (GBS, ITERS, LR, NORM_EPS, NO_SAVE, SEQ, cuda_sites, example_first_loss,
                                            example_first_record, launched_once, run_megatron_lm_entry, run_script,
                                            write_data)
from tests.support.paths import megatron_lm_skip
from tests.support.short_documents import write_short_documents

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cpu_mode

SKIP = megatron_lm_skip((0, 19))
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))

# packed documents as our THD rows (hp_packed.py); the global token mean (each CP rank's own count is unequal here)
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--calculate-per-token-loss"]
MLA_DIMS = ["--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "8"]
# name -> (script, model flags, {parallel layout: (env, resumed from the reference's iteration 2)}, the reference:
# "full" (the script: 3 iterations, evaluation, checkpoints), "first" (the script's iteration 1) or "unmodified"
# (Megatron-LM's own pretrain_hybrid.py, iteration 1))
MODELS = {
    "gpt": ("train_kimi_linear_like.sh",
            ["--hp-mla-kv-lora-rank", "16", "--hp-mla-qk-head-dim", "8", "--hp-mla-qk-pos-emb-head-dim", "8",
             "--hp-mla-v-head-dim", "8"],
            {"tp2": ({"TP": "2"}, False), "cp2": ({"CP": "2", "CP_METHOD": "allgather"}, True)}, "full"),
    "hybrid_kda": ("train_kimi_linear_like_hybrid.sh", ["--hybrid-layer-pattern", "G-G-G-+-", *MLA_DIMS],
                   {"tp2": ({"TP": "2"}, False), "cp2": ({"CP": "2", "CP_METHOD": "allgather"}, True),
                    "pp2": ({"PP": "2"}, True)}, "full"),
    "hybrid_kda_mtp": ("train_kimi_linear_like_hybrid.sh", ["--hybrid-layer-pattern", "G-G-G-+-/+-", *MLA_DIMS],
                       {"cp2": ({"CP": "2", "CP_METHOD": "allgather"}, False)}, "first"),
    "hybrid_gdn": ("train_qwen3_next_like_hybrid.sh",
                   ["--hybrid-layer-pattern", "G-G-G-*-", "--kv-channels", "8", "--hp-linear-num-value-heads", "8"],
                   {"tp2": ({"TP": "2"}, False), "cp2": ({"CP": "2", "CP_METHOD": "p2p"}, False)}, "unmodified"),
    "hybrid_gdn_packed": ("train_qwen3_next_like_hybrid.sh",
                          ["--hybrid-layer-pattern", "G-G-G-*-", "--kv-channels", "8", "--hp-linear-num-value-heads",
                           "8", *PACKED],
                          {"cp2": ({"CP": "2", "CP_METHOD": "p2p"}, False)}, "first"),
}
PACKED_MODELS = ("hybrid_gdn_packed",)   # trained on short documents (several per sample)
SAVING = ("gpt", "tp2")  # the one parallel run that saves (TP-sharded) at exit; the others' saves repeat it
RESUME = ["--ckpt-step", "2", "--no-load-optim", "--no-load-rng", "--eval-iters", "1", *NO_SAVE]
FIRST = ["--exit-interval", "1", "--eval-iters", "1"]


def _unmodified_hybrid_argv(data):
    """Megatron-LM's own flags for the model of train_qwen3_next_like_hybrid.sh with hybrid_gdn's dims (our GDN's
    dims as megatron-core's --linear-* flags, no --hp-* flag: the layers' defaults), the same data, batch, seed and
    first iteration."""
    return ["--spec", "hp_megatron.specs", "hybrid_stack_spec", "--hybrid-layer-pattern", "G-G-G-*-",
            "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "8",
            "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
            "--rotary-base", "10000000", "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
            "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4",
            *NORM_EPS, "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
            "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--lr", str(LR), "--lr-warmup-iters", "0",
            "--use-distributed-optimizer", "--data-path", data["DATA"], "--split", "99,1,0",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data["TOKENIZER"],
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--exit-interval", "1"]


@pytest.fixture(scope="module")
def runs(data, pydoc_data, sites_dir, tmp_path_factory):
    """``runs(model)``: ``{"ref" | layout: (records, log)}``, launched once per module (``PACKED_MODELS`` on short
    documents: tests/support/short_documents.py)."""
    def launch(model):
        model_data = data
        if model in PACKED_MODELS:
            short = write_short_documents(pydoc_data, str(tmp_path_factory.mktemp("short") / "documents"))
            model_data = write_data(short, str(tmp_path_factory.mktemp("short_tokenizer")))
        return _launch_all(model, model_data, sites_dir, tmp_path_factory)
    return launched_once(launch)


def _launch_all(model, data, sites_dir, tmp_path_factory):
    script, dims, layouts, reference = MODELS[model]
    ref_dir = str(tmp_path_factory.mktemp(f"{model}_ref"))
    if reference == "full":
        out = {"ref": run_script(script, dims, ref_dir, sites_dir, {**data, "SAVE_INTERVAL": "2"},
                                 ["--eval-interval", "2", "--eval-iters", "1"])}
    elif reference == "first":
        out = {"ref": run_script(script, dims, ref_dir, sites_dir, data, [*FIRST, *NO_SAVE])}
    else:
        out = {"ref": run_megatron_lm_entry("pretrain_hybrid.py", _unmodified_hybrid_argv(data), ref_dir, sites_dir)}
    for name, (env_vars, resumed) in layouts.items():
        if resumed:  # the reference's checkpoint directory: CKPT makes common.sh pass --load
            out[name] = run_script(script, dims, ref_dir, sites_dir, {**data, **env_vars}, RESUME)
        else:
            saves = (model, name) == SAVING
            out[name] = run_script(script, dims, str(tmp_path_factory.mktemp(f"{model}_{name}")), sites_dir,
                                   {**data, **env_vars}, [*FIRST, *([] if saves else NO_SAVE)])
    return out


def _rel(a, b):
    return abs(a - b) / abs(b)


def _parallel_cases():
    return [(model, name) for model, (_, _, layouts, _) in MODELS.items() for name in layouts]


@pytest.mark.parametrize("model,layout", _parallel_cases())
def test_parallel_iteration_matches_single_rank(runs, model, layout):
    """TP2 from scratch: iteration 1; CP2 resumed from iteration 2: iteration 3 (fresh optimizer: the loss and
    gradient norm depend only on the loaded weights and the data)."""
    (ref, _), (got, log) = runs(model)["ref"], runs(model)[layout]
    resumed = MODELS[model][2][layout][1]
    iteration = 3 if resumed else 1
    assert [r["iteration"] for r in got] == [iteration], got
    want = ref[iteration - 1]
    assert _rel(got[0]["lm loss"], want["lm loss"]) <= 1e-5, (got[0], want)
    assert _rel(got[0]["grad_norm"], want["grad_norm"]) <= 1e-5, (got[0], want)
    size = {"tp2": "tensor-model-parallel size: 2", "cp2": "context-parallel size: 2",
            "pp2": "pipeline-model-parallel size: 2"}[layout]
    assert size in log
    if layout == "pp2":   # HybridModel's two stages, each its half of the pattern
        pattern = MODELS[model][1][1]
        for rank, part in enumerate((pattern[:len(pattern) // 2], pattern[len(pattern) // 2:])):
            assert f"HybridModel: pp_rank={rank}/2" in log and f"layers='{part}'" in log, log[-3000:]
    if resumed:
        assert "successfully loaded checkpoint" in log and "at iteration 2" in log, log[-3000:]


@pytest.mark.parametrize("model", [model for model, spec in MODELS.items() if spec[3] == "full"])
def test_reference_trains_evaluates_and_saves(runs, model):
    ref, log = runs(model)["ref"]
    assert [r["iteration"] for r in ref] == [1, 2, 3]
    assert "validation loss at iteration 2" in log
    assert "successfully saved checkpoint from iteration       2" in log
    assert re.search(r"^\s+load \.+ None$", log, re.M), "common.sh passed --load without a checkpoint"


def test_tp2_run_saves_its_sharded_checkpoint(runs):
    _, log = runs(SAVING[0])[SAVING[1]]
    assert "successfully saved checkpoint from iteration       1" in log and "[ t 1/2" in log, log[-3000:]


@pytest.mark.parametrize("model", ["hybrid_kda", "hybrid_kda_mtp", "hybrid_gdn", "hybrid_gdn_packed"])
def test_hybrid_runs_build_hybrid_model_from_the_pattern(runs, model):
    """megatron-core's HybridModel logs the layers it builds from --hybrid-layer-pattern (which of our layers fill
    its slots: tests/integration/test_hybrid_stack_specs.py)."""
    _, log = runs(model)["ref"]
    pattern = MODELS[model][1][1].split("/")[0]   # the decoder's layers (MTP parts: the MTP block's)
    assert f"HybridModel: pp_rank=0/1, vp_stage=0, segment_index=0/1, layers='{pattern}' ({len(pattern)} layers)" \
        in log, log[-3000:]


def test_gpt_first_loss_matches_the_example(runs, data):
    """pretrain_gpt.py's KKKM model (our PatternLayer spec) and examples/pretrain/pretrain_hybrid.py's on the same
    dims, data and split: the same first loss (the GPT path of 0.19 builds what the example builds)."""
    ref, _ = runs("gpt")["ref"]
    example = example_first_loss("KKKM", data, ["--hp-mla-cp-strategy", "latent", "--hp-mla-rope-type", "none"])
    assert _rel(ref[0]["lm loss"], example) <= 1e-5, (ref[0], example)


def _mtp_loss(log):
    found = re.findall(r"iteration\s+1/.*mtp_1 loss: ([0-9.E+-]+)", log)
    assert len(found) == 1, log[-3000:]
    return float(found[0])


def test_hybrid_mtp_matches_the_example(runs, data):
    """pretrain_hybrid.py with an MTP part ('/+-': MLA + MLP) builds our MTPHybridModel over the stack spec with its
    MTP block (hp_hybrid_model.py): its first iteration (lm loss, grad norm, the mtp_1 loss Megatron-LM logs, 7
    digits) equals the example's --model-class hybrid on the same patterns, dims and data; CP2 = one rank too
    (test_parallel_iteration_matches_single_rank), with the same mtp_1 loss."""
    (ref,), log = runs("hybrid_kda_mtp")["ref"]
    flags = ["--model-class", "hybrid", "--hybrid-layer-pattern", "G-G-G-+-/+-", "--hp-mla-kv-lora-rank", "16",
             "--hp-mla-qk-head-dim", "8", "--hp-mla-qk-pos-emb-head-dim", "8", "--hp-mla-v-head-dim", "8",
             "--hp-mla-cp-strategy", "latent", "--hp-mla-rope-type", "none"]
    example = example_first_record("KKKM", data, flags)
    assert _rel(ref["lm loss"], example["lm_loss"]) <= 1e-5, (ref, example)
    assert _rel(ref["grad_norm"], example["grad_norm"]) <= 1e-5, (ref, example)
    assert _rel(_mtp_loss(log), example["mtp_1 loss"]) <= 1e-6, (log[-2000:], example)
    assert _rel(_mtp_loss(runs("hybrid_kda_mtp")["cp2"][1]), _mtp_loss(log)) <= 1e-6


def test_packed_runs_pack_several_documents_per_row(runs):
    """The packed launches log their first THD row: several documents (the short-document data), padded."""
    for name in ("ref", "cp2"):
        _, log = runs("hybrid_gdn_packed")[name]
        found = re.findall(r"packed documents: (\d+) documents in the first micro-batch's THD row of (\d+) tokens", log)
        assert len(found) == 1 and int(found[0][0]) > 1 and int(found[0][1]) >= SEQ, log[-3000:]


def test_cuda_sites_all_reached_none_unlisted(runs, sites_dir):
    """Every redirected site of cpu_mode's 0.19 table (but its MoE sites: test_megatron_lm_hf_config.py) is needed
    by some run, and no run met an unlisted one."""
    import cpu_mode

    for model in MODELS:
        runs(model)
    reached, unlisted = cuda_sites(sites_dir)
    listed = {f"{p}:{line} {call}" for p, line, call, _ in cpu_mode.SITES_019 if not call.startswith("platform:")}
    assert not unlisted
    assert reached == listed, {"listed, never reached": sorted(listed - reached),
                               "reached, not listed": sorted(reached - listed)}


def test_unmodified_pretrain_hybrid_builds_our_stack(runs):
    """hybrid_gdn's reference is Megatron-LM's own pretrain_hybrid.py: our stack spec from --spec, none of our flags
    (it would refuse them); its TP2 / CP2 runs through the launch script equal it (the test above)."""
    _, log = runs("hybrid_gdn")["ref"]
    assert re.search(r"^\s+spec \.+ \['hp_megatron.specs', 'hybrid_stack_spec'\]$", log, re.M), log[-3000:]
    assert "hp_backend" not in log and "pretrain_hybrid_hp" not in log
