"""Coming from megatron-core's own GatedDeltaNet (``megatron.core.ssm.gated_delta_net``, 0.17+): checkpoint keys.

megatron-core's GDN layer and ours (``layers.GatedDeltaNet``) hold the same tensors under the same names with the
same packing, at every TP size: ``in_proj.weight`` rows ``[q, k, v, z, beta, alpha]`` (each TP rank: its slice of
each part, in that order), saved by ``sharded_state_dict`` as the parts ``in_proj.weight.{query,key,value,z,beta,
alpha}``; ``conv1d.weight`` ``[q; k; v]`` channels (``nn.Conv1d``'s ``[D, 1, W]``; parts ``conv1d.weight.{query,
key,value}``, ``conv1d.bias`` likewise); ``A_log`` and ``dt_bias`` ``[HV]`` (TP axis 0); ``out_norm.weight [V]``
(replicated; zero-centred exactly when ``config.layernorm_zero_centered_gamma``, in both layers unless our
``gated_norm_zero_centered_gamma`` says otherwise); ``out_proj.weight [h, HV*V]`` (TP axis 1). Value head i reads
key head ``i // (HV/H)`` in both. (tests/models/test_megatron_core_gdn.py compares the two layers'
``sharded_state_dict`` at TP2 piece by piece.) So a GDN tensor is never transformed; what differs is around it:

* megatron-core builds GDN only from Transformer Engine specs, which fuse each layer's input norm into the
  projection after it: ``self_attention.in_proj.layer_norm_weight`` (GDN), ``self_attention.linear_qkv.
  layer_norm_weight`` (attention), ``mlp.linear_fc1.layer_norm_weight`` (dense MLP); our layers keep
  ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` (MoE layers have the separate norm on both sides);
* megatron-core's ``HybridModel`` counts a mixer and the MLP after it as two layers (pattern ``"G-G-*-"``: GDN,
  MLP, GDN, MLP, attention, MLP) and calls its final norm ``decoder.final_norm``; our GPTModel layer ``i`` holds
  mixer and MLP (pattern ``"GGA"``) and the final norm is ``decoder.final_layernorm``.

:class:`KeyMap` is that correspondence for one model, both ways (``to_ours`` / ``to_theirs`` of a key, of a
``state_dict`` or of a whole ``torch_dist`` checkpoint): :func:`gpt_key_map` for a megatron-core GPTModel with
``experimental_attention_variant="gated_delta_net"``, :func:`hybrid_key_map` for a HybridModel. Renaming is exact
(bytes unchanged): to ours and back gives the original keys and tensors. Refused: megatron-core's ``bias=True``
GDN (``in_proj.bias`` / ``out_proj.bias``: our GDN has no projection biases), LayerNorm models
(``layer_norm_bias``: our layers use RMSNorm), Mamba / MLA / DSA layers and MTP (``mtp.*``) of a HybridModel.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# HybridModel symbols (megatron.core.models.hybrid.hybrid_layer_allocation.Symbols) this mapping takes
HYBRID_MIXERS = {"G": "G", "*": "A"}   # GDN, attention -> our pattern symbols
HYBRID_MLPS = {"-": False, "E": True}  # dense MLP, MoE (is_moe)
HYBRID_PIPE = "|"
FUSED_NORM = {"G": "self_attention.in_proj.layer_norm_weight", "A": "self_attention.linear_qkv.layer_norm_weight"}
FUSED_MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
REFUSED = re.compile(r"(\.layer_norm_bias|self_attention\.(in_proj|out_proj)\.bias|input_layernorm\.bias|"
                     r"pre_mlp_layernorm\.bias)$")


@dataclass(frozen=True)
class _Pair:
    theirs: str
    ours: str
    exact: bool   # a whole key (a fused norm); else a key prefix


@dataclass(frozen=True)
class KeyMap:
    """One megatron-core GDN model's keys <-> our GPTModel's. ``pattern``: our layer pattern (``G`` GDN, ``A``
    attention), ``moe_layers``: one bool per layer, for building our model (``hp_layer_pattern``, ``moe_layer_freq``).
    Keys are ``state_dict`` keys or ``torch_dist`` checkpoint keys (the parts ``.query`` ..., ``_extra_state``
    objects with their ``/shard_...`` suffix): both are the module path with global layer numbers."""

    pattern: str
    moe_layers: tuple
    pairs: tuple

    def _translate(self, key: str, theirs_to_ours: bool) -> str:
        base, sep, suffix = key.partition("/")
        if theirs_to_ours and REFUSED.search(base):
            raise ValueError(f"{base}: a bias of megatron-core's GDN projections (bias=True) or of a LayerNorm has no "
                             "counterpart in our layers (no projection biases, RMSNorm)")
        best = None
        for pair in self.pairs:
            src, dst = (pair.theirs, pair.ours) if theirs_to_ours else (pair.ours, pair.theirs)
            if (base == src) if pair.exact else base.startswith(src):
                if pair.exact:
                    return dst + sep + suffix
                if best is None or len(src) > len(best[0]):
                    best = (src, dst)
        if best is None:
            side = "megatron-core's" if theirs_to_ours else "our"
            raise ValueError(f"{base}: no counterpart for this key of {side} model (layers: {self.pattern!r}; Mamba, "
                             "MLA, DSA and MTP layers of a HybridModel are not mapped)")
        return best[1] + base[len(best[0]):] + sep + suffix

    def to_ours(self, key: str) -> str:
        """Our key of megatron-core's ``key``."""
        return self._translate(key, True)

    def to_theirs(self, key: str) -> str:
        """megatron-core's key of our ``key``."""
        return self._translate(key, False)

    def state_dict_to_ours(self, state_dict: dict) -> dict:
        """megatron-core's model ``state_dict`` (any TP rank's: the local tensors have the same layout) -> ours."""
        return _renamed(state_dict, self.to_ours)

    def state_dict_to_theirs(self, state_dict: dict) -> dict:
        return _renamed(state_dict, self.to_theirs)

    def checkpoint_to_ours(self, load: str, save: str, *, target=None, **kwargs):
        """megatron-core's ``torch_dist`` checkpoint ``load`` -> ours at ``save`` (``hp_megatron.convert.rename``;
        ``target``: our model at TP=PP=1, to check the result against and take ``_extra_state`` objects from)."""
        from hp_megatron.convert.rename import rename_checkpoint

        return rename_checkpoint(load, save, self.to_ours, target=target, **kwargs)

    def checkpoint_to_theirs(self, load: str, save: str, *, target=None, **kwargs):
        """Our ``torch_dist`` checkpoint ``load`` -> megatron-core's at ``save`` (``target``: their model)."""
        from hp_megatron.convert.rename import rename_checkpoint

        return rename_checkpoint(load, save, self.to_theirs, target=target, **kwargs)


