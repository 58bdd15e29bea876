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


def write_converted(root: str, data_dir: str, archs, mtp_num_layers: int = 0, model_classes=("gpt",)) -> str:
    """Under ``root``: ``data``, a link to ``data_dir`` (the pydoc dataset, vocabulary 512: the ``pydoc_data``
    fixture) and per architecture a tiny random transformers model (``<arch>_hf``, seed 3; with
    ``mtp_num_layers`` a released-style MTP layer added) converted by ``hp_megatron.convert`` (``<arch>_ckpt``, its
    MTP layers kept; with ``"hybrid"`` in ``model_classes`` also as a HybridModel checkpoint, ``<arch>_hybrid_ckpt``).
    Returns ``root``."""
    example()
    from hp_megatron.convert import hf_to_mcore
    from hp_megatron.models import get_architecture
    from prepare_data import BPETokenizer

    os.symlink(data_dir, os.path.join(root, "data"))
    vocab = BPETokenizer(os.path.join(root, "data", "tokenizer.json")).vocab_size
    for arch in archs:
        hf_dir = os.path.join(root, f"{arch}_hf")
        converted_tiny_model(arch, hf_dir, os.path.join(root, f"{arch}_ckpt"), seed=3,
                             vocab_size=vocab, mtp_num_layers=mtp_num_layers, mtp_seed=4)
        if "hybrid" in model_classes:
            hf_to_mcore(hf_dir, os.path.join(root, f"{arch}_hybrid_ckpt"),
                        get_architecture(arch).with_mtp(mtp_num_layers).for_model_class("hybrid"))
    return root


def example_argv(root: str, arch: str, *extra, model_class: str = "gpt") -> list:
    """Flags training ``arch``'s converted checkpoint (of ``model_class``, ``--model-class``) for one iteration
    (GBS 4 of micro-batches of 1, 32 tokens)."""
    ckpt = f"{root}/{arch}_ckpt" if model_class == "gpt" else f"{root}/{arch}_{model_class}_ckpt"
    return ["--data-path", f"{root}/data/pydoc_text_document", "--tokenizer", f"{root}/data/tokenizer.json",
            "--hp-hf-config", f"{root}/{arch}_hf", "--load", ckpt, "--seq-length", str(SEQ),
            "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--train-iters", "1", "--no-progress",
            "--split", "100,0,0", "--model-class", model_class, *extra]


def first_iteration(argv) -> dict:
    """Run the example with ``argv`` on this process's ranks; the first iteration's record."""
    return iterations(argv)[0]


def iterations(argv) -> list:
    """Run the example with ``argv`` on this process's ranks; every iteration's record."""
    pretrain_hybrid = example()
    return pretrain_hybrid.train(pretrain_hybrid.parse_args(argv))


def _first_iterations(rank, world_size, cases, every=False):
    """In a worker: :func:`first_iteration` (``every``: :func:`iterations`) of each ``(name, argv)`` case, each
    result streamed; a case whose argv starts with ``"convert"`` runs ``python -m hp_megatron.convert`` with the rest
    (its exit status is the result)."""
    out = {}
    for name, argv in cases:
        case_started(name)
        if argv and argv[0] == "convert":  # a step between runs: ``python -m hp_megatron.convert`` on rank 0
            from hp_megatron.convert.__main__ import main as convert_main

            out[name] = convert_main(list(argv[1:])) if rank == 0 else 0
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
        else:
            out[name] = (iterations if every else first_iteration)(list(argv))
        case_result(name, out[name])
    return out


def layouts_and_references(layouts: dict, references: dict, every: bool = False, between=None):
    """``layouts`` (``{name: argv}``) in one spawn of 4 ranks, then (after ``between()`` when given) ``references``
    on one rank; returns (a reader ``layout(name)`` of the last rank's first iteration (``every``: all its
    iterations), which raises that case's spawn error, and ``{reference: its first iteration (or all)}``)."""
    cases = tuple((name, tuple(argv)) for name, argv in layouts.items())

    def layout(name):
        return run_distributed_cases(_first_iterations, 4, name, cases, every)[-1]

    try:
        layout(cases[-1][0])
    except (DistributedTestError, KeyError):
        pass  # each test reports what it misses
    if between is not None:
        between()
    return layout, single_rank_runs(references, every)


def single_rank_runs(references: dict, every: bool = False) -> dict:
    """``references`` (``{name: argv}``) one after another on one rank, in one spawn: ``{name: its first iteration
    (``every``: all its iterations)}``."""
    single = tuple((name, tuple(argv)) for name, argv in references.items())
    return run_distributed(_first_iterations, 1, single, every)[0]
