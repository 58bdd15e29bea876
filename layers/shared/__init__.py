"""Building blocks the mixers share: RMSNorm / gated RMSNorm (``norm``), rotary embeddings (``rotary``), the causal
mask check (``masks``), megatron-core's static inference context as the mixers use it (``inference``) and the
part-wise selective recompute (``recompute``). Imports ``layers.cp``, ``layers.ops`` and ``layers.base``, never a
mixer."""
