"""The README's "Use in your own code" snippet runs as written (a fresh interpreter, the repository on the path)."""
import os
import re
import subprocess
import sys

from tests.support.paths import REPO, pythonpath



def _snippet():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Use in your own code"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_snippet_runs():
    code = _snippet()
    assert "chunk_kda" in code and "build_cp_context" in code
    env = dict(os.environ, PYTHONPATH=pythonpath(REPO))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
