"""``export_hf_weights`` streams a running sharded model's weights: exactly the tensors ``mcore_to_hf`` writes.

The tiny Qwen3-Next, DeepSeek-V3, Kimi Linear dense Qwen3.5, Ling 3.0 and OLMo-Hybrid (dense: TP2 x PP2)
(tests/support/models_case.py) and a tiny tied-embedding Llama are converted with ``hf_to_mcore``; ``mcore_to_hf``
writes the reference HF directory. In one spawn of 4 gloo ranks each checkpoint is loaded into a GPTModel at TP2 x PP2 x
EP2 (expert tensor parallel 1: megatron-core 0.16 lays the experts of 4 ranks out as ETP1 x EP2 x expert-DP1 x PP2, the
dense part as TP2 x DP1 x PP2) and exported; Qwen3-Next also at TP2 x CP2 x EP2 (expert-DP 2: CP and expert-DP replicas
must be read once), and Llama with tied embeddings at TP2 x CP2 (megatron-core ties them across pipeline stages with a
CUDA copy, so not at PP2 on CPU). The tensors received equal the reference's bit for bit, under the same names, none
missing or extra, on ``dst`` (every rank for ``dst=None``); the other ranks see the same names with ``None``. Weak
references to what the generator yielded show it keeps at most the current rule's assembled tensor alive. The same
exporter, called again after an in-place change of the weights, yields the changed weights; a rank whose
``sharded_state_dict`` fails stops every rank.

Multi-token prediction: the tiny Qwen3-Next, DeepSeek-V3, Ling 3.0 and Qwen3.5-MoE VL (its language model under
``model.language_model.``, the vision tower dropped) checkpoints with one MTP layer
(tests/support/mtp_case.py), converted with ``with_mtp(1)``, are loaded into models built with
``mtp_num_layers=1`` at TP2 x PP2 x EP2 (the MTP block and its embedding copy on the last stage) and exported by
the public functions, which take the depth from the model: the tensors equal the original HF checkpoint's bit
for bit, MTP layers included, with no ``sharded_state_dict`` metadata given anywhere (megatron-core 0.16 reads
``metadata["dp_cp_group"]`` on that stage; ``MTPGPTModel`` defaults it) and the same state as with it.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.dist import case_result, case_started, run_distributed_cases
from tests.support.models_case import converted_tiny_model, read_safetensors
from tests.support.mtp_case import MTP_PREFIX

# (case, model_type, layout, dst)
CASES = (("qwen3_next", "qwen3_next", "tp2_pp2_ep2", None), ("deepseek_v3", "deepseek_v3", "tp2_pp2_ep2", 0),
         ("kimi_linear", "kimi_linear", "tp2_pp2_ep2", 3), ("llama_tied", "llama", "tp2_cp2_ep2", 1),
         ("qwen3_next_cp2", "qwen3_next", "tp2_cp2_ep2", 2), ("qwen3_next_mtp", "qwen3_next", "tp2_pp2_ep2", None),
         ("deepseek_v3_mtp", "deepseek_v3", "tp2_pp2_ep2", 3), ("qwen3_5_text", "qwen3_5_text", "tp2_pp2_ep2", 1),
         ("qwen3_5_moe_mtp", "qwen3_5_moe", "tp2_pp2_ep2", 0),   # Qwen3.5: dense text; VL MoE with MTP
         ("olmo_hybrid", "olmo_hybrid", "tp2_pp2_ep2", 0), ("bailing_hybrid_mtp", "bailing_hybrid", "tp2_pp2_ep2", 1))
LAYOUTS = {"tp2_pp2_ep2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                               expert_model_parallel_size=2, expert_tensor_parallel_size=1),
           "tp2_cp2_ep2": dict(tensor_model_parallel_size=2, context_parallel_size=2,
                               expert_model_parallel_size=2, expert_tensor_parallel_size=1)}


def _consume(weights):
    """(name -> clone of each received tensor, names in order, (the most tensors yielded earlier, or their
    bases, that were alive at a yield while the consumer held none of them, which ones), how many were alive after
    the end)."""
    import weakref

    received, names, refs, most_alive, seen = {}, [], [], 0, []
    while True:
        try:
            name, tensor = next(weights)
        except StopIteration:
            break
        alive = [what for what, ref in refs if ref() is not None]
        if len(alive) > most_alive:
            most_alive, seen = len(alive), [name] + alive
        names.append(name)
        if tensor is not None:
            received[name] = tensor.clone()
            refs.append((name, weakref.ref(tensor)))
            base = tensor._base
            if base is not None and not any(ref() is base for _, ref in refs):  # views of one rule share it
                refs.append((f"{name} (its base)", weakref.ref(base)))
            del base
        del tensor
    return received, names, (most_alive, seen), sum(ref() is not None for _, ref in refs)


def _next_step_and_errors(model, hf_config, exporter):
    """What a training loop does next: the weights change in place (doubled: exact in floating point, and every
    rule only moves elements), the same exporter runs again, to rank 0 this time. And the errors for a wrong
    architecture, a ``dst`` outside the group and, on every rank, rank 3's ``sharded_state_dict`` failing as
    megatron-core 0.16's did without metadata under PP with MTP."""
    import torch.distributed as dist

    from hp_megatron.convert import CheckpointError, HFWeightExporter
    from hp_megatron.models import get_architecture

    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                tensor.mul_(2)
    received, _, _, _ = _consume(exporter(0))
    errors = []
    for attempt in (lambda: HFWeightExporter(model, get_architecture("llama"), hf_config), lambda: exporter(9)):
        try:
            attempt()
        except ValueError as err:
            errors.append(str(err))
    if dist.get_rank() == 3:
        model.sharded_state_dict = lambda **kwargs: kwargs["metadata"]["dp_cp_group"]
    try:
        HFWeightExporter(model, get_architecture("qwen3_next"), hf_config)
    except CheckpointError as err:
        errors.append(str(err))
    finally:
        vars(model).pop("sharded_state_dict", None)
    return dict(next_step=received, errors=errors)


