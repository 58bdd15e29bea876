"""Generation from GPTModels built from our specs and presets, through megatron-core's static inference
path (``loop.py``), and the ``python -m hp_megatron.generate`` command (``__main__.py``)."""
from hp_megatron.generate.loop import GenerationResult, StaticGenerator, check_batch, sampling_params

__all__ = ["GenerationResult", "StaticGenerator", "check_batch", "sampling_params"]
