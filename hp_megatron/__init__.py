"""Megatron integration of the ``layers`` package: specs, arguments, data slicing, platform shims."""
__version__ = "0.1.0"
