"""``python rank0_late.py SECONDS SCRIPT [ARGS...]``: run SCRIPT as ``__main__`` with ARGS, rank 0 (torchrun's
``RANK``) starting SECONDS late. The other ranks then reach an error every rank raises alike first: the launch
order in which torchrun's agent could stop rank 0 before it reports (tests/example/test_pretrain_cli.py)."""
import os
import runpy
import sys
import time

if __name__ == "__main__":
    seconds, script = float(sys.argv[1]), sys.argv[2]
    if os.environ.get("RANK", "0") == "0":
        time.sleep(seconds)
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")
