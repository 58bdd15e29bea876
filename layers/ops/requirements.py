"""Installed package versions judged against what each kernel backend needs (the self-check's version table).

The numbers live with their backends: ``layers/ops/triton/versions.py`` (triton 3.7.1, flash-linear-attention /
fla-core >= 0.6.0, < 0.7; also read by the triton backend's load-time checks) and ``layers/ops/ascendc/versions.py``
(fla-npu's environment: torch >= 2.6, >= 2.7.1 for its fast launcher; CANN >= 8.5.0; triton-ascend >= 3.2.0, >= 3.2.1
on Ascend 950; torch_npu with the GDN stream fix; also setup.py's ``[npu]`` extra). Every backend needs the project's
torch floor, setup.py's ``torch>=2.6``.

:func:`check` judges given versions (pure); :func:`installed` reads them from the environment without importing the
packages (distribution metadata; CANN from its ``version.info``). Statuses: ok; warn (runs, with the caveat in the
note: a triton other than the one CI tests, a torch without fla-npu's fast launcher); FAIL.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

from layers.ops.ascendc import versions as ascend
from layers.ops.triton import versions as fla

MIN_TORCH = "2.6"    # setup.py install_requires
OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    """One package against its requirement."""
    package: str
    required: str
    found: str | None
    status: str
    note: str = ""


def _version(text: str | None) -> Version | None:
    try:
        return None if text is None else Version(text)
    except InvalidVersion:
        return None


def _dotted(version: tuple) -> str:
    return ".".join(map(str, version))


def _unreadable(package, required, found):
    return Check(package, required, found, FAIL, "not installed" if found is None else f"unparsable version {found!r}")


def _at_least(package, found, floor, required=None):
    required = required or f">={floor}"
    v = _version(found)
    if v is None:
        return _unreadable(package, required, found)
    return Check(package, required, found, OK if v >= Version(floor) else FAIL)


def _torch_npu(found):
    required = ("stream fix: " + ", ".join(ascend.TORCH_NPU_STREAM_FIX.values())
                + f" or >={ascend.TORCH_NPU_FIXED_FROM}")
    v = _version(found)
    if v is None:
        return _unreadable("torch_npu", required, found)
    if ascend.torch_npu_has_stream_fix(found):
        return Check("torch_npu", required, found, OK)
    floor = ascend.TORCH_NPU_STREAM_FIX.get(v.base_version)
    note = (f"this {v.base_version} build lacks fla-npu's GDN stream fix: install torch_npu>={floor}" if floor else
            "no release of this family has fla-npu's GDN stream fix")
    return Check("torch_npu", required, found, FAIL, note)


def _triton(found):
    required = f">={_dotted(fla.MIN_TRITON)} (CI tests {fla.TRITON_PIN})"
    v = _version(found)
    if v is None:
        return _unreadable("triton", required, found)
    if v < Version(_dotted(fla.MIN_TRITON)):
        return Check("triton", required, found, FAIL, "older than flash-linear-attention 0.6's floor")
    if v == Version(fla.TRITON_PIN):
        return Check("triton", required, found, OK)
    note = "not the version CI tests"
    if v < Version(_dotted(fla.SAFE_TRITON_HOPPER_GDN_BWD)):
        note += "; GDN backward is refused on Hopper GPUs (wrong gradients, FLA #640)"
    return Check("triton", required, found, WARN, note)


def _fla(package, found):
    low, high = _dotted(fla.MIN_FLA), _dotted(fla.BELOW_FLA)
    required = f">={low},<{high}"
    v = _version(found)
    if v is None:
        return _unreadable(package, required, found)
    return Check(package, required, found, OK if Version(low) <= v < Version(high) else FAIL)


def _ascend_torch(found):
    required = f">={ascend.TORCH_MIN} (>={ascend.TORCH_FAST_LAUNCHER_MIN}: fla-npu's fast launcher)"
    result = _at_least("torch", found, ascend.TORCH_MIN, required)
    if result.status == OK and Version(found) < Version(ascend.TORCH_FAST_LAUNCHER_MIN):
        return Check("torch", required, found, WARN,
                     f"fla-npu's fast launcher needs torch>={ascend.TORCH_FAST_LAUNCHER_MIN}")
    return result


def _triton_ascend(found, soc):
    required = f">={ascend.TRITON_ASCEND_MIN} (>={ascend.TRITON_ASCEND_MIN_ASCEND950} on Ascend 950)"
    on_950 = soc is not None and soc.startswith("Ascend950")
    result = _at_least("triton-ascend", found,
                       ascend.TRITON_ASCEND_MIN_ASCEND950 if on_950 else ascend.TRITON_ASCEND_MIN, required)
    if soc is None and result.status == OK:
        return Check("triton-ascend", required, found, OK,
                     f"SoC unknown: the Ascend 950 floor {ascend.TRITON_ASCEND_MIN_ASCEND950} not checked")
    return result


def _cann(found):
    if found is None:
        return Check("CANN", f">={ascend.CANN_MIN}", None, FAIL, "no version.info under ASCEND_OPP_PATH / "
                     "ASCEND_HOME_PATH (source CANN's set_env.sh)")
    return _at_least("CANN", found, ascend.CANN_MIN)


def check(backend: str, versions: dict, soc: str | None = None) -> list[Check]:
    """Judge ``versions`` (package -> version string, None when absent; keys as :func:`installed` returns them) for
    ``backend`` ("eager" | "triton" | "ascendc"). ``soc``: the Ascend SoC name when known."""
    if backend == "eager":
        return [_at_least("torch", versions.get("torch"), MIN_TORCH)]
    if backend == "triton":
        return [_at_least("torch", versions.get("torch"), MIN_TORCH), _triton(versions.get("triton")),
                _fla("flash-linear-attention", versions.get("flash-linear-attention")),
                _fla("fla-core", versions.get("fla-core"))]
    if backend == "ascendc":
        return [_ascend_torch(versions.get("torch")), _torch_npu(versions.get("torch_npu")),
                _cann(versions.get("CANN")), _triton_ascend(versions.get("triton-ascend"), soc)]
    raise ValueError(f"backend must be 'eager', 'triton' or 'ascendc', got {backend!r}")


def _distribution(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cann_version() -> str | None:
    """CANN's version from the ``version.info`` of its OPP or toolkit directory (``ASCEND_OPP_PATH`` first, then
    ``ASCEND_HOME_PATH``, each and its parent; set by CANN's set_env.sh), or None. Lines naming the driver are skipped
    (its version is not CANN's); a pre-release suffix is dropped ("9.1.0-beta.1" -> "9.1.0")."""
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
                return value.strip().split("-")[0]
    return None


def installed(backend: str) -> dict:
    """The versions :func:`check` needs for ``backend``, from distribution metadata (no package is imported)."""
    names = {"eager": ("torch",), "triton": ("torch", "triton", "flash-linear-attention", "fla-core"),
             "ascendc": ("torch", "torch_npu", "triton-ascend")}[backend]
    versions = {name: _distribution(name) for name in names}
    if versions["torch"] is not None:
        versions["torch"] = versions["torch"].split("+")[0]
    if backend == "ascendc":
        versions["CANN"] = cann_version()
    return versions
