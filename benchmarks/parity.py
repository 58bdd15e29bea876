"""RL-grade numerics of context parallelism: how far each CP method's bf16 log-probs are from one rank's.

RL trainers compare the log-probs of the training forward with those of the rollout (generation) and with an
older policy's; a CP method whose bf16 numerics drift inflates the KL terms (a chunkwise CP fork's ``ppo_kl`` grew
about 220x in bf16). For a tiny random model of ``--model`` (an architecture of ``hp_megatron.models.tiny``,
default ``qwen3_5_moe_text``: GDN + gated attention + MoE; ``bailing_hybrid``: Ling-like KDA + MLA + MoE),
converted from transformers' random weights, on gloo CPU ranks with the eager kernels:

(a) per-token log-probs of the training forward (``GPTModel`` logits, fp32 log-softmax of the target token) at CP 2
    and 4 for every CP method of the GDN layers, BSHD (two rows) and packed (one THD row of documents), in bf16,
    against bf16 at CP 1 and against fp32 at CP 1: max and mean ``|delta log p|`` over the target tokens;
(b) the log-probs that ``hp_megatron.generate`` returns for the tokens it samples (bf16, CP 1, temperature 1)
    against the training forward's log-probs of the same sequences (bf16 at CP 1, and at the largest CP for every
    method): the rollout / training mismatch;
(c) ``--steps`` bf16 training steps (Adam on fp32 master weights, the loss of the same fixed batches) at CP 4 and at
    CP 1: the two loss curves, drawn side by side into ``--plot`` (matplotlib) when it is importable.

``--write-docs`` puts the tables into docs/benchmarks.md (section ``parity_<model>``); ``--json`` writes the numbers.
``--backend triton`` runs the same on a GPU (NCCL would be needed there; this script is written for gloo / CPU).

    python benchmarks/parity.py --model qwen3_5_moe_text --write-docs --plot docs/parity_qwen3_5_moe_text.png
    python benchmarks/parity.py --model bailing_hybrid --write-docs --plot docs/parity_bailing_hybrid.png
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import add_output_args, publish, run_meta, spawn_gloo  # noqa: E402

CP_METHODS = ("p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling", "ulysses")
DOCS = (24, 40, 16, 48)    # packed documents (multiples of 2 x 4: zigzag at CP 4 needs no padding)
ROWS, SEQ, PROMPT = 2, 128, 16   # BSHD: ROWS sequences of SEQ tokens, PROMPT of them prompt, the rest generated


def checkpoint_state(arch: str, seed: int = 0) -> tuple:
    """(config.json dict, megatron-core state dict at TP=1): the tiny random transformers model of ``arch``
    saved by transformers and converted with the architecture's rules (a VL checkpoint: its language model)."""
    from safetensors.torch import load_file

    from hp_megatron.models import conversion_rules_from_hf
    from hp_megatron.models.tiny import build_tiny_hf_model

    model = build_tiny_hf_model(arch, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        import json

        with open(os.path.join(tmp, "config.json")) as f:
            config = json.load(f)
        state = {}
        for name in os.listdir(tmp):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(tmp, name)))
    rules = conversion_rules_from_hf(config)
    return config, {r.mcore_key: r.to_mcore([state[k] for k in r.hf_keys]).clone() for r in rules}


def _model(config_json, state, *, cp: int, method: str | None, dtype, backend: str):
    from hp_megatron.models import preset_from_hf, preset_gpt_model, preset_transformer_config
    from hp_megatron.platform import CPU_SAFE_CONFIG

    preset = preset_from_hf(config_json)
    cp_fields = {}
    if cp > 1:
        cp_fields = dict(delta_cp_method=method, **({"delta_cp_group_size": 2} if method == "grouped_allgather_p2p"
                                                    else {}))
    config = preset_transformer_config(preset, **{**CPU_SAFE_CONFIG, "params_dtype": dtype, "pipeline_dtype": dtype,
                                                  "bf16": dtype == torch.bfloat16, "context_parallel_size": cp,
                                                  "hp_backend": backend, **cp_fields})
    model = preset_gpt_model(preset, config, backend, max_sequence_length=4 * SEQ)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model


def _packed_params(docs=DOCS):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(docs)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)


