"""A mixer registered from a test module (tests/support/toy_mixer.py: ``T``, a causal EMA between column- and
row-parallel projections, one flag ``--hp-toy-ema-decay``) works in every entry point without a library edit.

* its forward at TP=2 (two gloo ranks) equals an fp64 reference computed here from the gathered weights with a
  token loop; its config field reaches the layer; a layer of it at CP=2 is refused (its declaration:
  ``MixerSupport.cp_methods == ()``) with the registry's one-line message; its decode path (a prefill of 5 tokens,
  then 7 one-token steps through megatron-core's ``StaticInferenceContext``) equals its full forward; as the MTP
  layer of a ``T`` model (``mtp_num_layers=1``, its declared ``mtp``) it is built and its MTP loss reaches its
  weights (non-zero gradients of the MTP layer's toy projections);
* examples/pretrain/pretrain_hybrid.py with ``--hp-mixer-module tests.support.toy_mixer --hp-layer-pattern TM``
  trains (3 iterations: losses finite, the last below the first);
* Megatron-LM's pretrain_gpt.py through examples/pretrain/megatron_lm/pretrain_gpt_hp.py (the launch script, one
  rank, ``--spec hp_megatron.specs hybrid_spec``) trains 2 iterations with the same flags, and its first loss equals
  the example's (the same model, data and initialisation).

The toy module is imported only in spawned ranks and launched processes: the registry of this pytest process keeps
the built-in mixers only.
"""
import math

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.megatron_lm_runs import NO_SAVE, example_records, run_script, write_data
from tests.support.paths import MEGATRON_LM

TOY = "tests.support.toy_mixer"
DECAY = 0.7
# the example's MLA defaults for the tiny dims, stated for the launch script (whose own MLA dims are large)
MLA_DIMS = ["--hp-mla-kv-lora-rank", "16", "--hp-mla-qk-head-dim", "8", "--hp-mla-qk-pos-emb-head-dim", "8",
            "--hp-mla-v-head-dim", "8"]
FLAGS = ["--hp-mixer-module", TOY, "--hp-toy-ema-decay", str(DECAY), "--hp-mla-cp-strategy", "latent",
         "--hp-mla-rope-type", "none"]


def _reference(x, w_in, w_out, decay):
    """fp64: u = x W_in^T, y_t = d y_(t-1) + (1 - d) u_t token by token, out = y W_out^T."""
    x, w_in, w_out = (t.double() for t in (x, w_in, w_out))
    u = x @ w_in.t()
    y, state = torch.empty_like(u), torch.zeros_like(u[0])
    for t in range(u.shape[0]):
        state = decay * state + (1 - decay) * u[t]
        y[t] = state
    return y @ w_out.t()


def _forward_worker(rank, world_size):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    import tests.support.toy_mixer  # noqa: F401  (registers T)
    from hp_megatron.config import hybrid_config
    from hp_megatron.registry import symbols
    from hp_megatron.specs import get_layer_spec, get_mixer_spec

    assert symbols()["T"] == "toy_ema"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    torch.manual_seed(0)
    config = hybrid_config(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                             use_cpu_initialization=True, tensor_model_parallel_size=world_size),
                           hp_layer_pattern="T", toy_ema_decay=DECAY)
    layer = build_module(get_mixer_spec("toy_ema"), config=config, layer_number=1)
    torch.manual_seed(1)
    x = torch.randn(12, 2, 16)
    out, bias = layer(x)
    gather = [torch.empty_like(layer.in_proj.weight) for _ in range(world_size)]
    dist.all_gather(gather, layer.in_proj.weight.detach())
    w_in = torch.cat(gather, 0)
    gather = [torch.empty_like(layer.out_proj.weight) for _ in range(world_size)]
    dist.all_gather(gather, layer.out_proj.weight.detach())
    w_out = torch.cat(gather, 1)
    cp_config = hybrid_config(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                                context_parallel_size=2))
    try:
        build_module(get_layer_spec("toy_ema"), config=cp_config, layer_number=1)
        refused = None
    except ValueError as err:
        refused = str(err)
    decoded = _decode(layer, x)
    mtp_grads = _mtp_grads(world_size)
    parallel_state.destroy_model_parallel()
    return {"out": out.detach(), "bias": bias, "ref": _reference(x, w_in, w_out, DECAY), "decay": layer.decay,
            "refused": refused, "decoded": decoded, "mtp_grads": mtp_grads}


