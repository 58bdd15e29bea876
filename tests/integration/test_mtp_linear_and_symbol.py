"""The MTP block follows the layer spec's linears (``--hp-linear``: its ``eh_proj`` is the decoder's column-parallel
class), ``get_spec_provider`` refuses a ``linear`` a provider does not have, and a spec's declared MTP kind against
another ``--hp-mtp-layer-symbol`` is a one-line ValueError instead of a silent choice."""
from __future__ import annotations

import pytest
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class StandInTEColumn(ColumnParallelLinear):
    """Stands for ``TEColumnParallelLinear`` (Transformer Engine needs CUDA): a class of its own to be found."""


class StandInTERow(RowParallelLinear):
    """Stands for ``TERowParallelLinear``."""


@pytest.fixture
def te_linears(monkeypatch):
    import hp_megatron.specs.providers as providers

    monkeypatch.setattr(providers, "_te_linears", lambda: (StandInTEColumn, StandInTERow))


PATTERN = "GGAA"   # Qwen3-Next's; its MTP layers are attention layers


def _config(**fields):
    from hp_megatron.config import HybridTransformerConfig
    from hp_megatron.platform import CPU_SAFE_CONFIG

    return HybridTransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, linear_num_key_heads=4,
                                   linear_key_head_dim=8, hp_layer_pattern=PATTERN, mtp_num_layers=1,
                                   **CPU_SAFE_CONFIG, **fields)


def test_mtp_eh_proj_follows_the_specs_linears(single_rank, te_linears):
    from hp_megatron.specs import get_hybrid_layer_spec
    from hp_megatron.specs.mtp_specs import get_mtp_block_spec

    config = _config()
    te_spec = get_hybrid_layer_spec(PATTERN, "triton", linear="te", mtp_symbol="A")
    assert te_spec.submodules.layer_types["A"].self_attention.submodules.linear_qkv is StandInTEColumn   # decoder: TE
    block = get_mtp_block_spec(config, te_spec, "triton")
    assert block.layer_specs[0].submodules.eh_proj is StandInTEColumn
    local = get_mtp_block_spec(config, get_hybrid_layer_spec(PATTERN, mtp_symbol="A"))
    assert local.layer_specs[0].submodules.eh_proj is ColumnParallelLinear
    with pytest.raises(ValueError, match=r"^get_mtp_block_spec: linear='local' but the layer spec's layers use 'te'"):
        get_mtp_block_spec(config, te_spec, "triton", linear="local")


def test_get_spec_provider_honours_or_refuses_linear(te_linears):
    from hp_megatron.specs.providers import EagerSpecProvider, TritonSpecProvider, get_spec_provider

    assert get_spec_provider("triton", linear="te").column_parallel_linear() is StandInTEColumn
    provider = EagerSpecProvider()
    assert get_spec_provider(provider) is provider and get_spec_provider(provider, linear="local") is provider
    with pytest.raises(ValueError, match=r"^linear='te' conflicts with the spec provider EagerSpecProvider"):
        get_spec_provider(provider, linear="te")
    te = TritonSpecProvider(linear="te")
    with pytest.raises(ValueError, match="conflicts with the spec provider TritonSpecProvider\\(linear='te'\\)"):
        get_spec_provider(te, linear="local")


def test_declared_mtp_kind_against_another_flag_is_refused(single_rank):
    from hp_megatron.gpt.layer import mtp_layer_symbol
    from hp_megatron.specs import get_hybrid_layer_spec

    config = _config(hp_mtp_layer_symbol="M")   # --hp-mtp-layer-symbol M
    spec = get_hybrid_layer_spec(PATTERN, mtp_symbol="A")
    with pytest.raises(ValueError, match=r"^config.hp_mtp_layer_symbol 'M' \(--hp-mtp-layer-symbol\) conflicts with "
                                         r"the layer spec's mtp_symbol 'A'[^\n]*$"):
        mtp_layer_symbol(spec.submodules, PATTERN, config)
    config.hp_mtp_layer_symbol = "A"   # agreeing, or either alone, decides
    assert mtp_layer_symbol(spec.submodules, PATTERN, config) == "A"
    config.hp_mtp_layer_symbol = None
    assert mtp_layer_symbol(spec.submodules, PATTERN, config) == "A"
