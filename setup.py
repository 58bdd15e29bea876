"""Distribution ``hp-megatron``: GDN, KDA and MLA mixers for megatron-core with context parallelism."""
from setuptools import find_packages, setup

HF = ["transformers>=5.6,<6"]

setup(
    name="hp-megatron",
    version="0.1.0",
    description="Megatron-style model-parallel GDN, KDA and MLA layers with TP/SP/CP and three kernel backends",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hp_megatron", "hp_megatron.*", "layers", "layers.*"]),
    # megatron-core 0.16.1 .. 0.19.x (0.17+ declares Requires-Python >=3.12: on Python 3.10/3.11 install it first
    # with `pip install --ignore-requires-python megatron-core==0.19.2`; 0.19 also imports triton, which the
    # triton extra brings); psutil: megatron-core's checkpoint writer needs it (it hangs without); tokenizers: the
    # example's data
    install_requires=["torch>=2.6", "megatron-core>=0.16.1,<0.20", "numpy", "packaging", "psutil", "tokenizers"],
    extras_require={
        "triton": ["flash-linear-attention>=0.6.0,<0.7", "fla-core>=0.6.0,<0.7", "triton==3.7.1"],  # what CI tests
        "npu": ["torch_npu"],
        # hf: transformers models (hp_megatron.models.tiny, examples/pretrain/tiny_hf_checkpoint.py; it brings
        # safetensors); the checkpoint converter itself needs neither
        "hf": HF,
        "test": ["pytest>=8", *HF,
                 "six"],  # six: imported by Megatron-LM's training code (tests/megatron_lm)
    },
)
