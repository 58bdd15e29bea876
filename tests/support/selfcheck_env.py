"""Environments in which tests run the self-check (``python -m hp_megatron.selfcheck``) on CPU, and its driver.

``python -m tests.support.selfcheck_env ENV -- <self-check arguments>`` sets ENV up in this process, then
runs :func:`hp_megatron.selfcheck.main` with the same setup as ``rank_setup``, so each spawned CP rank sets it up
first too; the exit status is the self-check's. ENV:

- ``standin``: the fla-npu stand-in (tests/fla_npu_standin) in its bf16 contract (no ALLOW_FP32) on a declared
  Ascend950PR, as ``tests/support/ascendc_standin.install_standin`` installs it for the ascendc tests.
- ``standin_a3``: the same on a declared Ascend910_9392 (A3), whose op set lacks the Ascend-950-only operators.
- ``interpreter``: flash-linear-attention's real Triton kernels on CPU through Triton's interpreter
  (tests/support/triton_interpreter.py), before FLA is imported.

:func:`failing_rank` / :func:`stalled_rank` are ``rank_setup`` callables that raise / sleep (the check must report
ERROR rows, not hang).

Tests that break an op on purpose wrap it with :func:`scaled` in their own process. The installed versions the
self-check reports come from the environment of the process.
"""
from __future__ import annotations

import functools
import sys


def scaled(fn, factor=1.1):
    """``fn`` with its output times ``factor`` (the signature kept for the adapters' inspection)."""
    @functools.wraps(fn)
    def corrupted(*args, **kwargs):
        return fn(*args, **kwargs) * factor
    return corrupted


def standin():
    from tests.support.ascendc_standin import install_standin

    install_standin(soc="Ascend950PR", fp32=False)


def standin_a3():
    """The same stand-in declared as an Ascend910_9392 (A3): only the ops whose op-defs register that SoC."""
    from tests.support.ascendc_standin import install_standin

    install_standin(soc="Ascend910_9392", fp32=False)


def interpreter():
    from tests.support import triton_interpreter

    triton_interpreter.enable()


def failing_rank():
    """A rank setup that raises: the CP rows must become ERRORs naming it, and the check must end."""
    raise RuntimeError("rank setup failed on purpose")


def stalled_rank():
    """A rank setup that never finishes in time: ``--cp-timeout`` must end the ranks."""
    import time

    time.sleep(600)


ENVIRONMENTS = {"standin": standin, "standin_a3": standin_a3, "interpreter": interpreter}


def main(argv):
    split = argv.index("--")
    (env,) = argv[:split]
    setup = ENVIRONMENTS[env]
    setup()
    from hp_megatron.selfcheck import main as selfcheck

    return selfcheck(argv[split + 1:], rank_setup=setup)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