def _mtp_checks(model, hf_config):
    """``sharded_state_dict()`` without metadata (keys, replica ids) against the one with megatron-core's
    ``dp_cp_group``; an MTP depth other than the model's refused."""
    from megatron.core import parallel_state

    from hp_megatron.models import hf_weight_exporter

    def state(sharded):
        return {k: v.replica_id for k, v in sharded.items() if hasattr(v, "replica_id")}

    bare = state(model.sharded_state_dict())
    given = state(model.sharded_state_dict(
        metadata={"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}))
    same = bare == given
    try:
        hf_weight_exporter(model, hf_config, mtp_num_layers=2)
        refused = None
    except ValueError as err:
        refused = str(err)
    return dict(metadata_default_same=same, mtp_keys=sum(k.startswith("mtp.") for k in bare), refused=refused)


def export_cases(rank, world_size, cases):
    """Per case: load the checkpoint into the case's layout, export, report what this rank received."""
    from megatron.core import dist_checkpointing, parallel_state

    from hp_megatron.convert import load_hf_config
    from hp_megatron.models import export_hf_weights, get_architecture, hf_weight_exporter
    from hp_megatron.platform import apply_cpu_shims

    results = {}
    for name, hf_dir, ckpt, layout, dst in cases:
        mtp = name.endswith("_mtp")
        case_started(name)
        sizes = LAYOUTS[layout]
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(sizes["tensor_model_parallel_size"],
                                                 sizes.get("pipeline_model_parallel_size", 1),
                                                 context_parallel_size=sizes.get("context_parallel_size", 1),
                                                 expert_model_parallel_size=2, expert_tensor_parallel_size=1)
        apply_cpu_shims(11 + rank)  # every rank starts from other random weights than the checkpoint's
        hf_config = load_hf_config(hf_dir)
        architecture = get_architecture(hf_config["model_type"])
        text = hf_config.get("text_config", hf_config)   # a VL checkpoint's language model
        experts = "num_experts" in text or "n_routed_experts" in text
        overrides = dict(sizes, sequence_parallel=True, pipeline_dtype=torch.float32)
        if not experts:
            overrides.pop("expert_model_parallel_size")
            overrides.pop("expert_tensor_parallel_size")
        if mtp:
            overrides["mtp_num_layers"] = 1
        model = architecture.build_model(hf_config, **overrides)
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)["model"])
        checks = _mtp_checks(model, hf_config) if mtp else {}
        if name == "qwen3_next_mtp":  # the one-shot function
            weights = export_hf_weights(model, hf_config, dst=dst)
        else:  # the MTP depth given explicitly (the model's) or not
            exporter = hf_weight_exporter(model, hf_config, **({"mtp_num_layers": 1} if mtp else {}))
            weights = exporter(dst)
        received, names, most_alive, alive_at_end = _consume(weights)
        # the template was built under a one-rank parallel state: the job's is back
        ps = parallel_state
        state = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                 ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        result = dict(names=names, most_alive=most_alive, alive_at_end=alive_at_end, received=received, state=state,
                      **checks)
        if name == "qwen3_next":
            result.update(_next_step_and_errors(model, hf_config, exporter))
        case_result(name, result)
        results[name] = result
    parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the spawn's cases, case -> the HF tensors ``mcore_to_hf`` writes for its checkpoint; MTP cases: the HF
    checkpoint's own)."""
    from hp_megatron.convert import mcore_to_hf
    from hp_megatron.models import get_architecture

    tmp = tmp_path_factory.mktemp("export")
    references, cases = {}, []
    for name, model_type, layout, dst in CASES:
        mtp = name.endswith("_mtp")
        source = model_type + ("_mtp" if mtp else "")
        hf_dir, ckpt, out = tmp / f"{source}_hf", tmp / f"{source}_mcore", tmp / f"{source}_out"
        if mtp:
            converted_tiny_model(model_type, hf_dir, ckpt, mtp_num_layers=1)
            out = hf_dir
        elif not out.exists():
            converted_tiny_model(model_type, hf_dir, ckpt, tied=True)   # tied: llama's tied embeddings
            mcore_to_hf(str(ckpt), str(out), get_architecture(model_type))
        # the modeled tensors (a VL checkpoint's vision tower is dropped in the conversion)
        references[name] = {k: v for k, v in read_safetensors(str(out)).items() if not k.startswith("model.visual.")}
        cases.append((name, str(hf_dir), str(ckpt / "release"), layout, dst))
    return tuple(cases), references


def _case(converted, name):
    cases, references = converted
    return references[name], run_distributed_cases(export_cases, 4, name, cases)


@pytest.mark.parametrize("name,dst", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_export_equals_mcore_to_hf(converted, name, dst):
    reference, per_rank = _case(converted, name)
    sizes = LAYOUTS[next(c[2] for c in CASES if c[0] == name)]
    assert len(per_rank) == 4
    for rank, result in enumerate(per_rank):
        assert result["state"] == (2, sizes.get("pipeline_model_parallel_size", 1),
                                   sizes.get("context_parallel_size", 1), 2), rank
        assert sorted(result["names"]) == sorted(reference), rank  # every rank: every name once
        if dst is None or rank == dst:
            assert sorted(result["received"]) == sorted(reference), rank
            for key, tensor in reference.items():
                got = result["received"][key]
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, (rank, key)
                assert torch.equal(got, tensor), (rank, key)
        else:
            assert result["received"] == {}, rank


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_export_holds_one_assembled_tensor_at_a_time(converted, name):
    """On a receiving rank, while the consumer keeps nothing, at most one earlier yield is alive (the assembled
    megatron tensor that the rule's remaining HF views share), and nothing after the end."""
    _, per_rank = _case(converted, name)
    receivers = [r for r in per_rank if r["received"]]
    assert receivers
    for result in receivers:
        most, which = result["most_alive"]
        assert most <= 1 and result["alive_at_end"] == 0, which


def test_the_same_exporter_follows_the_weights_and_refuses_bad_input(converted):
    reference, per_rank = _case(converted, "qwen3_next")
    for rank, result in enumerate(per_rank):
        if rank == 0:
            assert sorted(result["next_step"]) == sorted(reference)
            for key, tensor in reference.items():
                assert torch.equal(result["next_step"][key], 2 * tensor), key
        else:
            assert result["next_step"] == {}, rank
        wrong_architecture, bad_dst, failed_rank = result["errors"]
        assert "model_type='qwen3_next'" in wrong_architecture and "'llama'" in wrong_architecture
        assert "dst=9" in bad_dst and "[0, 1, 2, 3]" in bad_dst
        assert failed_rank == ("export: rank 3 cannot list its shards of the model: TypeError: 'NoneType' object is "
                               "not subscriptable (1 of 4 ranks failed)"), (rank, failed_rank)


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[0].endswith("_mtp")])
def test_mtp_model_exports_its_mtp_layers_without_metadata(converted, name):
    """The HF checkpoint's MTP tensors are among those exported (checked against it in
    ``test_export_equals_mcore_to_hf``); ``sharded_state_dict()`` needs no metadata; an MTP depth other than the
    model's is refused."""
    from hp_megatron.convert import load_hf_config

    reference, per_rank = _case(converted, name)
    hf_dir = next(case[1] for case in converted[0] if case[0] == name)
    hf_config = load_hf_config(hf_dir)
    layers = hf_config.get("text_config", hf_config)["num_hidden_layers"]
    prefix = MTP_PREFIX[next(case[1] for case in CASES if case[0] == name)].format(layers=layers)
    assert sum(k.startswith(prefix) for k in reference) > 10
    for rank, result in enumerate(per_rank):
        assert result["metadata_default_same"], rank
        assert (result["mtp_keys"] > 0) == (rank in (2, 3)), rank   # the last pipeline stage holds the MTP block
        assert result["refused"] == "export: mtp_num_layers=2, but the model is built with mtp_num_layers=1"
