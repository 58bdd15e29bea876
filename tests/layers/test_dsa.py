"""DSAttention (DeepSeek Sparse Attention on our MLA) on one rank: equals transformers' DeepSeek-V3.2 and GLM-5
attention modules (tiny random, index_topk < sequence) in output and in the gradients of the input and of every
non-indexer parameter (transformers runs its indexer without gradients), BSHD and packed THD; GLM-5's cross-layer
top-k sharing; the selection against an fp64 reference and the sparse attention over a given selection against a
plain masked softmax (so near-ties of the top-k cannot hide an attention error); the indexer loss of both stages
against megatron-core 0.19's ``compute_dsa_indexer_loss`` on the same scores, value and indexer gradients.

Top-k is discontinuous: every comparison of two selections first asserts that the reference's k-th and (k+1)-th
scores differ by more than ``MARGIN`` for every query that sees more than k keys (the seeds were picked for it).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.support.mla_layer import make_config, mla_submodules
from tests.support.reference import rel_err

warnings.filterwarnings("ignore", category=UserWarning)

T, TOPK, HIDDEN = 16, 5, 32
MARGIN = 1e-4
INDEXER = {"wq_b.weight": "linear_wq_b.weight", "wk.weight": "linear_wk.weight", "k_norm.weight": "k_norm.weight",
           "k_norm.bias": "k_norm.bias", "weights_proj.weight": "linear_weights_proj.weight"}
HF_GRADS = {"q_a_proj.weight": "linear_q_down_proj.weight", "q_a_layernorm.weight": "q_layernorm.weight",
            "q_b_proj.weight": "linear_q_up_proj.weight", "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
            "kv_a_layernorm.weight": "kv_layernorm.weight", "kv_b_proj.weight": "linear_kv_up_proj.weight",
            "o_proj.weight": "linear_proj.weight"}


def _hf_config(family, **extra):
    common = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_topk=TOPK, index_n_heads=4,
                  index_head_dim=8, max_position_embeddings=64, num_hidden_layers=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "deepseek_v32":
        from transformers import DeepseekV32Config
        cfg = DeepseekV32Config(**common, **extra)
    else:
        from transformers import GlmMoeDsaConfig
        cfg = GlmMoeDsaConfig(**common, **extra)
    cfg._attn_implementation = "eager"
    return cfg


def _hf_modules(family, cfg, layer):
    if family == "deepseek_v32":
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (DeepseekV32Attention as Attention,
                                                                            DeepseekV32RotaryEmbedding as Rotary)
    else:
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (GlmMoeDsaAttention as Attention,
                                                                          GlmMoeDsaRotaryEmbedding as Rotary)
    return Attention(cfg, layer).float(), Rotary(cfg)


def _our_config(family, **extra):
    fields = dict(dsa_indexer_n_heads=4, dsa_indexer_head_dim=8, dsa_indexer_topk=TOPK, dsa_indexer_k_norm_epsilon=1e-6,
                  dsa_indexer_rope_interleaved=family == "glm_moe_dsa")
    return make_config(rope_type="rope", **{**fields, **extra})


def _our_layer(config, group, layer_number=1, **kwargs):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from layers.mixers.mla.dsa import DSAttention

    return DSAttention(config, mla_submodules(), layer_number=layer_number,
                       pg_collection=ProcessGroupCollection(tp=group, cp=group), **kwargs)


def _load(layer, hf):
    from layers.mixers.mla.layer import mla_state_dict_from_hf

    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("indexer.")}
    ours = mla_state_dict_from_hf(state, layer.config)
    ours.update({f"indexer.{INDEXER[k[len('indexer.'):]]}": v for k, v in hf.state_dict().items()
                 if k.startswith("indexer.")})
    layer.load_state_dict(ours)


def _reference_scores(hf, x, cos, sin, interleaved, cu=None):
    """fp64 indexer scores [B, T, T] from transformers' weights (causal, per document; -inf elsewhere)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (apply_rotary_pos_emb,
                                                                        apply_rotary_pos_emb_interleave)
    ix = hf.indexer
    x = x.double()
    qr = hf.q_a_layernorm(hf.q_a_proj(x.float())).double()
    B, n = x.shape[:2]
    q = (qr @ ix.wq_b.weight.double().t()).view(B, n, ix.n_heads, ix.head_dim)
    k = torch.nn.functional.layer_norm(x @ ix.wk.weight.double().t(), (ix.head_dim,), ix.k_norm.weight.double(),
                                       ix.k_norm.bias.double(), 1e-6)[:, :, None]
    pe = hf.qk_rope_head_dim
    rope = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    q_rot, k_rot = rope(q[..., :pe], k[..., :pe], cos.double(), sin.double(), unsqueeze_dim=2)
    q, k = torch.cat((q_rot, q[..., pe:]), -1), torch.cat((k_rot, k[..., pe:]), -1)[:, :, 0]
    dots = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.head_dim ** -0.5)
    w = (x @ ix.weights_proj.weight.double().t()) * ix.n_heads ** -0.5
    scores = torch.einsum("bsht,bsh->bst", dots, w)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if cu is not None:
        doc = torch.searchsorted(cu, torch.arange(n), right=True)
        allowed &= doc[:, None] == doc[None, :]
    return scores.masked_fill(~allowed, float("-inf"))