def _renamed(state_dict: dict, rename) -> dict:
    out = {}
    for key, value in state_dict.items():
        new = rename(key)
        if new in out:
            raise ValueError(f"two keys are renamed to {new} (the second: {key})")
        out[new] = value
    return out


def _layer_pairs(i: int, symbol: str, is_moe: bool, mixer: int, mlp: int, fused_norms: bool) -> list:
    theirs_mix, theirs_mlp, ours = f"decoder.layers.{mixer}.", f"decoder.layers.{mlp}.", f"decoder.layers.{i}."
    pairs = [_Pair(theirs_mix + "self_attention.", ours + "self_attention.", False),
             _Pair(theirs_mlp + "mlp.", ours + "mlp.", False),
             _Pair(theirs_mlp + "pre_mlp_layernorm.", ours + "pre_mlp_layernorm.", False)]
    if fused_norms:
        pairs.append(_Pair(theirs_mix + FUSED_NORM[symbol], ours + "input_layernorm.weight", True))
        if not is_moe:
            pairs.append(_Pair(theirs_mlp + FUSED_MLP_NORM, ours + "pre_mlp_layernorm.weight", True))
    else:
        pairs.append(_Pair(theirs_mix + "input_layernorm.", ours + "input_layernorm.", False))
    return pairs


def _common_pairs(final_norm: str) -> list:
    return [_Pair("embedding.", "embedding.", False), _Pair("output_layer.", "output_layer.", False),
            _Pair(final_norm, "decoder.final_layernorm.", False)]


def gpt_key_map(pattern: str, moe_layers=None, *, fused_norms: bool = True) -> KeyMap:
    """A megatron-core GPTModel with ``experimental_attention_variant="gated_delta_net"``: ``pattern`` one symbol
    per layer, ``G`` where its ``linear_attention_freq`` pattern has 1 (GDN), ``A`` where 0 (attention);
    ``moe_layers`` one bool per layer (its ``moe_layer_freq``; default dense everywhere). ``fused_norms``: its
    layers come from megatron's Transformer Engine spec (the only one it offers for GDN); False for a spec with
    separate ``input_layernorm`` / ``pre_mlp_layernorm`` modules."""
    moe = _check_layers(pattern, moe_layers)
    pairs = [p for i, (s, m) in enumerate(zip(pattern, moe)) for p in _layer_pairs(i, s, m, i, i, fused_norms)]
    return KeyMap(pattern, moe, tuple(pairs + _common_pairs("decoder.final_layernorm.")))


def hybrid_key_map(hybrid_layer_pattern: str, *, fused_norms: bool = True) -> KeyMap:
    """A megatron-core HybridModel of ``hybrid_layer_pattern`` (Megatron-LM's ``--hybrid-layer-pattern``; ``|``
    pipeline splits allowed): a GDN (``G``) or attention (``*``) layer, each followed by its MLP (``-``) or MoE
    (``E``) layer, becomes one of our layers."""
    if "/" in hybrid_layer_pattern:
        raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r}: multi-token-prediction layers ('/...') "
                         "are not mapped")
    layers = hybrid_layer_pattern.replace(HYBRID_PIPE, "")
    pattern, moe, pairs = "", [], []
    for j in range(0, len(layers), 2):
        pair = layers[j:j + 2]
        if len(pair) != 2 or pair[0] not in HYBRID_MIXERS or pair[1] not in HYBRID_MLPS:
            raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r}: each of our layers is a mixer "
                             f"{sorted(HYBRID_MIXERS)} followed by an MLP {sorted(HYBRID_MLPS)}; got {pair!r} at "
                             f"layer {j}")
        i = len(pattern)
        pattern += HYBRID_MIXERS[pair[0]]
        moe.append(HYBRID_MLPS[pair[1]])
        pairs += _layer_pairs(i, pattern[-1], moe[-1], j, j + 1, fused_norms)
    return KeyMap(pattern, tuple(moe), tuple(pairs + _common_pairs("decoder.final_norm.")))


def _check_layers(pattern: str, moe_layers) -> tuple:
    if not pattern or set(pattern) - set(FUSED_NORM):
        raise ValueError(f"pattern must be one symbol per layer of {sorted(FUSED_NORM)}, got {pattern!r}")
    moe = (False,) * len(pattern) if moe_layers is None else tuple(bool(m) for m in moe_layers)
    if len(moe) != len(pattern):
        raise ValueError(f"moe_layers has {len(moe)} entries for {len(pattern)} layers ({pattern!r})")
    return moe
