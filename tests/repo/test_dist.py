"""tests/support/dist.py on a failing spawn: per-case deadlines, messages naming the rank and case, and the cases
finished before the failure still usable (one 2-rank spawn per failure kind, a few seconds each)."""
import time

import pytest
import torch.distributed

from tests.support.dist import DistributedTestError, case_result, case_started, run_distributed, run_distributed_cases


def _hangs_in_b(rank, world_size):
    for case in ("a", "b", "c"):
        case_started(case)
        if case == "b" and rank == 1:
            time.sleep(3600)
        case_result(case, rank * 10)
    return {}


def _raises_in_b(rank, world_size):
    case_started("a")
    case_result("a", rank)
    torch.distributed.barrier()  # both ranks have reported "a"
    case_started("b")
    if rank == 0:
        raise ValueError("broken case")
    return {"b": rank}


def test_deadline_is_per_case_and_names_rank_and_case():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hangs_in_b, 2, timeout=2.0)
    message = str(info.value)
    assert "timed out: rank 1" in message and "case 'b'" in message, message
    assert info.value.partial[1] == {"a": 10} and info.value.partial[0].get("a") == 0


def test_cases_finished_before_a_failure_still_pass():
    assert run_distributed_cases(_raises_in_b, 2, "a") == [0, 1]
    with pytest.raises(DistributedTestError, match=r"rank 0 raised in case 'b'[\s\S]*broken case"):
        run_distributed_cases(_raises_in_b, 2, "c")


def _reports_environment(rank, world_size):
    import os

    print(f"rank {rank} writes to the test's stdout", flush=True)
    return os.environ.get("HP_TEST_DIST_PROBE")


def test_ranks_get_the_environment_and_output_of_the_spawn(monkeypatch, capfd):
    """Ranks fork from a server started at the first spawn (tests/support/dist.py PRELOAD); each still sees the
    environment and stdout of the test that spawns it."""
    run_distributed(_reports_environment, 1)  # the fork server runs now, with the environment before this test's
    monkeypatch.setenv("HP_TEST_DIST_PROBE", "set by the test")
    capfd.readouterr()
    assert run_distributed(_reports_environment, 2) == ["set by the test"] * 2
    out = capfd.readouterr().out
    assert "rank 0 writes to the test's stdout" in out and "rank 1 writes to the test's stdout" in out, out