def _decode(layer, x):
    """The layer's outputs over ``x`` from a 5-token prefill and one-token decode steps (static inference)."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext

    layer.eval()
    context, outs = StaticInferenceContext(max_batch_size=x.shape[1], max_sequence_length=x.shape[0]), []
    with torch.no_grad():
        for start, stop in [(0, 5)] + [(t, t + 1) for t in range(5, x.shape[0])]:
            outs.append(layer(x[start:stop], inference_context=context)[0])
            context.sequence_len_offset += stop - start
    layer.train()
    return torch.cat(outs)


def _mtp_grads(world_size):
    """``{name: grad norm}`` of the MTP layer's toy projections after the backward of a ``T`` model's loss with
    one MTP layer of the toy (``MixerSupport.mtp``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hp_megatron.config import hybrid_config
    from hp_megatron.model_builders import hybrid_gpt_model
    from hp_megatron.platform import CPU_SAFE_CONFIG, apply_cpu_shims
    from hp_megatron.specs import get_layer_spec

    apply_cpu_shims(2)
    config = hybrid_config(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                             **CPU_SAFE_CONFIG, tensor_model_parallel_size=world_size,
                                             mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0),
                           hp_layer_pattern="T", toy_ema_decay=DECAY)
    model = hybrid_gpt_model(config, get_layer_spec("toy_ema"), vocab_size=64, max_sequence_length=8,
                             position_embedding_type="none")
    ids = torch.randint(0, 64, (2, 8))
    loss = model(ids, torch.arange(8).expand_as(ids), None, labels=torch.roll(ids, -1, 1))
    loss.float().mean().backward()
    return {name: float(p.grad.norm()) for name, p in model.named_parameters()
            if name.startswith("mtp.") and "self_attention" in name}


def test_toy_forward_matches_fp64_reference_under_tp2():
    for result in run_distributed(_forward_worker, 2):
        assert result["decay"] == DECAY and result["bias"] is None
        torch.testing.assert_close(result["out"].double(), result["ref"], rtol=1e-5, atol=1e-6)
        # the registry's refusal (PatternLayer reads MixerSupport); megatron's build_module appends its own words
        assert result["refused"].startswith("toy EMA (T in the pattern T of layer 1) has no context-parallel "
                                            "implementation (MixerSupport.cp_methods is empty); got "
                                            "--context-parallel-size 2; mixers with CP: G=GDN"), result["refused"]
        torch.testing.assert_close(result["decoded"], result["out"], rtol=1e-5, atol=1e-6)
        grads = result["mtp_grads"]
        assert len(grads) == 2 and all(g > 0 for g in grads.values()), grads   # in_proj, out_proj of the MTP toy


def test_toy_registry_stays_out_of_this_process():
    from hp_megatron.registry import symbols

    assert "T" not in symbols()   # the spawned ranks and launches imported it, this process did not


@pytest.fixture(scope="module")
def data(pydoc_data, tmp_path_factory):
    return write_data(pydoc_data, str(tmp_path_factory.mktemp("toy_tokenizer")))


@pytest.fixture(scope="module")
def example_run(data):
    return example_records("TM", data, FLAGS)


def test_toy_trains_through_the_example(example_run):
    losses = [r["lm_loss"] for r in example_run if "lm_loss" in r]   # not the validation entries
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), example_run
    assert losses[-1] < losses[0], losses


@pytest.mark.skipif(MEGATRON_LM is None, reason="Megatron-LM's training code not found (tests/support/paths.py)")
def test_toy_trains_through_megatron_lm_pretrain_gpt(data, example_run, tmp_path):
    records, log = run_script("train_kimi_linear_like.sh", MLA_DIMS, str(tmp_path), str(tmp_path),
                              {**data, "ITERS": "2"},
                              ["--spec", "hp_megatron.specs", "hybrid_spec", "--hp-layer-pattern", "TM", *FLAGS,
                               "--eval-iters", "1", *NO_SAVE])
    assert [r["iteration"] for r in records] == [1, 2], records
    assert all(math.isfinite(r["lm loss"]) for r in records), records
    first = example_run[0]["lm_loss"]
    assert abs(records[0]["lm loss"] - first) <= 1e-5 * abs(first), (records[0], first)
