"""``python -m hp_megatron.selfcheck``: the table, the verdicts and the exit status, on CPU.

Two environments stand for hardware. ``--backend ascendc``: the fla-npu stand-in in this process (its bf16 contract
on a declared Ascend950PR; an Ascend910B3 for the SoC limits) and, through ``rank_setup``, in each spawned CP rank
(tests/support/selfcheck_env.py); every default row runs, with the installed versions read from fake distribution
metadata and a CANN ``version.info`` the test puts on sys.path and ASCEND_HOME_PATH. ``--backend triton``: Triton's
interpreter in a subprocess and its ranks (a few rows: it is slow), run in the background from collection on. A
corrupted op (the stand-in's KDA output scaled by 1.1) must fail its row and the exit status, a torch_npu without
the stream fix must fail the check, and a failing or stalled CP rank must turn the CP rows into ERRORs, not a hang.
The version table (layers/ops/requirements.py) is checked case by case. Cost: about 40 CPU s on 2 cores, most of it
the start-up of processes that import torch (and FLA under the interpreter).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layers.ops import requirements
from layers.ops.requirements import FAIL, OK, WARN, check
from tests.support import background, triton_interpreter

ROOT = Path(__file__).resolve().parents[2]
STEP_OPS = ("delta_rule_step", "causal_conv1d_step")


def _fake_versions(tmp_path, monkeypatch, torch_npu="2.7.1.post5", triton_ascend="3.2.1", cann="8.5.0"):
    """Distribution metadata of torch_npu / triton-ascend on sys.path and a CANN home with its version.info: what
    ``layers.ops.requirements.installed`` reads on an Ascend machine."""
    site = tmp_path / "site"
    for name, version in (("torch_npu", torch_npu), ("triton_ascend", triton_ascend)):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    cann_home = tmp_path / "cann" / "latest"
    cann_home.mkdir(parents=True)
    (cann_home / "version.info").write_text(f"Version={cann}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(cann_home))
    monkeypatch.delenv("ASCEND_OPP_PATH", raising=False)


def _run(args, timeout=900):
    """Run a module with ``args``; (exit status, stdout + stderr)."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def _rows(output):
    """{(op, case, phase): (result, note)} from the results table."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("op ") and "result" in line) + 2
    rows, last = {}, []
    for line in lines[start:]:
        if not line.strip():
            break
        if line.startswith("    "):      # the reason under a run of rows
            for key in last:
                rows[key] = (rows[key][0], line.strip())
            last = []
            continue
        cells = re.split(r"\s{2,}", line.strip())
        key = (cells[0], cells[1], cells[2])
        rows[key] = (cells[-1], "")
        last = [k for k in last if rows[k][0] == cells[-1]] + [key]
    return rows


def _requirement_statuses(output):
    tail = output[output.index("versions (layers/ops/requirements.py):"):]
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\S+)\s{2,}.*\s(ok|warn|FAIL)$", tail, re.M)}


# ------------------------------------------------------------------------------------------- stand-in (ascendc)
@pytest.fixture
def standin(request, monkeypatch):
    """The stand-in in this process (bf16 contract) on the SoC ``request.param`` (default Ascend950PR); yields its
    module. The self-check's CP ranks install the same through ``rank_setup``."""
    from layers.ops.ascendc import runtime
    from tests.support.ascendc_standin import KNOBS, STANDIN, forget_fla_npu, install_standin

    monkeypatch.setattr(runtime, "DEVICE", runtime.DEVICE)
    monkeypatch.setattr(runtime, "KERNEL_DTYPES", runtime.KERNEL_DTYPES)
    yield install_standin(soc=getattr(request, "param", "Ascend950PR"), fp32=False)
    if STANDIN in sys.path:
        sys.path.remove(STANDIN)
    forget_fla_npu()
    for name in KNOBS:
        os.environ.pop(name, None)


def _main(argv, capsys, rank_setup=None):
    from hp_megatron.selfcheck import main

    status = main(argv, rank_setup=rank_setup)
    return status, capsys.readouterr().out


