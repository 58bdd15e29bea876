"""The environment fla-npu requires (docs/backends.md, "Versions"), as data and as pip requirements.

From fla-npu's ``scripts/check_npu_env.py`` (main 17e24fdd, last changed 2e16ecab): torch >= 2.6; triton-ascend
>= 3.2.0, >= 3.2.1 on Ascend 950; torch_npu from a release with the GDN aclnn_extension stream fix, per torch
family the minimum below or any torch_npu >= 2.13.0 (families missing from the table pass that script). From issue
33's reading of later files: CANN >= 8.5.0 and torch >= 2.7.1 for fla-npu's fast launcher (a later
``scripts/npu_compat.py``, 0e3ad131, raises CANN to 8.5.2 on Ascend 910B/910_93 and 9.0.0 on Ascend 950, and
triton-ascend to 3.2.1 on CANN 9.x). CANN is not a pip package; setup.py's ``[npu]`` extra pins the rest
(``tests/backends/test_backend_ascendc_contract.py`` keeps setup.py equal to :func:`npu_requirements`).
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

TORCH_MIN = "2.6"
TORCH_FAST_LAUNCHER_MIN = "2.7.1"
CANN_MIN = "8.5.0"
TRITON_ASCEND_MIN = "3.2.0"
TRITON_ASCEND_MIN_ASCEND950 = "3.2.1"
# torch family -> first torch_npu of that family with the stream fix; any torch_npu >= TORCH_NPU_FIXED_FROM has it
TORCH_NPU_STREAM_FIX = {"2.7.1": "2.7.1.post5", "2.8.0": "2.8.0.post5", "2.9.0": "2.9.0.post3",
                        "2.10.0": "2.10.0.post2", "2.11.0": "2.11.0rc3", "2.12.0": "2.12.0rc1"}
TORCH_NPU_FIXED_FROM = "2.13.0"


def torch_npu_has_stream_fix(version: str) -> bool:
    """Whether a torch_npu version (local label ignored) satisfies :func:`torch_npu_specifier`."""
    return SpecifierSet(torch_npu_specifier()[len("torch_npu"):]).contains(version.split("+", 1)[0],
                                                                          prereleases=True)


def torch_npu_specifier() -> str:
    """PEP 440 requirement for the torch_npu releases with the stream fix: from the oldest fixed one up, minus
    the unfixed releases of the later families (``.postN`` below the minimum, and ``rcN`` below it). Versions of
    families missing from the table between 2.7.1 and 2.13.0 pass, as in fla-npu's script; 2.6 and older do not
    (that script lets a 2.6 torch_npu pass; issue 33 lists only the fixed releases)."""
    families = list(TORCH_NPU_STREAM_FIX.items())
    excluded = []
    for family, fixed in families[1:]:
        v = Version(fixed)
        if v.post is not None:
            excluded += [f"!={family}"] + [f"!={family}.post{i}" for i in range(1, v.post)]
        elif v.pre is not None:
            excluded += [f"!={family}{v.pre[0]}{i}" for i in range(1, v.pre[1])]
    return "torch_npu" + ",".join([f">={families[0][1]}", *excluded])


def npu_requirements() -> list[str]:
    """The ``[npu]`` extra (pip-installable parts; CANN and fla-npu itself are installed separately)."""
    return [f"torch>={TORCH_MIN}", torch_npu_specifier(), f"triton-ascend>={TRITON_ASCEND_MIN}"]
