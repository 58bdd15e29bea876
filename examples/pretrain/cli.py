"""Command line of the example: Megatron-LM's flag names and defaults, checks made before anything is built,
and the way errors reach the user (one line from rank 0, non-zero exit, the other ranks quiet).

Every check here depends only on the flags and the launch environment (``WORLD_SIZE``), so every rank
reaches the same verdict and rank 0 alone reports it.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager

from hp_megatron.arguments import add_hp_arguments, validate_hp_args
from hp_megatron.flags import given_on_command_line
from hp_megatron.models.args import apply_hf_preset
from hp_megatron.registry import UnsupportedByMixer

PROG = "pretrain_hybrid.py"


def launch_rank() -> int:
    """This process's global rank as torchrun sets it (0 when run without a launcher)."""
    return int(os.environ.get("RANK", "0"))


# How long a rank other than 0 waits under torchrun for the agent to stop it once rank 0 has reported an error
# every rank raised alike (see leave_report_to_rank_zero).
REPORT_WAIT_S = 60.0


def leave_report_to_rank_zero(message: str) -> None:
    """On a rank other than 0, for an error every rank raises alike: return once rank 0 can have reported it.

    torchrun's agent stops every worker (SIGTERM) as soon as one exits with an error, so a rank that exits
    first can get rank 0 killed before it writes its line, and the user sees no error at all. Under torchrun
    (``TORCHELASTIC_RUN_ID`` set) this rank therefore waits for the agent to stop it after rank 0 has reported
    and exited; if no stop comes within :data:`REPORT_WAIT_S` (rank 0 did not fail alike), it writes
    ``message`` itself. Without torchrun it returns at once (the launcher does not stop the other ranks)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    time.sleep(REPORT_WAIT_S)
    sys.stderr.write(message)
    sys.stderr.flush()


class RankZeroArgumentParser(argparse.ArgumentParser):
    """``--help`` and usage errors printed by rank 0 only; an error is one line (``prog: error: ...``)."""

    def _print_message(self, message, file=None):
        if launch_rank() == 0:
            super()._print_message(message, file)

    def add_argument_group(self, *args, **kwargs):
        """A group whose value-taking flags without help text get a ``(default: ...)`` line in --help (the formatter
        appends it to flags that have help text)."""
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument

        def add_with_default_help(*flags, **options):
            if options.get("help") is None and options.get("action") not in ("store_true", "store_false"):
                options["help"] = "(default: %(default)s)"
            return add(*flags, **options)
        group.add_argument = add_with_default_help
        return group

    def error(self, message):
        rank = launch_rank()
        if rank == 0:
            sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        else:
            leave_report_to_rank_zero(f"{self.prog}: error (rank {rank}): {message} (see --help)\n")
        sys.exit(2)


MODEL_CLASSES = ("gpt", "hybrid")
# GPTModel on every megatron-core version for now (docs/usage.md, "Model class"): 0.16 has no HybridModel; on 0.19
# generation, export and Megatron-LM's tools of this project read GPTModel checkpoints, and HybridModel refuses
# attention and MLA layers in one model, which our patterns allow
DEFAULT_MODEL_CLASS = "gpt"


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The example's flags; add groups to the returned parser to extend it (its defaults show in --help).
    ``argv`` (default ``sys.argv[1:]``): where ``--hp-mixer-module`` modules are read from, imported before the
    ``--hp-*`` flags are added (``hp_megatron.arguments.add_hp_arguments``)."""
    parser = RankZeroArgumentParser(prog=PROG, description="Pretrain a hybrid GDN/KDA/MLA GPT with megatron-core",
                                    allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = parser.add_argument_group("parallelism (Megatron-LM names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--cp-comm-type", nargs="+", default=None, choices=("p2p", "all_gather", "a2a"),
                   help="CP communication of the layers whose --hp-* CP flag is not given (GDN/KDA: p2p, allgather, "
                        "ulysses; MLA: latent, latent, expanded_ulysses); one value, or one per layer; not given: "
                        "each mixer's default (docs/cp.md, 'Which CP method'); a2a+p2p needs Megatron-LM's "
                        "--hierarchical-context-parallel-sizes (the Megatron-LM launchers)")
    g = parser.add_argument_group("model (Megatron-LM names)")
    g.add_argument("--model-class", choices=MODEL_CLASSES, default=DEFAULT_MODEL_CLASS,
                   help="megatron-core's GPTModel, or HybridModel (megatron-core 0.19+; one pattern symbol = one "
                        "layer); docs/usage.md says why the default is gpt")
    g.add_argument("--hybrid-layer-pattern", default=None,
                   help="with --model-class hybrid: megatron-core's pattern (G GDN/KDA, * attention, + MLA, - MLP, "
                        "E MoE, | pipeline stages, / MTP depths); None: derived from --hp-layer-pattern or "
                        "--hp-hf-config")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="None: 8/3 x hidden, a multiple of 64")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="GQA groups of the attention layers")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true")
    g = parser.add_argument_group("mixture of experts (Megatron-LM names; with --hp-hf-config the model's own MoE)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (None: no MoE)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="an expert's FFN size (None: --ffn-hidden-size)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are split across (within the data-parallel x CP ranks)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside each expert (None: --tensor-model-parallel-size)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none"))
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the load-balancing loss (1e-2 is Megatron-LM's suggested start; 0: none)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert routing bias updated after every step (sigmoid routers)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="step of the expert-bias update (sign of the expert's load deficit x this rate)")
    g = parser.add_argument_group("multi-token prediction (Megatron-LM names)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="MTP depths: each predicts one token further (None: no MTP; on the last pipeline stage)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the mean MTP loss over the depths, added to the lm loss's gradient")
    g = parser.add_argument_group("training (Megatron-LM names)")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=60)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="None: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--exit-interval", type=int, default=None, help="stop after this iteration (for resume tests)")
    g.add_argument("--no-progress", action="store_true", help="no progress display during long iterations")
    g.add_argument("--verbose", action="store_true",
                   help="keep megatron-core's start-up warnings (Apex/TE fallbacks, deprecations)")
    g = parser.add_argument_group("evaluation (Megatron-LM names)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="evaluate every this many iterations and at the end (None: only at the end, when --split has a "
                        "validation part)")
    g.add_argument("--eval-iters", type=int, default=10, help="global batches of the validation split per evaluation")
    g = parser.add_argument_group("data and checkpoints (Megatron-LM names)")
    g.add_argument("--data-path", default=None, help="indexed-dataset prefix; None: build the pydoc dataset")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (None: next to the default dataset)")
    g.add_argument("--split", default="969,30,1",
                   help="train,validation,test weights over the documents (Megatron-LM's default with --data-path)")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after every EOD")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="documents attend only within themselves: micro-batches are packed (THD) along EODs")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD tokens")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="gradients of the mean over every loss token of the global batch (Megatron-LM's flag); "
                        "without it, of the mean of each rank's micro-batch means, which differs under CP or DP "
                        "when ranks hold different numbers of loss tokens (--eod-mask-loss, packed documents)")
    g.add_argument("--save", default=None, help="checkpoint directory (None: no checkpoint is written)")
    g.add_argument("--save-interval", type=int, default=None, help="None: save at the end only")
    g.add_argument("--load", default=None, help="resume from the latest checkpoint here when there is one")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, take the LR schedule from the flags instead of the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, keep the checkpoint's LR schedule without a warning")
    add_hp_arguments(parser, argv)
    return parser