def test_standin_every_row(standin, tmp_path, monkeypatch, capsys):
    """Every default row on the stand-in: all pass except recursive_doubling (no native path: n/a with the reason);
    the versions come from the environment; exit 0."""
    from tests.support.selfcheck_env import standin as rank_setup

    _fake_versions(tmp_path, monkeypatch)
    status, out = _main(["--backend", "ascendc", "--device", "cpu"], capsys, rank_setup)
    rows = _rows(out)
    ops = {op for op, _, _ in rows}
    assert ops == {"chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", *STEP_OPS, "dsa_sparse_attention"}, out
    cp_rows = {key: value for key, value in rows.items() if key[1].startswith("CP2 ")}
    assert len(cp_rows) == 2 * 2 * 7 + 2 * 2, out       # (gdn, kda) x 7 method/layouts x (fwd, bwd) + conv halo
    for (op, case, phase), (result, note) in rows.items():
        if "recursive_doubling" in case:
            assert result == "n/a" and "recursive_doubling" in note, (case, result, note)
        else:
            assert result == "pass", (op, case, phase, result, note)
    assert _requirement_statuses(out) == {"torch": OK, "torch_npu": OK, "CANN": OK, "triton-ascend": OK}, out
    assert "PASSED" in out.splitlines()[-1] and status == 0, out


def test_standin_corrupted_op_fails_its_rows(standin, tmp_path, monkeypatch, capsys):
    """KDA's output off by 10% (the stand-in's chunk_kda_fwd_finalize): its forward row fails (its gradients come
    from the untouched backward), GDN's rows still pass, the exit status is 1."""
    from tests.support.selfcheck_env import scaled

    _fake_versions(tmp_path, monkeypatch)
    monkeypatch.setattr(standin, "chunk_kda_fwd_finalize", scaled(standin.chunk_kda_fwd_finalize))
    status, out = _main(["--backend", "ascendc", "--device", "cpu", "--no-cp", "--only",
                         "chunk_kda B=2,chunk_gated_delta_rule B=2"], capsys)
    results = {(op, phase): result for (op, _, phase), (result, _) in _rows(out).items()}
    assert results == {("chunk_gated_delta_rule", "fwd"): "pass", ("chunk_gated_delta_rule", "bwd"): "pass",
                       ("chunk_kda", "fwd"): "FAIL", ("chunk_kda", "bwd"): "pass"}, out
    assert "FAILED: 3 pass, 1 fail" in out and status == 1, out


@pytest.mark.parametrize("standin", ["Ascend910B3", "Ascend910_9392"], indirect=True)
def test_limits_on_a2_a3(standin, monkeypatch, capsys):
    """Ascend 910B / 910_93 (the stand-in plays only the ops their op-defs register): GDN forward and backward run
    (the backward on fla-npu's building blocks) and pass, and so do the GDN and KDA decode steps; KDA's backward
    (fla-npu's monolithic ChunkKdaBwd) passes on the packed case without initial state (safe gate) and is n/a with
    the reason on the case with an initial state; GDN and KDA state CP forward are available, KDA's backward
    there is not."""
    import torch

    from hp_megatron.selfcheck import cli
    from hp_megatron.selfcheck.limits import probe

    limits = probe("ascendc", torch.device("cpu"))
    assert limits.backward["gdn"] is None and limits.state_cp["gdn"] is None, limits
    assert limits.backward["kda"] is None and "ChunkKdaBwd" in limits.state_grad["kda"], limits
    assert limits.state_cp["kda"] is None and "Ascend950" in limits.state_cp_backward["kda"], limits
    assert limits.decode == {"gdn": None, "kda": None, "conv": None}
    assert "recursive_doubling" in limits.cp_methods and "p2p" not in limits.cp_methods
    good = {"torch": "2.7.1", "torch_npu": "2.7.1.post5", "triton-ascend": "3.2.0", "CANN": "8.5.0"}
    monkeypatch.setattr(cli.requirements, "installed", lambda backend: good)
    status, out = _main(["--backend", "ascendc", "--device", "cpu", "--no-cp", "--only",
                         "chunk_gated_delta_rule B=2,chunk_kda B=2,in-kernel lb=-5,delta_rule_step"], capsys)
    rows = _rows(out)
    results = {(op, phase): (result, note) for (op, case, phase), (result, note) in rows.items() if "B=2" in case}
    assert results[("chunk_gated_delta_rule", "fwd")][0] == "pass", out
    assert results[("chunk_gated_delta_rule", "bwd")][0] == "pass", out
    assert results[("chunk_kda", "fwd")][0] == "pass", out
    steps = {case: result for (op, case, phase), (result, _) in rows.items() if op == "delta_rule_step"}
    assert len(steps) == 2 and set(steps.values()) == {"pass"}, out
    kda_bwd = results[("chunk_kda", "bwd")]                          # B=2 ... h0: an initial state
    assert kda_bwd[0] == "n/a" and "ChunkKdaBwd" in kda_bwd[1], out
    packed = {phase: result for (op, case, phase), (result, _) in rows.items()
              if op == "chunk_kda" and case.startswith("packed") and "h0" not in case}
    assert packed == {"fwd": "pass", "bwd": "pass"}, out
    assert status == 0, out


