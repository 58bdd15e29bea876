"""The versions the triton backend needs (flash-linear-attention 0.6 on NVIDIA GPUs), as data.

What CI tests (``.ci/run``'s pins): triton 3.7.1 and flash-linear-attention / fla-core 0.6.0; setup.py's
``[triton]`` extra asks for flash-linear-attention / fla-core >= 0.6.0, < 0.7 and no triton: the one the user's
torch brings (torch pins it; a pin of ours would make pip swap the user's torch for one that pins ours).
``tests/backends/test_selfcheck.py`` keeps setup.py and .ci/run equal to this table. FLA 0.6 itself runs from
triton 3.3, but its GDN backward on Hopper gives wrong gradients with 3.4 <= triton < 3.7.1 (FLA issue #640;
``runtime.py`` refuses it). Read by ``runtime.py`` (the load-time checks) and ``layers/ops/requirements.py`` (the
self-check's version table: "tested" names TRITON_PIN).
"""
TRITON_PIN = "3.7.1"   # the triton CI tests (.ci/run)
MIN_TRITON = (3, 3, 0)
SAFE_TRITON_HOPPER_GDN_BWD = (3, 7, 1)
MIN_FLA, BELOW_FLA = (0, 6, 0), (0, 7)
PACKAGES = "flash-linear-attention>=0.6.0,<0.7 (fla-core) and triton>=3.7.1"
INSTALL_HINT = ("pip install 'hp-megatron[triton]'  (flash-linear-attention>=0.6.0,<0.7, fla-core>=0.6.0,<0.7; "
                "triton comes with a CUDA build of torch: >=3.3, >=3.7.1 for GDN backward on Hopper)")