def packed_batch(vocab: int, seed: int = 1) -> tuple:
    """(ids [1, T], targets [1, T], mask [1, T]) of one THD row of :data:`DOCS`: the next token within each
    document, no target at a document's last token; positions restart per document."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(DOCS)
    ids = torch.randint(0, vocab, (1, total), generator=gen)
    targets, mask = torch.roll(ids, -1, 1), torch.ones(1, total)
    ends = torch.tensor(DOCS).cumsum(0) - 1
    targets[:, ends], mask[:, ends] = 0, 0.0
    return ids, targets, mask


def _positions(packed: bool, length: int):
    if packed:
        return torch.cat([torch.arange(n) for n in DOCS])[None]
    return torch.arange(length)[None]


def token_log_probs(model, ids, targets, *, packed: bool, loss=False):
    """Per-token log p(target) of the training forward over the global batch, gathered from the CP ranks into global
    order ``[b, s]`` (fp32 log-softmax of this rank's logits); with ``loss``: (log-probs, this rank's local
    log-probs, its token index), for a backward."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hp_megatron.data import cp_token_index

    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    length = ids.shape[1]
    cu = _packed_params().cu_seqlens_q.long() if packed else None
    cols = cp_token_index(length, cp, rank, cu, "zigzag")
    positions = _positions(packed, length).expand(ids.shape[0], -1)[:, cols].contiguous()
    logits = model(ids[:, cols].contiguous(), positions, None, packed_seq_params=_packed_params() if packed else None)
    local = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, cols, None])[..., 0]
    full = torch.zeros(ids.shape, dtype=torch.float32)
    if cp == 1:
        full[:, cols] = local.detach()
    else:
        pieces = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(pieces, local.detach().contiguous(), group=ps.get_context_parallel_group())
        for r, piece in enumerate(pieces):
            full[:, cp_token_index(length, cp, r, cu, "zigzag")] = piece
    return (full, local, cols) if loss else full


def _delta(a, b, mask) -> dict:
    d = (a - b).abs()[mask.bool()]
    return {"max": float(d.max()), "mean": float(d.mean())}


