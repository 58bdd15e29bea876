"""The Megatron-LM launch path without training: CUDA-site table, launcher errors, common.sh defaults."""
import os
import subprocess
import sys

import pytest

from tests.support.paths import MEGATRON_LM, REPO, megatron_lm_skip, pythonpath

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(REPO, "examples", "pretrain", "megatron_lm")
LAUNCHER = os.path.join(SCRIPTS, "pretrain_gpt_hp.py")
sys.path.insert(0, HERE)


needs_megatron_lm = pytest.mark.skipif(MEGATRON_LM is None, reason="Megatron-LM's training code not found: set "
                                       "MEGATRON_LM_PATH (tests/support/paths.py)")


@needs_megatron_lm
def test_cuda_sites_hold_their_text_and_a_moved_one_fails(monkeypatch):  # the installed version's cpu_mode table
    import cpu_mode

    monkeypatch.syspath_prepend(MEGATRON_LM)
    cpu_mode.check_sites()  # the installed megatron-core and Megatron-LM hold every listed line
    from megatron.core.package_info import MAJOR, MINOR

    moved = ("megatron/core/timers.py", 151, "torch.cuda.synchronize", "torch.cuda.synchronize()")
    monkeypatch.setitem(cpu_mode.SITES, (MAJOR, MINOR), cpu_mode.SITES[(MAJOR, MINOR)] + (moved,))
    with pytest.raises(RuntimeError, match=r"megatron/core/timers.py:151 torch.cuda.synchronize: expected"):
        cpu_mode.check_sites()


def _launch(path, code):
    env = dict(os.environ, PYTHONPATH=pythonpath(*path))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_launcher_without_megatron_lm_names_the_checkout():
    done = _launch([REPO], f"import runpy; runpy.run_path({LAUNCHER!r}, run_name='__main__')")
    assert done.returncode != 0
    assert "RuntimeError: this launcher needs a Megatron-LM checkout on PYTHONPATH (module 'pretrain_gpt'" in \
        done.stderr, done.stderr[-2000:]


def test_hybrid_launcher_without_megatron_lm_names_the_checkout():
    launcher = os.path.join(SCRIPTS, "pretrain_hybrid_hp.py")
    done = _launch([REPO], f"import runpy; runpy.run_path({launcher!r}, run_name='__main__')")
    assert done.returncode != 0
    assert "RuntimeError: this launcher needs a Megatron-LM checkout on PYTHONPATH (module 'pretrain_hybrid'" in \
        done.stderr, done.stderr[-2000:]


# Megatron-LM 0.19 on Python 3.11 fails before it imports six (typing.override is 3.12's)
@pytest.mark.skipif(megatron_lm_skip((0, 16)) is not None, reason=str(megatron_lm_skip((0, 16))))
def test_launcher_names_a_missing_dependency_of_megatron_lm():
    code = ("import sys, runpy; sys.modules['six'] = None; "  # as if `six` were not installed
            f"runpy.run_path({LAUNCHER!r}, run_name='__main__')")
    done = _launch([MEGATRON_LM, REPO], code)
    assert done.returncode != 0
    assert "RuntimeError: Megatron-LM imports 'six', which is not installed: pip install six" in done.stderr, \
        done.stderr[-2000:]


def _common_args(tmp_path, **env_vars):
    """COMMON_ARGS of common.sh for the given environment, one per line."""
    env = dict(os.environ, MEGATRON_LM=str(tmp_path), DATA="/data/x_text_document", TOKENIZER="/tok",
               CKPT=str(tmp_path / "ckpt"), **env_vars)
    env.pop("MEGATRON_LM_PATH", None)
    done = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SCRIPTS}/common.sh"; '
                           'printf "%s\\n" "${COMMON_ARGS[@]}"'], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


def _value(args, flag):
    return args[args.index(flag) + 1]


def test_common_sh_keeps_gpu_defaults_and_loads_only_existing_checkpoints(tmp_path):
    args = _common_args(tmp_path)
    assert _value(args, "--train-iters") == "10000" and _value(args, "--lr-warmup-iters") == "200"
    assert "--bf16" in args and _value(args, "--tensor-model-parallel-size") == "2"
    assert _value(args, "--context-parallel-size") == "4" and "--load" not in args
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    args = _common_args(tmp_path, ITERS="3", DTYPE="fp32")
    assert _value(args, "--load") == str(tmp_path / "ckpt")
    assert _value(args, "--lr-warmup-iters") == "0" and "--bf16" not in args