def _assert_margin(scores, k=TOPK):
    top = scores.topk(k + 1, dim=-1).values
    rows = torch.isfinite(top[..., k])                      # queries that see more than k keys
    assert rows.any()
    gap = (top[..., k - 1] - top[..., k])[rows]
    assert float(gap.min()) > MARGIN, f"seed gives a near-tie at the top-k boundary (gap {float(gap.min()):.2e})"


def _mask(n):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _run(layer, x, packed=None):
    xs = x.detach().transpose(0, 1).contiguous().requires_grad_(True)
    out, bias = layer(xs, packed_seq_params=packed)
    assert bias is None
    return out.transpose(0, 1), xs


def _check_grads(hf, layer, x, ref, out, xs):
    grad = torch.randn_like(ref)
    (ref * grad).sum().backward()
    (out * grad).sum().backward()
    assert rel_err(xs.grad.transpose(0, 1), x.grad) <= 1e-5
    params = dict(layer.named_parameters())
    for hf_name, ours in HF_GRADS.items():
        assert rel_err(params[ours].grad, dict(hf.named_parameters())[hf_name].grad) <= 1e-5, hf_name
    assert all(p.grad is None for p in layer.indexer.parameters())   # no indexer loss configured


@pytest.mark.parametrize("family,seed", [("deepseek_v32", 0), ("glm_moe_dsa", 0)])
def test_matches_transformers(single_rank, family, seed):
    torch.manual_seed(seed)
    cfg = _hf_config(family, **({"indexer_types": ["full", "full"]} if family == "glm_moe_dsa" else {}))
    hf, rotary = _hf_modules(family, cfg, 0)
    B = 2
    x = torch.randn(B, T, HIDDEN, requires_grad=True)
    layer = _our_layer(_our_config(family), single_rank)
    _load(layer, hf)
    cos, sin = rotary(x, torch.arange(T)[None].expand(B, T))
    with torch.no_grad():
        _assert_margin(_reference_scores(hf, x, cos, sin, family == "glm_moe_dsa"))
    ref = hf(x, (cos, sin), _mask(T))[0]
    out, xs = _run(layer, x)
    assert rel_err(out, ref) <= 1e-5
    dense = make_config(rope_type="rope")          # sparsity matters: the dense MLA of the same weights differs
    assert rel_err(out, _dense_output(dense, layer, x, single_rank)) > 1e-2
    _check_grads(hf, layer, x, ref, out, xs)


def _dense_output(config, layer, x, group):
    from layers.mixers.mla.layer import MultiLatentAttention

    dense = MultiLatentAttention(config, mla_submodules(), layer_number=1,
                                 pg_collection=__import__("megatron.core.process_groups_config", fromlist=["x"])
                                 .ProcessGroupCollection(tp=group, cp=group))
    dense.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("indexer.")})
    with torch.no_grad():
        return dense(x.detach().transpose(0, 1))[0].transpose(0, 1)


