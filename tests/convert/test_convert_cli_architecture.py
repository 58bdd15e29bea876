"""How ``python -m hp_megatron.convert`` picks the architecture: config.json's ``model_type`` in
``hp_megatron.models.ARCHITECTURES``; ``--rules`` / ``--model-builder`` for a type the table does not list (both
needed), bit-exact both ways; one line naming the supported types otherwise."""
from __future__ import annotations

import json
import os
import shutil

import torch

from tests.support.models_case import read_safetensors, tiny_llama


def as_llama(hf_config: dict) -> dict:
    return {**hf_config, "model_type": "llama"}


def my_rules(hf_config: dict):
    """``--rules`` of the test: Llama's rules for a config of another ``model_type``."""
    from hp_megatron.models import get_architecture

    return get_architecture("llama").conversion_rules(as_llama(hf_config))


def my_model(hf_config: dict, **config_overrides):
    """``--model-builder`` of the test: Llama's model for a config of another ``model_type``."""
    from hp_megatron.models import get_architecture

    return get_architecture("llama").build_model(as_llama(hf_config), **config_overrides)


def test_unlisted_model_type_needs_rules_and_builder(tmp_path, capsys):
    from hp_megatron.convert.__main__ import main

    _, listed = tiny_llama(tmp_path)
    hf_dir = str(tmp_path / "my_llama")
    shutil.copytree(listed, hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    json.dump({**config, "model_type": "my_llama"}, open(os.path.join(hf_dir, "config.json"), "w"))
    capsys.readouterr()  # transformers' progress bar

    assert main(["hf-to-mcore", "--load", hf_dir, "--save", str(tmp_path / "refused"), "--rules",
                 "tests.convert.test_convert_cli_architecture:my_rules"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type='my_llama'" in err[0] and "'llama'" in err[0], err
    assert "--rules and --model-builder" in err[0] and not (tmp_path / "refused").exists()

    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    overrides = ["--rules", "tests.convert.test_convert_cli_architecture:my_rules",
                 "--model-builder", "tests.convert.test_convert_cli_architecture:my_model"]
    assert main(["hf-to-mcore", "--load", hf_dir, "--save", ckpt, *overrides]) == 0
    assert main(["mcore-to-hf", "--load", ckpt, "--save", back, *overrides]) == 0
    original, exported = read_safetensors(hf_dir), read_safetensors(back)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert json.load(open(os.path.join(back, "config.json")))["model_type"] == "my_llama"
