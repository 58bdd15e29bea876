"""Test stand-in for fla-npu (flashserve/flash-linear-attention-npu): PyTorch-on-CPU versions of the
``fla_npu.ops.ascendc`` operators that ``layers/ops/ascendc`` calls, with the same names, parameters, output
slot counts, layouts and dtypes. Installed only by tests (``tests/fla_npu_standin`` on sys.path); it is NOT
fla-npu and says so (``STANDIN``).
"""
__version__ = "26.6.0+standin"
STANDIN = True