@pytest.mark.parametrize("standin", ["Ascend910_9392"], indirect=True)
def test_cp_rows_on_a3(standin, monkeypatch, capsys):
    """The CP rows on a declared Ascend910_9392 (each spawned rank installs the same stand-in): GDN's p2p forward
    and backward pass (building blocks), KDA's p2p forward passes and its backward is n/a naming Ascend950; KDA's
    Ulysses forward and backward pass (the monolithic ChunkKdaBwd)."""
    from hp_megatron.selfcheck import cli
    from tests.support.selfcheck_env import standin_a3

    good = {"torch": "2.7.1", "torch_npu": "2.7.1.post5", "triton-ascend": "3.2.0", "CANN": "8.5.0"}
    monkeypatch.setattr(cli.requirements, "installed", lambda backend: good)
    status, out = _main(["--backend", "ascendc", "--device", "cpu", "--only",
                         "CP2 p2p zigzag packed,chunk_kda CP2 ulysses"], capsys, standin_a3)
    results = {(op, case.split()[1], phase): (result, note) for (op, case, phase), (result, note) in _rows(out).items()}
    assert results[("chunk_gated_delta_rule", "p2p", "fwd")][0] == "pass", out
    assert results[("chunk_gated_delta_rule", "p2p", "bwd")][0] == "pass", out
    assert results[("chunk_kda", "p2p", "fwd")][0] == "pass", out
    kda_p2p_bwd = results[("chunk_kda", "p2p", "bwd")]
    assert kda_p2p_bwd[0] == "n/a" and "Ascend950" in kda_p2p_bwd[1], out
    assert results[("chunk_kda", "ulysses", "fwd")][0] == "pass", out
    assert results[("chunk_kda", "ulysses", "bwd")][0] == "pass", out
    assert status == 0, out


def test_decode_kernel_not_exported_is_not_available(standin, monkeypatch, capsys):
    """An fla-npu build without ``recurrent_kda`` (tag v26.6.0): the KDA decode row is n/a naming the build that
    has it; the GDN decode row still runs."""
    from hp_megatron.selfcheck import cli
    from layers.ops.ascendc import runtime

    for name in ("recurrent_kda", "npu_recurrent_kda"):
        monkeypatch.delattr(standin, name)
    runtime.require_api.cache_clear()
    monkeypatch.setattr(cli.requirements, "installed", lambda backend: {"torch": "2.7.1", "torch_npu": "2.7.1.post5",
                                                                        "triton-ascend": "3.2.1", "CANN": "8.5.0"})
    status, out = _main(["--backend", "ascendc", "--device", "cpu", "--no-cp", "--only", "delta_rule_step"], capsys)
    runtime.require_api.cache_clear()
    results = {case.split()[0]: (result, note) for (_, case, _), (result, note) in _rows(out).items()}
    assert results["gdn"][0] == "pass" and results["kda"][0] == "n/a", out
    assert "recurrent_kda" in results["kda"][1] and "5eabe875" in results["kda"][1], out
    assert status == 0, out


