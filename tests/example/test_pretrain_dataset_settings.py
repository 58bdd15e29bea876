"""A dataset folder of examples/pretrain/prepare_data.py records its settings, and a folder built with other
settings is refused, by prepare_data.py and by the example's default dataset, instead of being overwritten or
silently trained on (docs/usage.md's Megatron-LM recipe once rebuilt out/data/pydoc with a 512-token vocabulary,
and the README's example then trained with it)."""
import hashlib
import os
import re
import shutil
import sys
from types import SimpleNamespace

import pytest

from tests.support.paths import EXAMPLE, REPO

if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)


@pytest.fixture(scope="module")
def built(pydoc_data, tmp_path_factory):
    """A copy of the session's 512-token dataset (these tests try to overwrite it)."""
    path = os.path.join(str(tmp_path_factory.mktemp("settings")), "pydoc512")
    shutil.copytree(pydoc_data, path, ignore=shutil.ignore_patterns("cache"))
    return path


def _digest(path):
    with open(os.path.join(path, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_rebuilding_with_other_settings_is_refused_and_changes_nothing(built, capsys):
    import prepare_data

    assert prepare_data.dataset_ready(built, 512)
    before = _digest(built)
    with pytest.raises(ValueError, match=re.escape(f"{built} holds a dataset built with --vocab-size 512")) as err:
        prepare_data.build(built, vocab_size=4096)
    assert "not --vocab-size 4096" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SystemExit) as exit_info:
        prepare_data.main(["--output-dir", built, "--vocab-size", "4096"])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--vocab-size 512" in lines[0] and "--vocab-size 4096" in lines[0], lines
    assert _digest(built) == before  # the 512-token dataset is still there, untouched


def test_folder_without_a_settings_record_is_refused(built, tmp_path):
    import prepare_data

    legacy = str(tmp_path / "legacy")
    shutil.copytree(built, legacy)
    os.remove(os.path.join(legacy, prepare_data.SETTINGS_NAME))
    with pytest.raises(ValueError, match=f"no {prepare_data.SETTINGS_NAME} recording their settings"):
        prepare_data.dataset_ready(legacy, 4096)
    assert prepare_data.dataset_ready(str(tmp_path / "empty"), 4096) is False


def test_example_refuses_a_default_folder_of_other_settings(built):
    """pretrain_hybrid.py without --data-path uses the 4096-token pydoc dataset: a default folder holding the
    512-token one is an error naming both, not a run on it."""
    import pretrain_hybrid
    from hp_megatron.platform import single_rank_megatron

    args = SimpleNamespace(data_path=None, tokenizer=None)
    with single_rank_megatron(model_parallel=False):
        with pytest.raises(ValueError, match="--vocab-size 512 .*not --vocab-size 4096.*--data-path and --tokenizer"):
            pretrain_hybrid.prepare_default_data(args, data_dir=built)
    assert args.data_path is None


def test_usage_doc_builds_other_vocabularies_in_their_own_folder():
    """Every prepare_data.py command of the docs with a vocabulary other than the example's default writes
    somewhere else than the example's default folder out/data/pydoc."""
    from prepare_data import DEFAULT_VOCAB_SIZE

    commands = []
    for name in ("README.md", os.path.join("docs", "usage.md"), os.path.join("docs", "models.md")):
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            commands += re.findall(r"prepare_data\.py[^\n]*", f.read())
    assert commands
    for command in commands:
        vocab = re.search(r"--vocab-size (\d+)", command)
        folder = re.search(r"--output-dir (\S+)", command)
        if vocab and int(vocab.group(1)) != DEFAULT_VOCAB_SIZE:
            assert folder and folder.group(1).rstrip("/") != "out/data/pydoc", command
