"""Multi-latent attention: ``layer`` (MultiLatentAttention, megatron-core's MLA parameter names without Transformer
Engine) and ``decode`` (the latent cache and the absorbed decode step)."""