def _train(model, batches, steps: int, lr: float = 3e-3) -> list:
    """``steps`` Adam steps on fp32 master copies of ``model``'s (bf16) parameters: each step's loss is the token
    mean of the next fixed batch's negative log-likelihood (CP ranks' gradients summed over the CP group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.Adam(master, lr=lr)
    cp = ps.get_context_parallel_world_size()
    losses = []
    for step in range(steps):
        ids, targets, mask = batches[step % len(batches)]
        for p in params:
            p.grad = None
        full, local, cols = token_log_probs(model, ids, targets, packed=False, loss=True)
        count = mask.sum()
        (-(local * mask[:, cols]).sum() / count).backward()
        losses.append(float(-(full * mask).sum() / count))
        for p, m in zip(params, master):
            grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            if cp > 1:
                dist.all_reduce(grad, group=ps.get_context_parallel_group())
            m.grad = grad
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return losses


def _batches(vocab: int, n: int = 4, seed: int = 7) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.ones(ROWS, SEQ)))
    return out


def _with_cp(cp: int, fn):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1, context_parallel_size=cp)
    try:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
        return fn()
    finally:
        ps.destroy_model_parallel()


def single_rank_worker(rank, world_size, spec):
    """CP 1: the generated sequences (bf16), their generation log-probs, the training forward's log-probs (bf16 and
    fp32, BSHD and packed) and the CP 1 loss curve."""
    from hp_megatron.platform import apply_cpu_training_shims

    apply_cpu_training_shims(0)
    config_json, state = spec["config"], spec["state"]
    vocab = spec["vocab"]

    def run():
        from hp_megatron.generate import StaticGenerator, sampling_params

        bf16 = _model(config_json, state, cp=1, method=None, dtype=torch.bfloat16, backend=spec["backend"]).eval()
        fp32 = _model(config_json, state, cp=1, method=None, dtype=torch.float32, backend=spec["backend"]).eval()
        gen = torch.Generator().manual_seed(3)
        seq = spec["seq"]
        if spec["generate"]:
            prompts = [torch.randint(0, vocab, (PROMPT,), generator=gen).tolist() for _ in range(ROWS)]
            generator = StaticGenerator(bf16, vocab_size=vocab, max_positions=4 * SEQ, max_batch_size=ROWS,
                                        max_sequence_length=seq + 1)
            result = generator.generate(prompts, sampling_params(max_new_tokens=seq + 1 - PROMPT, top_k=0), seed=5)
            sequences = torch.tensor([p + t for p, t in zip(prompts, result.tokens)])
            # the log-probs of tokens PROMPT .. seq: the targets of inputs PROMPT-1 .. seq-1
            gen_log_probs = torch.tensor(result.log_probs)
        else:
            sequences, gen_log_probs = torch.randint(0, vocab, (ROWS, seq + 1), generator=gen), None
        ids, targets = sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous()
        packed = packed_batch(vocab)
        out = {"ids": ids, "targets": targets, "gen_log_probs": gen_log_probs, "packed": packed}
        with torch.no_grad():
            for name, model in (("bf16", bf16), ("fp32", fp32)):
                out[f"bshd_{name}"] = token_log_probs(model, ids, targets, packed=False)
                out[f"packed_{name}"] = token_log_probs(model, packed[0], packed[1], packed=True)
        if spec["steps"]:
            train = _model(config_json, state, cp=1, method=None, dtype=torch.bfloat16, backend=spec["backend"])
            out["losses"] = _train(train, _batches(vocab), spec["steps"])
        return out

    return _with_cp(1, run)


def cp_worker(rank, world_size, spec, single):
    """CP = world size: each method's bf16 training-forward log-probs (BSHD: the generated sequences; packed), and
    at ``spec["train_cp"]`` the loss curve of ``spec["train_method"]``."""
    from hp_megatron.platform import apply_cpu_training_shims

    apply_cpu_training_shims(0)
    config_json, state = spec["config"], spec["state"]

    def run():
        out = {}
        ids, targets = single["ids"], single["targets"]
        packed = single["packed"]
        for method in spec["methods"]:
            model = _model(config_json, state, cp=world_size, method=method, dtype=torch.bfloat16,
                           backend=spec["backend"]).eval()
            with torch.no_grad():
                out[method] = {"bshd": token_log_probs(model, ids, targets, packed=False),
                               "packed": token_log_probs(model, packed[0], packed[1], packed=True)}
        if spec["steps"] and world_size == spec["train_cp"]:
            train = _model(config_json, state, cp=world_size, method=spec["train_method"], dtype=torch.bfloat16,
                           backend=spec["backend"])
            out["losses"] = _train(train, _batches(spec["vocab"]), spec["steps"])
        return out

    return _with_cp(world_size, run)


def measure(model: str = "qwen3_5_moe_text", cps=(2, 4), methods=CP_METHODS, steps: int = 50, train_cp: int = 4,
            train_method: str = "p2p", backend: str = "eager", seq: int = SEQ, generate: bool = True) -> dict:
    """The numbers of (a), (b) (``generate``; else random BSHD rows of ``seq`` tokens) and (c) (``steps`` > 0) of
    the module docstring as a dict."""
    config, state = checkpoint_state(model)
    vocab = config.get("text_config", config)["vocab_size"]
    spec = dict(config=config, state=state, vocab=vocab, steps=steps, train_cp=train_cp, train_method=train_method,
                methods=tuple(methods), backend=backend, seq=seq, generate=generate)
    single = spawn_gloo(single_rank_worker, 1, spec)[0]
    bshd_mask = torch.ones_like(single["bshd_bf16"])
    packed_mask = single["packed"][2]
    masks = {"bshd": bshd_mask, "packed": packed_mask}
    rows = [{"cp": 1, "method": "-", "layout": layout,
             "vs_cp1": {"max": 0.0, "mean": 0.0},
             "vs_fp32": _delta(single[f"{layout}_bf16"], single[f"{layout}_fp32"], masks[layout])}
            for layout in ("bshd", "packed")]
    gen_mask = torch.ones_like(bshd_mask[:, PROMPT - 1:])   # targets that generation sampled: tokens PROMPT .. seq
    generation = []
    if generate:
        generation.append({"cp": 1, "method": "-", **_delta(single["bshd_bf16"][:, PROMPT - 1:],
                                                             single["gen_log_probs"], gen_mask)})
    curves = {"cp1": single.get("losses")}
    for cp in cps:
        per = spawn_gloo(cp_worker, cp, spec, {k: single[k] for k in ("ids", "targets", "packed")})[0]
        for method in methods:
            for layout in ("bshd", "packed"):
                got = per[method][layout]
                rows.append({"cp": cp, "method": method, "layout": layout,
                             "vs_cp1": _delta(got, single[f"{layout}_bf16"], masks[layout]),
                             "vs_fp32": _delta(got, single[f"{layout}_fp32"], masks[layout])})
            if generate and cp == max(cps):
                generation.append({"cp": cp, "method": method, **_delta(per[method]["bshd"][:, PROMPT - 1:],
                                                                        single["gen_log_probs"], gen_mask)})
        if "losses" in per:
            curves[f"cp{cp}"] = per["losses"]
    return dict(model=model, rows=rows, generation=generation, curves=curves, steps=steps, train_cp=train_cp,
                train_method=train_method, backend=backend, seq=seq)


def tables(result: dict) -> str:
    lines = [f"Model `{result['model']}` (tiny random, `hp_megatron.models.tiny`), bf16, backend "
             f"`{result['backend']}`; BSHD: {ROWS} x {result['seq']} tokens (prompt + sampled), packed: one THD row of "
             f"documents {list(DOCS)}. |delta log p| of the target tokens.", "",
             "| CP | method | layout | max vs CP 1 | mean vs CP 1 | max vs fp32 | mean vs fp32 "
             "| mean vs fp32 / CP 1's |",
             "|---|---|---|---|---|---|---|---|"]
    base = {r["layout"]: r["vs_fp32"]["mean"] for r in result["rows"] if r["cp"] == 1}
    for r in result["rows"]:
        ratio = r["vs_fp32"]["mean"] / base[r["layout"]] if base[r["layout"]] else float("nan")
        lines.append(f"| {r['cp']} | {r['method']} | {r['layout']} | {r['vs_cp1']['max']:.2e} | "
                     f"{r['vs_cp1']['mean']:.2e} | {r['vs_fp32']['max']:.2e} | {r['vs_fp32']['mean']:.2e} | "
                     f"{ratio:.2f} |")
    if result["generation"]:
        lines += ["", "Generation's returned log-probs (bf16, CP 1, sampled at temperature 1) against the training "
                  "forward's of the same sequences:", "", "| training forward CP | method | max | mean |",
                  "|---|---|---|---|"]
        lines += [f"| {g['cp']} | {g['method']} | {g['max']:.2e} | {g['mean']:.2e} |" for g in result["generation"]]
    curves = result["curves"]
    if curves.get("cp1") and curves.get(f"cp{result['train_cp']}"):
        a, b = curves["cp1"], curves[f"cp{result['train_cp']}"]
        gap = max(abs(x - y) for x, y in zip(a, b))
        lines += ["", f"{result['steps']} bf16 training steps (Adam, fp32 master weights, lr 3e-3): loss at CP 1 "
                  f"{a[0]:.4f} -> {a[-1]:.4f}, at CP {result['train_cp']} ({result['train_method']}) "
                  f"{b[0]:.4f} -> {b[-1]:.4f}; largest per-step difference {gap:.2e}."]
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    """The loss curves side by side into ``path``; False when matplotlib is not importable."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {k: v for k, v in result["curves"].items() if v}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, losses in curves.items():
        left.plot(range(1, len(losses) + 1), losses, label=name.replace("cp", "CP "))
    left.set(xlabel="step", ylabel="loss", title=f"{result['model']}, bf16")
    left.legend()
    cp = f"cp{result['train_cp']}"
    if "cp1" in curves and cp in curves:
        right.plot(range(1, len(curves[cp]) + 1), [a - b for a, b in zip(curves[cp], curves["cp1"])])
        right.set(xlabel="step", ylabel=f"loss CP {result['train_cp']} - CP 1",
                  title=f"difference ({result['train_method']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3_5_moe_text", help="an architecture of hp_megatron.models.tiny")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=list(CP_METHODS), choices=CP_METHODS)
    parser.add_argument("--steps", type=int, default=50, help="training steps of (c); 0: none")
    parser.add_argument("--train-method", default="p2p", choices=CP_METHODS)
    parser.add_argument("--backend", default="eager", choices=("eager", "triton"))
    parser.add_argument("--plot", default=None, help="PNG of (c)'s loss curves (needs matplotlib)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    result = measure(args.model, tuple(args.cp), tuple(args.methods), args.steps, max(args.cp), args.train_method,
                     args.backend)
    result["meta"] = run_meta("parity.py", argv)
    text = tables(result)
    if args.plot:
        drawn = plot(result, args.plot)
        text += f"\n\n![loss curves]({os.path.relpath(args.plot, 'docs')})" if drawn else \
            "\n\n(no picture: matplotlib is not installed)"
    publish(result, text, args, f"parity_{args.model}",
            f"### CP numerics for RL: {args.model} ({result['meta']['command']})")


if __name__ == "__main__":
    main()