def test_bad_torch_npu_fails_the_check(standin, monkeypatch, capsys):
    """A torch_npu without fla-npu's stream fix fails the check even when every row passes."""
    from hp_megatron.selfcheck import cli

    bad = {"torch": "2.8.0", "torch_npu": "2.8.0.post2", "triton-ascend": "3.2.0", "CANN": "8.5.0"}
    monkeypatch.setattr(cli.requirements, "installed", lambda backend: bad)
    status, out = _main(["--backend", "ascendc", "--device", "cpu", "--no-cp", "--only", "causal_conv1d B=2"], capsys)
    assert [result for result, _ in _rows(out).values()] == ["pass", "pass"], out
    assert _requirement_statuses(out)["torch_npu"] == FAIL and "torch_npu>=2.8.0.post5" in out, out
    assert "requirements not met: torch_npu" in out and status == 1, out


def test_backend_missing_says_why(monkeypatch, capsys):
    from hp_megatron.selfcheck import cli
    from layers.ops.ascendc import runtime

    monkeypatch.setitem(sys.modules, "fla_npu", None)   # not importable, even if installed
    runtime.load_ops.cache_clear()
    try:
        status = cli.main(["--backend", "ascendc", "--device", "cpu"])
    finally:
        runtime.load_ops.cache_clear()
    out = capsys.readouterr().out
    assert "backend=ascendc cannot run here" in out and "fla-npu" in out and "FAILED" in out, out
    assert _requirement_statuses(out)["torch"] == OK
    assert status == 1


# ------------------------------------------------------------------------------------------- CP ranks
@pytest.mark.parametrize("setup,args,expect", [
    ("failing_rank", ["--verbose"], "rank setup failed on purpose"),
    ("stalled_rank", ["--cp-timeout", "3"], "did not finish within 3 s"),  # any deadline ends a stall
])
def test_cp_rank_failure_is_an_error_not_a_hang(setup, args, expect, capsys):
    from tests.support import selfcheck_env

    status, out = _main(["--backend", "eager", "--device", "cpu", "--only", "CP2 halo zigzag", *args], capsys,
                        getattr(selfcheck_env, setup))
    rows = _rows(out)
    assert set(rows) == {("causal_conv1d", "CP2 halo zigzag B=2 T=64", p) for p in ("fwd", "bwd")}, out
    assert all(result == "ERROR" and expect in note for result, note in rows.values()), out
    assert ("ERROR details:" in out and "Traceback" in out) == ("--verbose" in args), out
    assert status == 1, out


def test_unsupported_dtype_is_an_error_row(standin, monkeypatch, capsys):
    """fla-npu's KDA kernels take bf16 only: fp32 rows are ERRORs naming the constraint (traceback with --verbose);
    the conv, which runs PyTorch on the device, passes."""
    from hp_megatron.selfcheck import cli

    monkeypatch.setattr(cli.requirements, "installed", lambda backend: {"torch": "2.7.1", "torch_npu": "2.7.1.post5",
                                                                        "triton-ascend": "3.2.1", "CANN": "8.5.0"})
    status, out = _main(["--backend", "ascendc", "--device", "cpu", "--no-cp", "--dtype", "fp32", "--verbose",
                         "--only", "chunk_kda B=2,causal_conv1d B=2"], capsys)
    rows = _rows(out)
    assert {op: result for (op, _, _), (result, _) in rows.items()} == {"chunk_kda": "ERROR", "causal_conv1d": "pass"}
    assert all("TypeError" in note and "bfloat16" in note for (op, _, _), (_, note) in rows.items()
               if op == "chunk_kda"), out
    assert "ERROR details:" in out and "Traceback" in out and status == 1, out


