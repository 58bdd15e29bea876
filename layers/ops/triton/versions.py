"""The versions the triton backend needs (flash-linear-attention 0.6 on NVIDIA GPUs), as data.

What CI tests, and setup.py's ``[triton]`` extra (``tests/backends/test_selfcheck.py`` keeps the two equal):
triton == 3.7.1 and flash-linear-attention / fla-core >= 0.6.0, < 0.7. FLA 0.6 itself runs from triton 3.3, but
its GDN backward on Hopper gives wrong gradients with 3.4 <= triton < 3.7.1 (FLA issue #640; ``runtime.py``
refuses it). Read by ``runtime.py`` (the load-time checks) and ``layers/ops/requirements.py`` (the self-check).
"""
TRITON_PIN = "3.7.1"
MIN_TRITON = (3, 3, 0)
SAFE_TRITON_HOPPER_GDN_BWD = (3, 7, 1)
MIN_FLA, BELOW_FLA = (0, 6, 0), (0, 7)
PACKAGES = "flash-linear-attention>=0.6.0,<0.7 (fla-core) and triton>=3.7.1"
INSTALL_HINT = ("pip install 'hp-megatron[triton]'  (flash-linear-attention>=0.6.0,<0.7, fla-core>=0.6.0,<0.7, "
                "triton>=3.7.1)")
