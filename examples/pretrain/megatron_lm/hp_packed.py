"""Packed documents for Megatron-LM 0.19's ``pretrain_gpt.py`` / ``pretrain_hybrid.py`` with our layers
(``--reset-position-ids --reset-attention-mask``): the entry script's ``get_batch`` replaced by
:func:`packed_get_batch`'s (``hp_launch.pretrain_from_container`` does it, on every rank, before training).

Megatron-LM's own batch carries the document boundaries as a ``[b, 1, s, s]`` attention mask, which our GDN / KDA
state and MLA do not read, and its 0.19 ``--dataloader-inter-document-masking`` splits the whole row zigzag over CP
under global ``cu_seqlens``, a layout our layers do not take. Here the micro-batch is Megatron-LM's (read on TP rank
0 and broadcast by megatron-core's ``get_batch_on_this_tp_rank``, as the entry script does), then packed into one
THD row exactly as the example packs it (``hp_megatron.training.packing.pack_documents``: each document padded to
a multiple of ``2 x CP`` (x TP with sequence parallelism), padding masked out of the loss) and cut into this CP
rank's share by ``hp_megatron.data.get_batch_on_this_cp_rank`` (zigzag per document). The entry's ``forward_step``
turns the returned ``cu_seqlens`` into its ``PackedSeqParams`` (``qkv_format="thd"``). One pipeline stage only
(the row length varies per micro-batch, and Megatron-LM's pipeline buffers have a fixed shape).
"""
import torch


def packed_get_batch(entry):
    """A ``get_batch(data_iterator, vp_stage=None)`` for ``entry`` (the ``pretrain_gpt`` / ``pretrain_hybrid``
    module) returning its ``BATCH_KEYS`` for our packed THD rows (module docstring)."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args, get_tokenizer, print_rank_0

    from hp_megatron.data import get_batch_on_this_cp_rank
    from hp_megatron.training.packing import PACKED_KEYS, document_multiple, pack_documents

    said = []

    def get_batch(data_iterator, vp_stage=None):
        args = get_args()
        tp_rank = mpu.get_tensor_model_parallel_rank()
        batch = {}
        if tp_rank == 0:
            batch = next(data_iterator)
            batch = {key: (value.cuda(non_blocking=True) if torch.cuda.is_available() else value)
                     if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
            tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            mtp_on_this_rank=True, pipeline_model_parallel_size=1, is_pipeline_first_stage=True,
            is_pipeline_last_stage=True)
        tokenizer = get_tokenizer()
        pad_id = getattr(tokenizer, "pad", None)
        multiple = document_multiple(args.context_parallel_size, "zigzag", args.tensor_model_parallel_size,
                                     args.sequence_parallel)
        packed, params = pack_documents({key: batch[key] for key in PACKED_KEYS},
                                        tokenizer.eod if pad_id is None or pad_id < 0 else pad_id, multiple)
        if not said:
            said.append(True)
            print_rank_0(f"packed documents: {params.cu_seqlens_q.numel() - 1} documents in the first micro-batch's "
                         f"THD row of {int(params.cu_seqlens_q[-1])} tokens (each padded to a multiple of {multiple})")
        packed = get_batch_on_this_cp_rank(packed, params, layout="zigzag")
        cu_seqlens = params.cu_seqlens_q.to(packed["tokens"].device)
        out = {**packed, "attention_mask": None, "cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens,
               "hybrid_cp_group": None, "local_cp_size": None,
               "max_seqlen": torch.tensor(params.max_seqlen_q, dtype=torch.int32)}
        return [out[key] for key in entry.BATCH_KEYS]
    return get_batch
