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
    # triton: megatron-core 0.19 (what pip picks on Python >= 3.12) imports it without declaring it; a CUDA torch
    # brings it, a CPU torch does not
    install_requires=["torch>=2.6", "megatron-core>=0.16.1,<0.20", "numpy", "packaging", "psutil", "tokenizers",
                      'triton; python_version >= "3.12" and platform_system == "Linux"'],
    extras_require={
        # no triton here: a CUDA torch brings its own (pinned by torch), and one of ours would make pip replace the
        # user's torch with a release pinning that triton; CI's exact versions are .ci/run's
        "triton": ["flash-linear-attention>=0.6.0,<0.7", "fla-core>=0.6.0,<0.7"],
        # fla-npu's environment (layers/ops/ascendc/versions.py, docs/backends.md "Versions"): torch_npu with the
        # GDN stream fix, triton-ascend >= 3.2.0 (3.2.1 on Ascend 950); CANN >= 8.5.0 and fla-npu are not on pip
        "npu": ["torch>=2.6",
                "torch_npu>=2.7.1.post5,!=2.8.0,!=2.8.0.post1,!=2.8.0.post2,!=2.8.0.post3,!=2.8.0.post4,!=2.9.0,"
                "!=2.9.0.post1,!=2.9.0.post2,!=2.10.0,!=2.10.0.post1,!=2.11.0rc1,!=2.11.0rc2",
                "triton-ascend>=3.2.0"],
        # hf: transformers models (hp_megatron.models.tiny, examples/pretrain/tiny_hf_checkpoint.py; it brings
        # safetensors); the checkpoint converter itself needs neither
        "hf": HF,
        "test": ["pytest>=8", *HF,
                 "six"],  # six: imported by Megatron-LM's training code (tests/megatron_lm)
    },
)
