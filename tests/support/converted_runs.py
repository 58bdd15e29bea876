"""The example (examples/pretrain/pretrain_hybrid.py) on converted tiny Hugging Face checkpoints, in-process:
:func:`write_converted` makes the checkpoints once per test module (next to the session's dataset),
:func:`example_argv` the flags that train one of them from ``--load``, :func:`first_iteration` runs the example
and returns its first iteration's record (lm loss, grad norm, the MoE / MTP log entries),
:func:`layouts_and_references` runs parallel layouts in one 4-rank spawn and their references in one 1-rank spawn."""
from __future__ import annotations

import os
import sys

from tests.support.dist import DistributedTestError, case_result, case_started, run_distributed, run_distributed_cases
from tests.support.models_case import converted_tiny_model
from tests.support.paths import EXAMPLE

SEQ, GBS = 32, 4


def example():
    """The example's ``pretrain_hybrid`` module (its folder put on ``sys.path``)."""
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    import pretrain_hybrid

    return pretrain_hybrid


def write_converted(root: str, data_dir: str, archs, mtp_num_layers: int = 0) -> str:
    """Under ``root``: ``data``, a link to ``data_dir`` (the pydoc dataset, vocabulary 512: the ``pydoc_data``
    fixture) and per architecture a tiny random transformers model (``<arch>_hf``, seed 3; with
    ``mtp_num_layers`` a released-style MTP layer added) converted by ``hp_megatron.convert`` (``<arch>_ckpt``, its
    MTP layers kept). Returns ``root``."""
    example()
    from prepare_data import BPETokenizer

    os.symlink(data_dir, os.path.join(root, "data"))
    vocab = BPETokenizer(os.path.join(root, "data", "tokenizer.json")).vocab_size
    for arch in archs:
        converted_tiny_model(arch, os.path.join(root, f"{arch}_hf"), os.path.join(root, f"{arch}_ckpt"), seed=3,
                             vocab_size=vocab, mtp_num_layers=mtp_num_layers, mtp_seed=4)
    return root


def example_argv(root: str, arch: str, *extra) -> list:
    """Flags training ``arch``'s converted checkpoint for one iteration (GBS 4 of micro-batches of 1, 32 tokens)."""
    return ["--data-path", f"{root}/data/pydoc_text_document", "--tokenizer", f"{root}/data/tokenizer.json",
            "--hp-hf-config", f"{root}/{arch}_hf", "--load", f"{root}/{arch}_ckpt", "--seq-length", str(SEQ),
            "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--train-iters", "1", "--no-progress",
            "--split", "100,0,0", *extra]


def first_iteration(argv) -> dict:
    """Run the example with ``argv`` on this process's ranks; the first iteration's record."""
    pretrain_hybrid = example()
    return pretrain_hybrid.train(pretrain_hybrid.parse_args(argv))[0]


def _first_iterations(rank, world_size, cases):
    """In a worker: :func:`first_iteration` of each ``(name, argv)`` case, each result streamed."""
    out = {}
    for name, argv in cases:
        case_started(name)
        out[name] = first_iteration(list(argv))
        case_result(name, out[name])
    return out


def layouts_and_references(layouts: dict, references: dict):
    """``layouts`` (``{name: argv}``) in one spawn of 4 ranks, then ``references`` on one rank; returns (a reader
    ``layout(name)`` of the last rank's first iteration, which raises that case's spawn error, and
    ``{reference: its first iteration}``)."""
    cases = tuple((name, tuple(argv)) for name, argv in layouts.items())

    def layout(name):
        return run_distributed_cases(_first_iterations, 4, name, cases)[-1]

    try:
        layout(cases[-1][0])
    except (DistributedTestError, KeyError):
        pass  # each test reports what it misses
    single = tuple((name, tuple(argv)) for name, argv in references.items())
    return layout, run_distributed(_first_iterations, 1, single)[0]
