"""What a training script on megatron-core needs beyond the model's layers and that Megatron-LM's training code
would otherwise provide; one job per module, imported by ``examples/pretrain`` and the Megatron-LM launcher:

  ``model_args`` the example's model flags -> config and ``GPTModel``, and the dict of them its checkpoints store
                 (``hp_model_args``), from which ``python -m hp_megatron.generate --load`` rebuilds the model
  ``packing``    ``pack_documents``: a micro-batch of documents as one THD row with its ``PackedSeqParams``
  ``optimizer``  ``get_optimizer``: megatron-core's optimizer on GPU, ``TorchOptimizer`` (same interface) on CPU
  ``aux_losses`` ``AuxLossLog``: the MoE load-balancing losses, expert-bias update and MTP losses of an iteration,
                 from megatron-core's trackers, as Megatron-LM logs them

The one ``GPTModel`` builder is ``hp_megatron.model_builders`` (presets build through it too), the checkpoint files
``hp_megatron.checkpoint`` (the converter reads them too), the CPU-safe config fields
``hp_megatron.platform.CPU_SAFE_CONFIG``.
"""