def test_glm5_shared_layer_reuses_topk(single_rank):
    """GLM-5 ``indexer_types = [full, shared]`` = megatron-core's ``dsa_indexer_topk_freq=2``,
    ``dsa_indexer_skip_topk_offset=1``: layer 2 has no indexer and attends to layer 1's selection."""
    torch.manual_seed(1)
    cfg = _hf_config("glm_moe_dsa", indexer_types=["full", "shared"])
    hf0, rotary = _hf_modules("glm_moe_dsa", cfg, 0)
    hf1, _ = _hf_modules("glm_moe_dsa", cfg, 1)
    x = torch.randn(1, T, HIDDEN)
    config = _our_config("glm_moe_dsa", dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    ours0, ours1 = _our_layer(config, single_rank, 1), _our_layer(config, single_rank, 2)
    assert ours0.indexer is not None and ours1.indexer is None and hf1.indexer is None
    _load(ours0, hf0)
    from layers.mixers.mla.layer import mla_state_dict_from_hf
    ours1.load_state_dict(mla_state_dict_from_hf(hf1.state_dict(), config))
    cos, sin = rotary(x, torch.arange(T)[None])
    with torch.no_grad():
        _assert_margin(_reference_scores(hf0, x, cos, sin, True))
        h0, _, topk = hf0(x, (cos, sin), _mask(T))
        ref = hf1(h0, (cos, sin), _mask(T), prev_topk_indices=topk)[0]
        a = ours0(x.transpose(0, 1))[0]
        out = ours1(a)[0].transpose(0, 1)
    assert rel_err(out, ref) <= 1e-5


def test_packed_documents(single_rank):
    """THD: positions restart per document and the top-k is chosen inside each document; equals transformers run
    on each document alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    cfg = _hf_config("deepseek_v32")
    hf, rotary = _hf_modules("deepseek_v32", cfg, 0)
    lengths = [9, 7, 12]
    cu = torch.tensor([0, 9, 16, 28], dtype=torch.int32)
    x = torch.randn(1, sum(lengths), HIDDEN, requires_grad=True)
    layer = _our_layer(_our_config("deepseek_v32"), single_rank)
    _load(layer, hf)
    refs = []
    for d, n in enumerate(lengths):
        xd = x[:, int(cu[d]):int(cu[d + 1])]
        cos, sin = rotary(xd, torch.arange(n)[None])
        with torch.no_grad():
            if n > TOPK + 1:
                _assert_margin(_reference_scores(hf, xd, cos, sin, False))
        refs.append(hf(xd, (cos, sin), _mask(n))[0])
    ref = torch.cat(refs, dim=1)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    out, xs = _run(layer, x, packed)
    assert rel_err(out, ref) <= 1e-5
    _check_grads(hf, layer, x, ref, out, xs)


def test_selection_and_sparse_attention_against_references():
    """select_topk against an fp64 full-matrix top-k (THD, query blocks smaller than the sequence, a CP-like
    subset of queries); sparse_attention over a given selection against a plain masked softmax, values and
    gradients (independent of any top-k tie)."""
    from layers.mixers.mla.sparse import select_topk, sparse_attention

    torch.manual_seed(3)
    n, hi, d, k = 24, 3, 8, 6
    cu = torch.tensor([0, 10, 24])
    iq, iw, ik = torch.randn(1, n, hi, d), torch.randn(1, n, hi), torch.randn(1, n, d)
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23])      # the zigzag shard of CP rank 0 of 2
    scores = torch.einsum("bshd,btd->bsht", iq.double(), ik.double()).relu()
    scores = torch.einsum("bsht,bsh->bst", scores, iw.double())
    doc = torch.searchsorted(cu, torch.arange(n), right=True)
    allowed = (torch.arange(n)[None] <= torch.arange(n)[:, None]) & (doc[:, None] == doc[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))[:, ids]
    _assert_margin(scores, k)
    got = select_topk(iq[:, ids], iw[:, ids], ik, k, q_ids=ids, cu_seqlens=cu, block_size=5)
    for row, qid in enumerate(ids.tolist()):
        visible = int(allowed[qid].sum())
        want = set(scores[0, row].topk(min(k, visible)).indices.tolist())
        assert set(got[0, row][got[0, row] >= 0].tolist()) == want, qid
        assert int((got[0, row] < 0).sum()) == max(k - visible, 0)

    q = torch.randn(1, len(ids), 2, 5, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, n, 2, 5, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, n, 2, 3, dtype=torch.float64, requires_grad=True)
    out = sparse_attention(q, key, value, got, scale=0.3, block_size=4)
    chosen = torch.zeros(len(ids), n, dtype=torch.bool)
    for row in range(len(ids)):
        chosen[row, got[0, row][got[0, row] >= 0]] = True
    logits = torch.einsum("bshd,bthd->bhst", q, key) * 0.3
    ref = torch.einsum("bhst,bthd->bshd", logits.masked_fill(~chosen, float("-inf")).softmax(-1), value)
    assert rel_err(out, ref) <= 1e-12
    grad = torch.randn_like(ref)
    g_ours = torch.autograd.grad((out * grad).sum(), (q, key, value))
    g_ref = torch.autograd.grad((ref * grad).sum(), (q, key, value))
    for a, b in zip(g_ours, g_ref):
        assert rel_err(a, b) <= 1e-12


class _TP1:
    class tp:
        @staticmethod
        def size():
            return 1


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_equals_megatron_core(sparse):
    """Our blocked indexer loss (value, and gradients of the indexer's q, weights and k) equals megatron-core
    0.19's ``compute_dsa_indexer_loss`` fed the same index scores (computed from q, w, k by plain einsums here);
    dense warm-up (``sparse=False``: KL over every causal key) and sparse stage (KL over the selected keys)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss

    from layers.mixers.mla.sparse import indexer_loss, select_topk

    torch.manual_seed(5)
    B, n, H, dq, hi, d, k = 2, 12, 3, 7, 2, 8, 4
    q, key = torch.randn(B, n, H, dq), torch.randn(B, n, H, dq)
    iq0, iw0, ik0 = torch.randn(B, n, hi, d), torch.randn(B, n, hi), torch.randn(B, n, d)
    topk = select_topk(iq0, iw0, ik0, k)
    ours_in = [t.clone().requires_grad_(True) for t in (iq0, iw0, ik0)]
    ours = indexer_loss(q, key, *ours_in, topk, scale=0.4, sparse=sparse, block_size=5)
    ours.backward()

    ref_in = [t.clone().requires_grad_(True) for t in (iq0, iw0, ik0)]
    scores = torch.einsum("bsht,bsh->bst", torch.einsum("bshd,btd->bsht", ref_in[0], ref_in[2]).relu(), ref_in[1])
    ref = compute_dsa_indexer_loss(scores, topk, q.transpose(0, 1), key.transpose(0, 1), 0.4, 1.0, sparse, _TP1())
    ref.backward()
    assert rel_err(ours, ref) <= 1e-5
    for a, b in zip(ours_in, ref_in):
        assert rel_err(a.grad, b.grad) <= 1e-5


def test_indexer_trained_by_loss_only(single_rank):
    """With ``dsa_indexer_loss_coeff`` the indexer's parameters get gradients (from the indexer loss alone: the
    main model's gradients are those without the loss), and the loss lands in megatron-core's tracker."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    torch.manual_seed(0)
    x = torch.randn(T, 1, HIDDEN)
    grads = {}
    for coeff in (None, 0.5):
        torch.manual_seed(1)
        layer = _our_layer(_our_config("deepseek_v32", dsa_indexer_loss_coeff=coeff,
                                       dsa_indexer_use_sparse_loss=True), single_rank)
        DSAIndexerLossLoggingHelper.tracker.clear()
        out, _ = layer(x.clone().requires_grad_(True))
        out.sum().backward()
        grads[coeff] = {n: p.grad for n, p in layer.named_parameters()}
    assert all(g is None for n, g in grads[None].items() if n.startswith("indexer."))
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads[0.5].items() if n.startswith("indexer."))
    for name, g in grads[None].items():
        if not name.startswith("indexer."):
            assert torch.equal(g, grads[0.5][name]), name
    assert float(DSAIndexerLossLoggingHelper.tracker["values"][0]) > 0


def test_input_errors(single_rank):
    with pytest.raises(ValueError, match="q_lora_rank"):
        _our_layer(_our_config("deepseek_v32", q_lora_rank=None), single_rank)
    with pytest.raises(ValueError, match="'latent' strategy only"):
        _our_layer(_our_config("deepseek_v32"), single_rank, cp_strategy="latent_ulysses")
    with pytest.raises(ValueError, match="dsa_indexer_topk"):
        _our_layer(_our_config("deepseek_v32", dsa_indexer_topk=None), single_rank)


PROMPTS, TOTAL = (3, 5, 7), 9     # megatron's controller: prefill the shortest prompt, then one token per step
SCHEDULES = {"controller": ((3,) + (1,) * 6, (3,)), "continuation_microbatches": ((4, 3, 1, 1), (2, 1))}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_decode_equals_full_forward(single_rank, schedule):
    """Generation through megatron-core's StaticInferenceContext (prefill, then decode steps; or a chunked
    continuation on two micro-batches): every position equals the training forward over the whole sequence; the
    context holds the latent cache and the indexer key cache; a GLM-5 skip layer reads its source's top-k."""
    from tests.support.dsa_margin import recording_margins
    from tests.support.generation import generate

    torch.manual_seed(2)
    config = _our_config("glm_moe_dsa", dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    first, second = _our_layer(config, single_rank, 1).eval(), _our_layer(config, single_rank, 2).eval()

    class Pair(torch.nn.Module):          # a full layer, then a skip layer that reuses its selection
        def __init__(self):
            super().__init__()
            self.first, self.second = first, second
            self.training = False

        def forward(self, x, **kw):
            return self.second(self.first(x, **kw)[0], **kw)

    pair = Pair().eval()
    x = torch.randn(TOTAL, len(PROMPTS), HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), recording_margins() as gaps:
        full = pair(x)[0]
    assert min(gaps) > MARGIN
    got, context = generate(pair, x, *SCHEDULES[schedule])
    errors = [rel_err(got[t], full[t]) for t in range(TOTAL)]
    assert max(errors) < 1e-4, errors
    d = first.dims
    assert [tuple(t.shape) for t in context.key_value_memory_dict[1]] == [(4, TOTAL, d.kv_lora_rank + d.pe),
                                                                          (4, TOTAL, 8)]
    assert [tuple(t.shape) for t in context.key_value_memory_dict[2]] == [(4, TOTAL, d.kv_lora_rank + d.pe)]


def test_selfcheck_rows():
    """The self-check's DSA rows (hp_megatron.selfcheck.dsa) pass in bf16 on this CPU, and a corrupted sparse
    attention fails its rows."""
    from unittest import mock

    import hp_megatron.selfcheck.dsa as rows_module

    rows = rows_module.dsa_rows(torch.device("cpu"), torch.bfloat16)
    assert [(r.phase, r.status) for r in rows] == [("scores", "pass"), ("fwd", "pass"), ("bwd", "pass")]
    plain = rows_module.sparse_attention
    calls = []

    def corrupted(*args, **kwargs):        # the checked (first) run 10% off
        calls.append(1)
        out = plain(*args, **kwargs)
        return out * 1.1 if len(calls) == 1 else out

    with mock.patch.object(rows_module, "sparse_attention", corrupted):
        rows = rows_module.dsa_rows(torch.device("cpu"), torch.bfloat16)
    assert [r.status for r in rows] == ["pass", "FAIL", "FAIL"]