def test_hf_tokenizer_refuses_a_missing_file(tmp_path):
    sys.path.insert(0, SCRIPTS)
    from hf_tokenizer import write_tokenizer_dir

    with pytest.raises(ValueError, match="does not exist"):
        write_tokenizer_dir(str(tmp_path / "missing.json"), str(tmp_path / "hf"))


def test_hybrid_launcher_mla_flags():
    """pretrain_hybrid_hp.py with MLA layers ('+': Megatron-LM sets --multi-latent-attention): --hp-mla-* dims are
    refused (Megatron-LM's MLA flags set them), --hp-mla-rope-type sets the rotary type (NoPE: 'none'), not with
    --rope-type; without MLA layers the config is untouched."""
    import argparse
    import types

    sys.path.insert(0, SCRIPTS)
    from pretrain_hybrid_hp import _mla_rope_type

    def args(**given):
        dims = {name: None for name in ("hp_mla_q_lora_rank", "hp_mla_kv_lora_rank", "hp_mla_qk_head_dim",
                                         "hp_mla_qk_pos_emb_head_dim", "hp_mla_v_head_dim")}
        return argparse.Namespace(**{"multi_latent_attention": True, "hp_mla_rope_type": "rope", **dims, **given})

    config = types.SimpleNamespace(rope_type="yarn")
    assert _mla_rope_type(args(), config, []).rope_type == "yarn"  # Megatron-LM's MLA default
    assert _mla_rope_type(args(hp_mla_rope_type="none"), config, ["--hp-mla-rope-type", "none"]).rope_type == "none"
    with pytest.raises(ValueError, match="--hp-mla-kv-lora-rank: MLA layers .* use --kv-lora-rank"):
        _mla_rope_type(args(hp_mla_kv_lora_rank=16), config, [])
    with pytest.raises(ValueError, match="--rope-type and --hp-mla-rope-type both"):
        _mla_rope_type(args(hp_mla_rope_type="none"), config, ["--rope-type=rope", "--hp-mla-rope-type", "none"])
    untouched = types.SimpleNamespace(rope_type="rope")
    assert _mla_rope_type(args(multi_latent_attention=False, hp_mla_kv_lora_rank=16), untouched,
                          ["--hp-mla-rope-type", "none"]) is untouched



@needs_megatron_lm
def test_launchers_finalize_grads_with_the_once_per_step_tp_sum():
    """Megatron-LM's train() sets config.finalize_model_grads_func from its module's name finalize_model_grads
    (0.16 always, 0.19 when unset: read from the checkout's source); the launchers make that name ours
    (megatron-core's + the TP sum of the GDN / KDA output-norm gradients once per step)."""
    import ast
    from types import SimpleNamespace

    from layers.shared.tp_replicated_grads import finalize_model_grads

    sys.path.insert(0, SCRIPTS)
    try:
        from hp_launch import use_hp_finalize_model_grads
    finally:
        sys.path.remove(SCRIPTS)
    tree = ast.parse(open(os.path.join(MEGATRON_LM, "megatron", "training", "training.py")).read())
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                and n.module == "megatron.core.distributed" for a in n.names}
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    reads = [n for n in ast.walk(train) if isinstance(n, ast.Name) and n.id == "finalize_model_grads"]
    assert "finalize_model_grads" in imported and reads
    training = SimpleNamespace(finalize_model_grads=None)
    use_hp_finalize_model_grads(training)
    assert training.finalize_model_grads is finalize_model_grads


@pytest.mark.parametrize("args,message", [
    ({"dataloader_inter_document_masking": True},
     "--dataloader-inter-document-masking: Megatron-LM 0.19 splits such rows zigzag over CP as a whole"),
    ({"reset_attention_mask": True, "reset_position_ids": False}, "--reset-attention-mask needs --reset-position-ids"),
    ({"reset_attention_mask": True, "reset_position_ids": True, "pipeline_model_parallel_size": 2},
     "--reset-attention-mask with --pipeline-model-parallel-size 2: packed rows vary in length"),
])
def test_launchers_refuse_what_packed_rows_cannot_be(args, message):
    """Megatron-LM 0.19's inter-document masking (its whole-row CP split) is not a layout our layers take; our packed
    THD rows (hp_packed.py) need restarting positions and one pipeline stage: each refused in one line."""
    import re
    from types import SimpleNamespace

    sys.path.insert(0, SCRIPTS)
    try:
        from hp_launch import check_args
    finally:
        sys.path.remove(SCRIPTS)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_args(SimpleNamespace(**args))
