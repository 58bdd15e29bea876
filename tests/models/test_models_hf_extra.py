"""Without the ``[hf]`` extra (transformers): the tiny-checkpoint maker of docs/models.md's "Make, convert, train" stops
with one line naming the install command, and the converter, which needs neither transformers nor safetensors,
converts both ways. The packages are hidden by a meta-path finder in a fresh interpreter."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from tests.support.models_case import read_safetensors, tiny_llama
from tests.support.paths import REPO, pythonpath
from tests.support.stderr_lines import own_stderr_lines

ROOT = pathlib.Path(REPO)

HIDE = """
import sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "safetensors"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hidden())
"""


def _python_without_hf(code: str, *argv: str) -> subprocess.CompletedProcess:
    # PYTHONWARNINGS: megatron-core's import warnings
    env = {**os.environ, "PYTHONPATH": pythonpath(str(ROOT)), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", HIDE + code, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_tiny_checkpoint_maker_names_the_install_command(tmp_path):
    script = str(ROOT / "examples" / "pretrain" / "tiny_hf_checkpoint.py")
    save = tmp_path / "hf"
    code = "import runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = _python_without_hf(code, script, "--arch", "qwen3_next", "--save", str(save))
    lines = own_stderr_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "transformers" in lines[0], lines
    assert "pip install -e .[hf]" in lines[0] and "pip install 'hp-megatron[hf]'" in lines[0], lines
    assert not save.exists()


def test_converter_needs_neither_transformers_nor_safetensors(tmp_path):
    _, hf_dir = tiny_llama(tmp_path)
    ckpt, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    code = ("from hp_megatron.convert.__main__ import main\n"
            "assert 'transformers' not in sys.modules\n"
            "sys.exit(main(['hf-to-mcore', '--load', sys.argv[1], '--save', sys.argv[2]]) or "
            "main(['mcore-to-hf', '--load', sys.argv[2], '--save', sys.argv[3]]))")
    proc = _python_without_hf(code, hf_dir, ckpt, back)
    assert proc.returncode == 0, proc.stderr
    original, exported = read_safetensors(hf_dir), read_safetensors(back)
    assert sorted(exported) == sorted(original)
    assert all(exported[k].equal(v) for k, v in original.items())
