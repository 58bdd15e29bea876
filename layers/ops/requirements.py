"""The package versions each optional kernel backend needs: the one table read by the backends' runtime checks
(``layers/ops/triton/runtime.py``) and by the self-check (``python -m hp_megatron.selfcheck``).

triton (flash-linear-attention on NVIDIA GPUs), what CI tests (setup.py's ``[triton]`` extra):
  torch >= 2.6; triton == 3.7.1 (FLA 0.6 runs from 3.3, but GDN backward on Hopper needs >= 3.7.1, FLA issue
  #640); flash-linear-attention and fla-core >= 0.6.0, < 0.7.
ascendc (fla-npu on Ascend NPUs), fla-npu's own floors (issue 33, item 9; fla-npu ``scripts/check_npu_env.py`` at
17e24fdd for the torch_npu table and the triton-ascend floors; CANN 8.5.0 and the 2.7.1 fast-launcher floor are
the issue's reading of later fla-npu files, not re-checked here):
  torch >= 2.6 (>= 2.7.1 for fla-npu's fast launcher); CANN >= 8.5.0; triton-ascend >= 3.2.0 (>= 3.2.1 on Ascend
  950); torch_npu from a release with the GDN stream fix: 2.7.1.post5, 2.8.0.post5, 2.9.0.post3, 2.10.0.post2,
  2.11.0rc3, 2.12.0rc1 (each the floor of its family) or >= 2.13.0. A torch_npu family older than all of these
  (2.6.x, 2.7.0) has no fixed release; fla-npu's check lets it pass, so it is a warning here.

:func:`check` judges given versions (pure, testable); :func:`installed` reads them from the environment without
importing the packages (distribution metadata; CANN from its ``version.info``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

# --- triton ---------------------------------------------------------------------------------------------------
MIN_TORCH = "2.6"
TRITON_PIN = "3.7.1"                 # what CI and the GPU check run
MIN_TRITON = (3, 3, 0)               # FLA 0.6's own floor
SAFE_TRITON_HOPPER_GDN_BWD = (3, 7, 1)
MIN_FLA, BELOW_FLA = (0, 6, 0), (0, 7)
TRITON_PACKAGES = "flash-linear-attention>=0.6.0,<0.7 (fla-core) and triton>=3.7.1"
TRITON_INSTALL_HINT = ("pip install 'hp-megatron[triton]'  (flash-linear-attention>=0.6.0,<0.7, fla-core>=0.6.0,<0.7, "
                       "triton>=3.7.1)")

# --- ascendc --------------------------------------------------------------------------------------------------
MIN_TORCH_FAST_LAUNCHER = "2.7.1"
MIN_CANN = "8.5.0"
MIN_TRITON_ASCEND, MIN_TRITON_ASCEND_950 = "3.2.0", "3.2.1"
TORCH_NPU_STREAM_FIX = {"2.7.1": "2.7.1.post5", "2.8.0": "2.8.0.post5", "2.9.0": "2.9.0.post3",
                        "2.10.0": "2.10.0.post2", "2.11.0": "2.11.0rc3", "2.12.0": "2.12.0rc1"}
TORCH_NPU_FIXED_FROM = "2.13.0"      # every release from here on has the fix

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    """One package against its requirement: ``status`` is ok / warn (runs, with the caveat in ``note``) / FAIL."""
    package: str
    required: str
    found: str | None
    status: str
    note: str = ""


def _version(text: str | None) -> Version | None:
    if text is None:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _missing(package, required, found, what="not installed"):
    return Check(package, required, found, FAIL, what if found is None else f"unparsable version {found!r}")


def _at_least(package, found, floor, required=None):
    required = required or f">={floor}"
    v = _version(found)
    if v is None:
        return _missing(package, required, found)
    return Check(package, required, found, OK if v >= Version(floor) else FAIL)


def _torch_npu(found):
    required = ("stream fix: " + ", ".join(TORCH_NPU_STREAM_FIX.values()) + f" or >={TORCH_NPU_FIXED_FROM}")
    v = _version(found)
    if v is None:
        return _missing("torch_npu", required, found)
    if Version(v.base_version) >= Version(TORCH_NPU_FIXED_FROM):   # 2.13.0rc1 belongs to the fixed family too
        return Check("torch_npu", required, found, OK)
    floor = TORCH_NPU_STREAM_FIX.get(v.base_version)
    if floor is not None:
        fixed = v >= Version(floor)
        return Check("torch_npu", required, found, OK if fixed else FAIL,
                     "" if fixed else f"this {v.base_version} build lacks fla-npu's GDN stream fix: install "
                                      f"torch_npu>={floor}")
    older = v < min(Version(family) for family in TORCH_NPU_STREAM_FIX)
    return Check("torch_npu", required, found, WARN,
                 ("no release of this family has the stream fix" if older else "a family fla-npu does not list")
                 + " (fla-npu's own check accepts it)")


def _triton(found):
    required = f"=={TRITON_PIN} (tested; runs from {'.'.join(map(str, MIN_TRITON))})"
    v = _version(found)
    if v is None:
        return _missing("triton", required, found)
    if v < Version(".".join(map(str, MIN_TRITON))):
        return Check("triton", required, found, FAIL, "older than flash-linear-attention 0.6's floor")
    if v == Version(TRITON_PIN):
        return Check("triton", required, found, OK)
    note = "not the version CI tests"
    if v < Version(".".join(map(str, SAFE_TRITON_HOPPER_GDN_BWD))):
        note += "; GDN backward is refused on Hopper GPUs (wrong gradients, FLA #640)"
    return Check("triton", required, found, WARN, note)


def _fla(package, found):
    low, high = ".".join(map(str, MIN_FLA)), ".".join(map(str, BELOW_FLA))
    required = f">={low},<{high}"
    v = _version(found)
    if v is None:
        return _missing(package, required, found)
    return Check(package, required, found, OK if Version(low) <= v < Version(high) else FAIL)


def check(backend: str, versions: dict, soc: str | None = None) -> list[Check]:
    """Judge ``versions`` (package -> version string or None when absent; keys as :func:`installed` returns them)
    for ``backend`` ("triton" | "ascendc"; "eager" needs only torch). ``soc``: the Ascend SoC name when known."""
    torch_check = _at_least("torch", versions.get("torch"), MIN_TORCH)
    if backend == "eager":
        return [torch_check]
    if backend == "triton":
        return [torch_check, _triton(versions.get("triton")),
                _fla("flash-linear-attention", versions.get("flash-linear-attention")),
                _fla("fla-core", versions.get("fla-core"))]
    if backend != "ascendc":
        raise ValueError(f"backend must be 'eager', 'triton' or 'ascendc', got {backend!r}")
    if torch_check.status == OK and Version(versions["torch"]) < Version(MIN_TORCH_FAST_LAUNCHER):
        torch_check = Check("torch", torch_check.required, versions["torch"], WARN,
                            f"fla-npu's fast launcher needs torch>={MIN_TORCH_FAST_LAUNCHER}")
    torch_check = Check("torch", f">={MIN_TORCH} (>={MIN_TORCH_FAST_LAUNCHER}: fast launcher)", torch_check.found,
                        torch_check.status, torch_check.note)
    on_950 = soc is not None and soc.startswith("Ascend950")
    triton_ascend = _at_least("triton-ascend", versions.get("triton-ascend"),
                              MIN_TRITON_ASCEND_950 if on_950 else MIN_TRITON_ASCEND,
                              f">={MIN_TRITON_ASCEND} (>={MIN_TRITON_ASCEND_950} on Ascend 950)")
    if soc is None and triton_ascend.status == OK:
        triton_ascend = Check(triton_ascend.package, triton_ascend.required, triton_ascend.found, OK,
                              f"SoC unknown: the {MIN_TRITON_ASCEND_950} floor of Ascend 950 not checked")
    cann = _at_least("CANN", versions.get("CANN"), MIN_CANN)
    if versions.get("CANN") is None:
        cann = Check("CANN", f">={MIN_CANN}", None, FAIL, "no version.info under ASCEND_OPP_PATH / ASCEND_HOME_PATH "
                     "(source CANN's set_env.sh)")
    return [torch_check, _torch_npu(versions.get("torch_npu")), cann, triton_ascend]


def _distribution(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cann_version() -> str | None:
    """CANN's version from the ``version.info`` of its OPP or toolkit directory (``ASCEND_OPP_PATH`` first, then
    ``ASCEND_HOME_PATH``; set by CANN's set_env.sh), or None. Lines naming the driver are skipped (its version is
    not CANN's)."""
    places = []
    for variable in ("ASCEND_OPP_PATH", "ASCEND_HOME_PATH"):
        root = os.environ.get(variable)
        if root:
            root = os.path.abspath(root)
            places += [os.path.join(root, "version.info"), os.path.join(os.path.dirname(root), "version.info")]
    for path in places:
        try:
            with open(path, encoding="utf-8", errors="ignore") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition("=")
            if key.strip().lower() == "version" and value.strip() and "driver" not in line.lower():
                return value.strip().split("-")[0]   # "9.1.0-beta.1" -> "9.1.0"
    return None


def installed(backend: str) -> dict:
    """The versions :func:`check` needs for ``backend``, read from distribution metadata (no package is imported)."""
    names = {"eager": ("torch",), "triton": ("torch", "triton", "flash-linear-attention", "fla-core"),
             "ascendc": ("torch", "torch_npu", "triton-ascend")}[backend]
    versions = {name: _distribution(name) for name in names}
    if versions["torch"] is not None:
        versions["torch"] = versions["torch"].split("+")[0]
    if backend == "ascendc":
        versions["CANN"] = cann_version()
    return versions
