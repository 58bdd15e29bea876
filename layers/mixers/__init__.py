"""The mixers, one folder per family: ``delta`` (GatedDeltaNet, KimiDeltaAttention and what they share), ``mla``
(MultiLatentAttention) and ``attention`` (core softmax attention and the context-parallel core attention of the
standard attention layers)."""
