"""Post-norm layers (OLMo 2 / OLMo 3, OLMo-Hybrid's attention layers): ``h = h + norm_1(mixer(h))``,
``h = h + norm_2(mlp(h))``, no norm before either, where megatron-core's ``TransformerLayer`` is pre-norm
(``h = h + mixer(norm_1(h))``).

A layer whose symbol is in ``config.hp_post_norm_symbols`` (``--hp-post-norm-layers``) is built with its input and
pre-MLP norms removed and its mixer and MLP replaced by subclasses of their own classes (:func:`post_normed`) that
own a ``post_norm`` and apply it to their output (bias added first): parameter names stay the mixer's and the MLP's
(``self_attention.linear_qkv.weight``, ``self_attention.post_norm.weight``, ``mlp.post_norm.weight``), the norm
weights are the layer's norm class, so under sequence parallelism they are marked ``sequence_parallel`` as the
pre-norm ones are. Dense MLPs only (no family with post-norm MoE layers; refused).
"""
from __future__ import annotations

import functools
from dataclasses import replace


@functools.lru_cache(maxsize=None)
def post_normed(cls: type, norm) -> type:
    """``cls`` (a megatron module returning ``(output, bias)``) with a ``post_norm`` (``norm(config=, hidden_size=,
    eps=)``) over its output: ``forward`` returns ``(post_norm(output + bias), None)``."""

    class PostNormed(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            config = self.config
            self.post_norm = norm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            if bias is not None:
                out = out + bias
            return self.post_norm(out), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """The module's own, with ``post_norm`` replicated over its TP group (megatron-core's ``MLP`` would
            give it no TP group: every TP rank a main replica)."""
            post_norm = self._modules.pop("post_norm")   # megatron-core 0.16's MLP asks every child for its own
            try:
                state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self._modules["post_norm"] = post_norm   # it was the last child: the order is unchanged
            state.update(_replicated_sharded_state_dict(self, "post_norm", prefix, sharded_offsets, metadata))
            return state

    PostNormed.__name__ = PostNormed.__qualname__ = f"PostNorm{cls.__name__}"
    PostNormed.__module__ = __name__
    return PostNormed


def _replicated_sharded_state_dict(owner, name: str, prefix: str, sharded_offsets, metadata) -> dict:
    """``owner.<name>``'s tensors as ShardedTensors replicated over the TP group (``owner.tp_group``, else
    megatron's) and the data x context group."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.transformer.utils import sharded_state_dict_default

    module = getattr(owner, name)
    tp_group = getattr(owner, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    keywords = {"tp_group": tp_group} if "tp_group" in inspect.signature(sharded_state_dict_default).parameters else {}
    return sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata, **keywords)


def _built_class(spec):
    """The class a layer submodule spec builds: a ``ModuleSpec``'s module, megatron-core 0.19's
    ``partial(Cls, ...)`` or ``partial(Cls.as_mlp_submodule, ...)``; None otherwise."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return spec.module if isinstance(spec.module, type) else None
    if isinstance(spec, functools.partial):
        func = spec.func
        return func if isinstance(func, type) else getattr(func, "__self__", None)
    return None


def _post_normed_spec(spec, norm, what: str, config=None):
    """``spec`` building the :func:`post_normed` subclass of its class instead (megatron-core 0.19's
    ``as_mlp_submodule`` given ``config.ffn_hidden_size``, which it would otherwise take with a deprecation
    warning)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    cls = _built_class(spec)
    if not isinstance(cls, type):
        raise ValueError(f"post-norm layers need the {what} spec as a ModuleSpec of a class (or a partial of a "
                         f"class or classmethod), got {spec!r}")
    sub = post_normed(cls, norm)
    if isinstance(spec, ModuleSpec):
        return replace(spec, module=sub)
    func = sub if spec.func is cls else getattr(sub, spec.func.__name__)
    keywords = dict(spec.keywords)
    if config is not None and getattr(func, "__name__", "") == "as_mlp_submodule":
        keywords.setdefault("ffn_hidden_size", config.ffn_hidden_size)
    return functools.partial(func, *spec.args, **keywords)


def is_post_norm(config, symbol: str) -> bool:
    """Whether layers of our mixer ``symbol`` are post-norm (``config.hp_post_norm_symbols``)."""
    return symbol in (getattr(config, "hp_post_norm_symbols", None) or "")


def post_norm_mixer(layer):
    """``layer`` (``TransformerLayerSubmodules``) without its input norm, its mixer owning that norm as
    ``post_norm`` over its output."""
    from megatron.core.transformer.identity_op import IdentityOp

    return replace(layer, input_layernorm=IdentityOp,
                   self_attention=_post_normed_spec(layer.self_attention, layer.input_layernorm, "mixer"))


def post_norm_mlp(config, layer):
    """``layer`` without its pre-MLP norm, its (dense) MLP owning that norm as ``post_norm``; ValueError for a MoE
    MLP."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = layer.mlp
    if isinstance(_built_class(mlp), type) and issubclass(_built_class(mlp), MoELayer):
        raise ValueError(f"hp_post_norm_symbols={config.hp_post_norm_symbols!r}: a post-norm layer has a MoE MLP; "
                         "post-norm layers have dense MLPs only")
    return replace(layer, pre_mlp_layernorm=IdentityOp,
                   mlp=_post_normed_spec(mlp, layer.pre_mlp_layernorm, "MLP", config))


def with_post_norm(config, symbol: str, layer):
    """``layer`` (``TransformerLayerSubmodules``, a GPT layer: mixer and MLP) as a post-norm layer when ``symbol`` is
    in ``config.hp_post_norm_symbols``, else unchanged. ValueError for a MoE MLP."""
    if not is_post_norm(config, symbol):
        return layer
    return post_norm_mixer(post_norm_mlp(config, layer))