# ------------------------------------------------------------------------------------------- command line
def test_command_line():
    """The real entry point (the eager baseline, one row in two dtypes)."""
    status, out = _run(["hp_megatron.selfcheck", "--backend", "eager", "--device", "cpu", "--no-cp", "--only",
                        "causal_conv1d_step", "--dtype", "fp32,bf16"])
    table = [re.split(r"\s{2,}", line) for line in out.splitlines() if line.startswith("causal_conv1d_step")]
    assert [(cells[3], cells[-1]) for cells in table] == [("fp32", "pass"), ("bf16", "pass")], out
    assert status == 0, out


def test_bad_arguments_exit_2(capsys):
    from hp_megatron.selfcheck import cli

    for argv, message in ((["--backend", "eager", "--dtype", "fp64"], "--dtype takes"),
                          (["--backend", "cuda"], "invalid choice")):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- interpreter (triton)
# FLA's kernels on CPU (fp32): the decode steps, and GDN forward and backward under CP through FLA's own KCP path
# (allgather on contiguous packed documents: gloo with the stacked all-gather), the interpreter on in the spawned
# ranks too. Three processes that import FLA (about 30 CPU s), started when collection ends beside the other tests
# (tests/support/background.py); tests/backends/test_backend_triton_interpreter.py covers the ops themselves.
INTERPRETER_ONLY = "delta_rule_step gdn,causal_conv1d_step,chunk_gated_delta_rule CP2 allgather contiguous"
if triton_interpreter.available() is None:
    background.declare("selfcheck_interpreter", __name__, [
        sys.executable, "-m", "tests.support.selfcheck_env", "interpreter", "--", "--backend", "triton", "--device",
        "cpu", "--dtype", "fp32", "--only", INTERPRETER_ONLY], ROOT)


@pytest.mark.skipif(triton_interpreter.available() is not None, reason=f"{triton_interpreter.available()}")
def test_triton_through_the_interpreter():
    status, stdout, stderr, _ = background.result("selfcheck_interpreter", timeout=900)
    out = stdout + stderr
    rows = _rows(stdout)
    assert {(op, phase) for op, _, phase in rows} == {
        ("delta_rule_step", "step"), ("causal_conv1d_step", "step"), ("chunk_gated_delta_rule", "fwd"),
        ("chunk_gated_delta_rule", "bwd")}, out
    assert all(result == "pass" for result, _ in rows.values()), out
    assert set(_requirement_statuses(stdout).values()) == {OK} and status == 0, out
    assert re.search(r"kernels: flash-linear-attention 0\.6\.\d+'s Triton kernels \(triton 3\.7\.\d+, Triton's "
                     r"interpreter\); FLA's backend dispatch off \(FLA_DISABLE_BACKEND_DISPATCH=1\)", stdout), out


# ------------------------------------------------------------------------------------------- version table
@pytest.mark.parametrize("torch_npu,status", [
    ("2.7.1.post5", OK), ("2.7.1.post4", FAIL), ("2.8.0.post5", OK), ("2.8.0.post2", FAIL), ("2.9.0.post3", OK),
    ("2.10.0.post1", FAIL), ("2.10.0.post2", OK), ("2.11.0rc2", FAIL), ("2.11.0rc3", OK), ("2.11.0", OK),
    ("2.12.0rc1", OK), ("2.13.0rc1", OK), ("2.13.0", OK), ("2.14.1", OK), ("2.6.0", FAIL), ("2.7.0.post3", FAIL),
    (None, FAIL), ("nonsense", FAIL)])
def test_torch_npu_stream_fix(torch_npu, status):
    checks = {c.package: c for c in check("ascendc", {"torch": "2.7.1", "torch_npu": torch_npu, "CANN": "8.5.0",
                                                      "triton-ascend": "3.2.0"})}
    assert checks["torch_npu"].status == status, checks["torch_npu"]