def parse_args(argv=None, parser=None):
    """Parse and check the flags; fills the derived defaults (FFN size, decay iters, layer pattern)."""
    parser = parser or build_parser(argv)
    args = parser.parse_args(argv)
    args.hp_preset = apply_hf_preset(args, sys.argv[1:] if argv is None else argv)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 64 * math.ceil(8 * args.hidden_size / 3 / 64)
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    apply_hybrid_layer_pattern(args, sys.argv[1:] if argv is None else argv)
    if args.hp_layer_pattern is None:
        args.hp_layer_pattern = "KKKM"
    check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    check_model_class_args(args)
    return args


def apply_hybrid_layer_pattern(args, argv) -> None:
    """``--hybrid-layer-pattern`` (``--model-class hybrid`` only): the GPT numbering's flags it implies. Its mixer
    layers are ``--num-layers`` (given: must agree), its ``/`` parts ``--mtp-num-layers`` (given: must agree) and
    the MTP layers' ``--hp-mtp-layer-symbol``; without ``--hp-layer-pattern`` the layer pattern says what
    megatron-core's symbols say (``G`` GDN, ``*`` attention, ``+`` MLA); with it, its ``G`` / ``K`` letters pick
    GDN or KDA for the ``G`` layers in order (its other letters must match the hybrid pattern's)."""
    pattern = args.hybrid_layer_pattern
    if pattern is None:
        return
    if args.model_class != "hybrid":
        raise ValueError(f"--hybrid-layer-pattern {pattern} is for --model-class hybrid (got --model-class "
                         f"{args.model_class})")
    if args.hp_hf_config is not None:
        raise ValueError(f"--hybrid-layer-pattern {pattern} conflicts with --hp-hf-config {args.hp_hf_config}, "
                         "whose architecture's pattern is derived from its config.json")
    from hp_megatron.hybrid_model.numbering import MLP_SYMBOLS, LayerNumbering, hybrid_symbol_of, split_pattern
    from hp_megatron.registry import symbols

    LayerNumbering(pattern)   # one MLP layer per mixer layer, in the main pattern and each MTP part
    main, mtp = split_pattern(pattern)
    mixers = [s for s in main if s not in MLP_SYMBOLS]
    ours = {}
    for symbol in symbols():   # megatron-core's symbol -> the first of our mixers in its slot (G: GDN)
        try:
            ours.setdefault(hybrid_symbol_of(symbol), symbol)
        except ValueError:
            continue
    unknown = sorted(set(mixers) - set(ours))
    if unknown:
        raise ValueError(f"--hybrid-layer-pattern {pattern}: symbols {unknown} have none of our layers "
                         f"(ours: {sorted(ours)} mixers, {list(MLP_SYMBOLS)} MLPs)")
    has_moe = any(s == "E" for s in main + "".join(mtp))
    if has_moe != (args.num_experts is not None):
        raise ValueError(f"--hybrid-layer-pattern {pattern} has {'' if has_moe else 'no '}MoE layers (E) but "
                         f"{'no --num-experts' if has_moe else f'--num-experts {args.num_experts}'} is given")
    if given_on_command_line(argv, "num_layers") and args.num_layers != len(mixers):
        raise ValueError(f"--num-layers {args.num_layers} conflicts with --hybrid-layer-pattern {pattern} "
                         f"({len(mixers)} mixer layers, each with its MLP layer: one GPT layer)")
    args.num_layers = len(mixers)
    if args.hp_layer_pattern is None:
        args.hp_layer_pattern = "".join(ours[s] for s in mixers)
    else:
        layers = [args.hp_layer_pattern[i % len(args.hp_layer_pattern)] for i in range(len(mixers))]
        slots = "".join(hybrid_symbol_of(s) for s in layers)
        if slots != "".join(mixers):
            raise ValueError(f"--hp-layer-pattern {args.hp_layer_pattern} (HybridModel layers {slots}) does not "
                             f"match the mixer layers {''.join(mixers)} of --hybrid-layer-pattern {pattern}")
    if mtp:
        if args.mtp_num_layers not in (None, len(mtp)):
            raise ValueError(f"--mtp-num-layers {args.mtp_num_layers} conflicts with --hybrid-layer-pattern {pattern} "
                             f"({len(mtp)} MTP depths)")
        args.mtp_num_layers = len(mtp)
        kinds = {s for part in mtp for s in part if s not in MLP_SYMBOLS}
        if len(kinds) != 1 or len(mtp[0]) != 2:
            raise ValueError(f"--hybrid-layer-pattern {pattern}: each MTP part is one mixer and one MLP layer of "
                             "one kind (as our GPT MTP layers), e.g. /*-")
        if args.hp_mtp_layer_symbol is None:
            args.hp_mtp_layer_symbol = ours[kinds.pop()]
    elif args.mtp_num_layers:
        raise ValueError(f"--mtp-num-layers {args.mtp_num_layers} with --hybrid-layer-pattern {pattern}: add its MTP "
                         "depths to the pattern ('/' parts, e.g. /*-)")


