"""hp_megatron.data: CP batch slicing, checked against megatron-core (BSHD) and a per-document reference (THD)."""
import pytest
import torch

from hp_megatron.data import cp_token_index, get_batch_on_this_cp_rank
from tests.support.helpers import FakeGroup, torch_distributed_answers_fake_groups


def _megatron_split(batch, cp, rank, monkeypatch):
    from layers.base.megatron_compat import megatron_cp_batch

    torch_distributed_answers_fake_groups(monkeypatch)
    return megatron_cp_batch(dict(batch), cp_group=FakeGroup(cp, rank))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_bshd_matches_megatron(cp, monkeypatch):
    b, s = 2, 8 * cp
    gen = torch.Generator().manual_seed(cp)
    batch = {"tokens": torch.randint(0, 100, (b, s), generator=gen),
             "labels": torch.randint(0, 100, (b, s), generator=gen),
             "loss_mask": torch.rand(b, s, generator=gen),
             "position_ids": torch.arange(s).expand(b, s),
             "attention_mask": torch.rand(b, 1, s, s, generator=gen) > 0.5}
    pieces = []
    for rank in range(cp):
        ours = get_batch_on_this_cp_rank(batch, cp_group=FakeGroup(cp, rank))
        ref = _megatron_split(batch, cp, rank, monkeypatch)
        for key in batch:
            assert torch.equal(ours[key], ref[key]), (cp, rank, key)
        pieces.append(ours["position_ids"][0])
    # every token exactly once across ranks
    assert sorted(torch.cat(pieces).tolist()) == list(range(s))


def _thd_reference(cu, cp, rank):
    """Per document: split into 2*cp equal parts, keep parts rank and 2*cp-1-rank (TE's partitioning)."""
    out = []
    for d in range(len(cu) - 1):
        start, length = cu[d], cu[d + 1] - cu[d]
        part = length // (2 * cp)
        for p in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + p * part, start + (p + 1) * part))
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_per_document_zigzag(cp):
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [4 * cp, 2 * cp, 6 * cp, 2 * cp]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                             cu_seqlens_q_padded=cu_t, cu_seqlens_kv_padded=cu_t)
    tokens = torch.arange(100, 100 + total).view(1, total)
    seen = []
    for rank in range(cp):
        out = get_batch_on_this_cp_rank({"tokens": tokens, "loss_mask": tokens.float()}, params,
                                        cp_group=FakeGroup(cp, rank))
        expected = [100 + i for i in _thd_reference(cu, cp, rank)]
        assert out["tokens"].flatten().tolist() == expected
        assert out["loss_mask"].flatten().tolist() == [float(x) for x in expected]
        seen.extend(expected)
    assert sorted(seen) == list(range(100, 100 + total))


def test_contiguous_layout():
    tokens = torch.arange(12).view(1, 12)
    parts = [get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=FakeGroup(3, r), layout="contiguous")["tokens"]
             for r in range(3)]
    assert [p.flatten().tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_cp1_is_identity_and_non_tensors_pass_through():
    batch = {"tokens": torch.arange(6).view(1, 6), "meta": "x", "none": None}
    out = get_batch_on_this_cp_rank(batch, cp_group=FakeGroup(1, 0))
    assert out["meta"] == "x" and out["none"] is None and torch.equal(out["tokens"], batch["tokens"])


def test_errors_name_the_constraint():
    with pytest.raises(ValueError, match=r"divisible by 2\*P=4"):
        cp_token_index(10, 2, 0)
    with pytest.raises(ValueError, match=r"\(document, length\) pairs violating it: \[\(1, 6\)\]"):
        cp_token_index(14, 2, 0, torch.tensor([0, 8, 14]))
    with pytest.raises(ValueError, match="layout"):
        cp_token_index(8, 2, 0, layout="ring")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        cp_token_index(8, 2, 2)
    with pytest.raises(ValueError, match="strictly increasing"):   # an empty document: the model rejects it too
        cp_token_index(8, 2, 0, torch.tensor([0, 4, 4, 8]))


def test_hybrid_cp_micro_batch_groups():
    """megatron's hybrid CP: a micro-batch's ``PackedSeqParams.cp_group`` wins over the model's group;
    ``local_cp_size=1`` without a group is a micro-batch without CP (megatron-core 0.19 builds it so); a larger
    ``local_cp_size`` without a group is refused, naming it."""
    from types import SimpleNamespace

    from layers.shared.parallel import forward_cp_group

    tokens = torch.arange(8).view(1, 8)
    model = FakeGroup(2, 1)
    micro = SimpleNamespace(qkv_format="sbhd", cp_group=FakeGroup(4, 3), local_cp_size=4)
    assert get_batch_on_this_cp_rank({"tokens": tokens}, micro)["tokens"].flatten().tolist() == [3, 4]
    solo = SimpleNamespace(qkv_format="sbhd", cp_group=None, local_cp_size=1)
    assert forward_cp_group(solo, model) is None
    assert torch.equal(get_batch_on_this_cp_rank({"tokens": tokens}, solo)["tokens"], tokens)
    assert forward_cp_group(SimpleNamespace(cp_group=None, local_cp_size=None), model) is model
    with pytest.raises(ValueError, match=r"local_cp_size=2 needs packed_seq_params.cp_group \(got None\)"):
        forward_cp_group(SimpleNamespace(cp_group=None, local_cp_size=2), model)


def test_the_model_config_decides_the_layout():
    """``config=`` (the model's config or the model) gives the layout its layers were built for; another ``layout``
    beside it is a one-line ValueError, not a wrong slice."""
    from types import SimpleNamespace

    tokens = torch.arange(12).view(1, 12)
    contiguous = SimpleNamespace(hp_cp_layout="contiguous")
    for rank in range(2):
        got = get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=FakeGroup(2, rank), config=contiguous)
        assert got["tokens"].flatten().tolist() == list(range(6 * rank, 6 * rank + 6))
        model = SimpleNamespace(config=SimpleNamespace(hp_cp_layout="zigzag"))
        zigzag = get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=FakeGroup(2, rank), config=model)
        assert zigzag["tokens"].flatten().tolist() == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]][rank]
    with pytest.raises(ValueError, match=r"^get_batch_on_this_cp_rank: layout='zigzag' but the model's "
                                         r"config.hp_cp_layout is 'contiguous'[^\n]*$"):
        get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=FakeGroup(2, 0), layout="zigzag", config=contiguous)