def test_ascend_floors():
    base = {"torch": "2.7.1", "torch_npu": "2.7.1.post5", "CANN": "8.5.0", "triton-ascend": "3.2.0"}

    def statuses(soc=None, **versions):
        return {c.package: c.status for c in check("ascendc", {**base, **versions}, soc)}

    assert statuses() == {"torch": OK, "torch_npu": OK, "CANN": OK, "triton-ascend": OK}
    assert statuses(torch="2.6.0")["torch"] == WARN and statuses(torch="2.5.1")["torch"] == FAIL  # fast launcher
    assert statuses(CANN="8.3.0.1.200")["CANN"] == FAIL and statuses(CANN=None)["CANN"] == FAIL
    assert statuses(CANN="9.1.0")["CANN"] == OK
    assert statuses("Ascend910B3")["triton-ascend"] == OK and statuses("Ascend950PR")["triton-ascend"] == FAIL
    assert statuses("Ascend950PR", **{"triton-ascend": "3.2.1"})["triton-ascend"] == OK


def test_triton_floors():
    base = {"torch": "2.13.0", "triton": "3.7.1", "flash-linear-attention": "0.6.0", "fla-core": "0.6.0"}

    def statuses(**versions):
        return {c.package: c.status for c in check("triton", {**base, **versions})}

    assert set(statuses().values()) == {OK}
    assert statuses(triton="3.6.0")["triton"] == WARN and statuses(triton="3.2.0")["triton"] == FAIL
    assert "Hopper" in {c.package: c for c in check("triton", {**base, "triton": "3.6.0"})}["triton"].note
    assert statuses(**{"flash-linear-attention": "0.7.0"})["flash-linear-attention"] == FAIL
    assert statuses(**{"fla-core": None})["fla-core"] == FAIL and statuses(torch="2.5.0")["torch"] == FAIL


def test_cann_version_file(tmp_path, monkeypatch):
    home = tmp_path / "ascend-toolkit" / "latest"
    home.mkdir(parents=True)
    (home / "version.info").write_text("driver_version=25.5.1\nVersion=9.1.0-beta.1\n")
    monkeypatch.delenv("ASCEND_OPP_PATH", raising=False)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    assert requirements.cann_version() == "9.1.0"
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "missing"))
    assert requirements.cann_version() is None


def _setup_kwargs() -> dict:
    """The keywords setup.py passes to setuptools.setup (the file run with setup() captured)."""
    import setuptools

    captured = {}
    original, setuptools.setup = setuptools.setup, lambda **kwargs: captured.update(kwargs)
    try:
        code = compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec")
        cwd = os.getcwd()
        os.chdir(ROOT)   # setup.py reads README.md
        try:
            exec(code, {"__name__": "__main__", "__file__": str(ROOT / "setup.py")})
        finally:
            os.chdir(cwd)
    finally:
        setuptools.setup = original
    return captured


def test_setup_pins_are_the_table():
    """setup.py's triton extra and torch floor state what layers/ops/triton/versions.py and requirements.py check
    (the [npu] extra: tests/backends/test_backend_ascendc_contract.py); the [triton] extra names no triton (the
    user's torch brings its own, and pip would replace a torch whose triton a pin of ours excludes: torch 2.14
    brings 3.8, 2.13 3.7, 2.9 3.5, 2.7 3.3); .ci/run pins the triton of the table."""
    from packaging.requirements import Requirement

    from layers.ops.triton import versions

    kwargs = _setup_kwargs()
    assert f"torch>={requirements.MIN_TORCH}" in kwargs["install_requires"]
    extra = {Requirement(r).name: str(Requirement(r).specifier) for r in kwargs["extras_require"]["triton"]}
    fla = f"<{'.'.join(map(str, versions.BELOW_FLA))},>={'.'.join(map(str, versions.MIN_FLA))}"
    assert extra == {"flash-linear-attention": fla, "fla-core": fla}, extra
    assert f'"triton=={versions.TRITON_PIN}"' in (ROOT / ".ci" / "run").read_text()