def check_model_class_args(args) -> None:
    """``--model-class hybrid``: megatron-core has ``HybridModel`` (0.19+), and the layers fit it (it refuses
    attention and MLA layers in one model)."""
    if args.model_class != "hybrid":
        return
    try:
        import megatron.core.models.hybrid.hybrid_model  # noqa: F401
    except ImportError as err:
        from megatron.core.package_info import __version__

        raise ValueError(f"--model-class hybrid needs megatron-core's HybridModel (0.19+); the installed "
                         f"megatron-core {__version__} has none ({err})") from err
    from hp_megatron.hybrid_model.numbering import hybrid_symbol_of

    pattern = args.hp_preset.pattern if args.hp_preset is not None else args.hp_layer_pattern
    kinds = {hybrid_symbol_of(s) for s in pattern + (args.hp_mtp_layer_symbol or "")}
    if {"*", "+"} <= kinds:
        raise ValueError(f"--model-class hybrid: the layer pattern {pattern} has attention and MLA layers, which "
                         "megatron-core's HybridModel refuses in one model ('*' and '+'); use --model-class gpt")


def split_weights(split: str):
    """``--split`` as three weights (missing ones 0); ValueError for anything else."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative weights such as 969,30,1")
    return weights + [0.0] * (3 - len(weights))


def check_args(args, world_size: int) -> None:
    """Every check that needs only the flags and the world size; raises ValueError naming flags and values."""
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "global_batch_size", "train_iters", "log_interval", "eval_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    for flag in ("save_interval", "exit_interval", "eval_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {tp * pp * cp}")
    dp = world_size // (tp * pp * cp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {dp} (world {world_size} / TP x PP x CP)")
    check_moe_args(args, world_size)
    check_mtp_args(args)
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                         f"{args.num_attention_heads}")
    for flag, heads in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups)):
        if heads is not None and heads % tp:
            raise ValueError(f"{flag} {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters >= max(args.lr_decay_iters, 1) and args.lr_warmup_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters "
                         f"{args.lr_decay_iters}) (--lr-decay-iters defaults to --train-iters)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other")
    weights = split_weights(args.split)
    if weights[0] == 0:
        raise ValueError(f"--split {args.split!r} leaves no training documents")
    if args.eval_interval is not None and weights[1] == 0:
        raise ValueError(f"--eval-interval {args.eval_interval} needs a validation split; --split {args.split!r} "
                         "has none (e.g. --split 969,30,1)")
    if args.reset_attention_mask and not args.reset_position_ids:
        raise ValueError("--reset-attention-mask packs documents (THD), whose positions restart per document; "
                         "add --reset-position-ids")
    if args.reset_position_ids and not args.reset_attention_mask:
        raise ValueError("--reset-position-ids alone has no effect here: positions come from rotary embeddings "
                         "over the sequence (no learned position embedding); add --reset-attention-mask")
    if args.reset_attention_mask and pp > 1:
        raise ValueError(f"--reset-attention-mask (packed documents) has a variable token count per micro-batch, "
                         f"which the example's pipeline schedule does not support; got "
                         f"--pipeline-model-parallel-size {pp}")
    if args.data_path is not None:
        if args.tokenizer is None:
            raise ValueError("--data-path needs --tokenizer (a tokenizers JSON file)")
        for suffix in (".bin", ".idx"):
            if not os.path.exists(args.data_path + suffix):
                raise FileNotFoundError(f"--data-path {args.data_path}: no {args.data_path + suffix}")
    if args.tokenizer is not None and not os.path.exists(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no such file")
    if args.save is not None:
        _check_checkpoint_writer()
        _check_writable_dir("--save", args.save)
    validate_hp_args(args)


def check_moe_args(args, world_size: int) -> None:
    """The MoE and expert-parallel flags against the model and the world size (ValueError naming them)."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp),
                        ("--moe-router-topk", args.moe_router_topk)):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    experts = args.num_experts
    if experts is None:
        source = f"--hp-hf-config {args.hp_hf_config} has no MoE layers" if args.hp_preset else "no --num-experts"
        asked = [f"{flag} {value}" for flag, value, default in (
            ("--expert-model-parallel-size", ep, 1), ("--expert-tensor-parallel-size", etp, tp),
            ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, 0.0),
            ("--moe-router-enable-expert-bias", args.moe_router_enable_expert_bias, False)) if value != default]
        if asked:
            raise ValueError(f"{', '.join(asked)} needs a model with experts ({source})")
        return
    if experts < 1:
        raise ValueError(f"--num-experts must be positive, got {experts}")
    if experts % ep:
        raise ValueError(f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    if args.moe_router_topk > experts:
        raise ValueError(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {experts}")
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                         f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}")
    if ep > 1 and tp > 1 and not args.sequence_parallel:
        raise ValueError(f"--expert-model-parallel-size {ep} with --tensor-model-parallel-size {tp} needs "
                         "--sequence-parallel (megatron-core's MoE layers under TP and EP require it)")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (got "
                         f"{args.moe_router_score_function})")
    if args.moe_aux_loss_coeff < 0:
        raise ValueError(f"--moe-aux-loss-coeff must be non-negative, got {args.moe_aux_loss_coeff}")


def check_mtp_args(args) -> None:
    """``--mtp-num-layers`` and its layer kind (ValueError naming the flags)."""
    from hp_megatron.registry import mtp_symbols as mtp_kinds

    kinds = " or ".join(mtp_kinds())
    depth = args.mtp_num_layers
    if depth is not None and depth < 0:
        raise ValueError(f"--mtp-num-layers must be non-negative, got {depth}")
    if depth and args.mtp_loss_scaling_factor < 0:
        raise ValueError(f"--mtp-loss-scaling-factor must be non-negative, got {args.mtp_loss_scaling_factor}")
    if not depth or args.hp_preset is not None:  # a preset declares its MTP kind
        return
    symbols = set(args.hp_layer_pattern)
    kind = args.hp_mtp_layer_symbol or (symbols.pop() if len(symbols) == 1 else None)
    if kind is None:
        raise ValueError(f"--mtp-num-layers {depth} with --hp-layer-pattern {args.hp_layer_pattern}: the MTP layers "
                         f"have one fixed kind; add --hp-mtp-layer-symbol ({kinds})")
    # a kind whose mixer declares no MTP support: validate_hp_args' check_mixer_support refuses it (exit 2)


def _check_writable_dir(flag, path):
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")


def _check_checkpoint_writer():
    # megatron-core's filesystem writer measures its workers' memory with psutil; without it the worker
    # dies before signalling and every rank waits on its queue forever.
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise RuntimeError("--save needs the psutil package (megatron-core's checkpoint writer uses it): "
                           "pip install psutil") from None


# megatron-core's messages at import and config time that do not concern a run of this example
KNOWN_STARTUP_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl.logging is not installed",
    r"full scope is deprecated",
    r".*torch\.distributed\._(all_gather|reduce_scatter)_base.*deprecated",
    r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"`load_state_dict` is deprecated",
)


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_STARTUP_WARNINGS` (the example's default; ``--verbose`` keeps them)."""
    for pattern in KNOWN_STARTUP_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


REPORTED_ERRORS = (ValueError, TypeError, OSError, ImportError, RuntimeError)


@contextmanager
def same_on_every_rank():
    """Mark errors raised inside as raised identically by every rank (flag checks, set-up from the same
    flags and files), so that only rank 0 reports them."""
    try:
        yield
    except REPORTED_ERRORS as exc:
        exc.same_on_every_rank = True
        raise


def run_reporting_errors(main, argv=None, verbose=False) -> int:
    """``main(argv)`` with Megatron-style error reporting; returns the exit status.

    A configuration, data or checkpoint error becomes one ``error: ...`` line on stderr and status 1 (2 for a
    combination a mixer declares it does not support, ``hp_megatron.registry.UnsupportedByMixer``): from
    rank 0 alone when it was raised inside :func:`same_on_every_rank` (the other ranks wait for it:
    :func:`leave_report_to_rank_zero`), else from each failing rank (``error (rank k): ...``). ``verbose``
    (``--verbose``) keeps the traceback instead.
    """
    try:
        return main(argv) or 0
    except REPORTED_ERRORS as exc:
        if verbose:
            raise
        rank = launch_rank()
        line = f"error: {exc}\n" if rank == 0 else f"error (rank {rank}): {exc}\n"
        if rank == 0 or not getattr(exc, "same_on_every_rank", False):
            sys.stderr.write(line)
            sys.stderr.flush()
        else:
            leave_report_to_rank_zero(line)
        _close_process_group()
        return 2 if isinstance(exc, UnsupportedByMixer) else 1


def _close_process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
