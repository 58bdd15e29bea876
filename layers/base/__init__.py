"""The leaves every part of ``layers`` may import: the one definition of each choice (``choices``), strict
construction (``keywords``), the private torch APIs used (``compat``) and the megatron-core API differences between
the supported versions (``megatron_compat``). Nothing here imports another ``layers`` package."""
