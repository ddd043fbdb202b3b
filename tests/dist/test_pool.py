"""The rank pool turns a raising or hung rank into a test failure, then restarts cleanly."""

from __future__ import annotations

import os
import time

import pytest
import torch

from muon_check import launch
from muon_check.fixtures import same_bits
from muon_check.launch import RankFailure, RankPool

from .workers import fail_on, killed_in_a_collective, tensors_of_every_kind


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_failing_or_hung_rank_fails_the_call_and_the_next_call_gets_a_fresh_pool(
    how: str,
) -> None:
    pool = RankPool(3)
    try:
        pool.start()
        failed = [p.pid for p in pool.procs]
        start = time.monotonic()
        with pytest.raises(
            RankFailure, match="deliberate failure" if how == "raise" else "no answer"
        ):
            pool.run(fail_on, 1, how, timeout=3)
        assert time.monotonic() - start < 10
        # the failed ranks are gone and the next ones already started (kill(restart=True))
        assert not any(_alive(pid) for pid in failed)
        assert pool.procs and not {p.pid for p in pool.procs} & set(failed)
        assert pool.run(fail_on, -1, how, timeout=30) == [0, 1, 2]
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_forked_pool_serves_calls_inside_a_test_that_captures_sys_stderr(capsys) -> None:
    """A rank forked while capsys holds sys.stderr (an in-memory stream, no descriptor) registers its stack dump
    on fd 2 and serves; with file=sys.stderr every rank died before serving (seen in the benchmark and verify
    tests that call main() under capsys)."""
    pool = RankPool(2)
    try:
        assert pool.run(fail_on, -1, "raise", timeout=90) == [0, 1]
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_spawned_pool_serves_calls_as_a_forked_one_does() -> None:
    """RankPool(start_method="spawn") answers a call with every rank's result, its ranks spawned processes. Spawn is
    how device="cuda" starts its ranks (a forked child cannot use CUDA once the parent has): the same start method,
    run on CPU tensors."""
    pool = RankPool(2, start_method="spawn")
    try:
        assert pool.run(fail_on, -1, "raise", timeout=90) == [0, 1]
        assert all(type(p._popen).__module__.endswith("popen_spawn_posix") for p in pool.procs)
    finally:
        pool.close()


IMPORTED = '"torch.distributed.tensor" in __import__("sys").modules'


@pytest.mark.timeout(180)
def test_a_rank_forked_by_a_zygote_starts_and_restarts_with_dtensor_imported() -> None:
    """The check's pools (a hash seed, on the CPU) fork each rank from a zygote that imported
    torch.distributed.tensor, so a rank's start and its restart after a failure cost a fork, not that import
    (docs/conformance.md, "Ranks"): the module is there before the rank's first call, and again after a restart.
    Control: a rank spawned directly (no zygote) has imported only torch and torch.distributed by then."""
    pool = RankPool(2, hash_seed=0)
    try:
        assert pool.run(eval, IMPORTED, timeout=90) == [True, True]
        pool.kill(restart=True)
        assert pool.run(eval, IMPORTED, timeout=90) == [True, True]
    finally:
        pool.close()
    control = RankPool(2, start_method="spawn")
    try:
        assert control.run(eval, IMPORTED, timeout=90) == [False, False]
    finally:
        control.close()


SEED = 'int(__import__("os").environ["PYTHONHASHSEED"])'


@pytest.mark.timeout(180)
def test_pools_of_one_hash_seed_share_its_zygotes_and_their_ranks_keep_their_own_seeds() -> None:
    """A pool's zygotes stay for the next pool that asks for their seeds (muon_check.launch._zygote_for), so its
    start costs a fork per rank, not a spawn: two pools of hash seed 0, the second started after the first closed,
    fork from the same zygotes, and each rank r still runs with PYTHONHASHSEED r. Control: a pool of another hash
    seed forks from other zygotes, its ranks with their own seeds."""
    zygotes = []
    for hash_seed in (0, 0, 7):
        pool = RankPool(2, hash_seed=hash_seed)
        try:
            assert pool.run(eval, SEED, timeout=90) == [hash_seed, hash_seed + 1]
            zygotes.append([proc.pid for proc, _ in pool.zygotes])
        finally:
            pool.close()
    assert zygotes[0] == zygotes[1] and not set(zygotes[2]) & set(zygotes[0]), zygotes


@pytest.mark.timeout(180)
def test_a_pool_started_after_the_environment_changed_gets_zygotes_spawned_in_it(
    monkeypatch,
) -> None:
    """A zygote's ranks see the environment, module path and working directory of the zygote's spawn: a pool started
    after this process changed any of them gets new zygotes (the old ones ended), whose ranks see the change.
    Control: the same pool before the change, whose ranks do not."""
    probe = '__import__("os").environ.get("MUON_POOL_PROBE")'
    answers = []
    for value in (None, "changed"):
        if value is not None:
            monkeypatch.setenv("MUON_POOL_PROBE", value)
        pool = RankPool(2, hash_seed=0)
        try:
            answers.append(pool.run(eval, probe, timeout=90))
        finally:
            pool.close()
    assert answers == [[None, None], ["changed", "changed"]], answers


@pytest.mark.timeout(180)
def test_pools_in_other_tests_of_a_suite_share_zygotes(monkeypatch) -> None:
    """pytest sets PYTEST_CURRENT_TEST anew for every test and phase; it says where the suite is, not what a rank
    runs, so a pool started after it changed forks from the zygotes of the pool before (else every test would spawn
    its zygotes and import torch again). Control: a change of any other variable gets new zygotes."""
    zygotes = []
    for name in (None, "PYTEST_CURRENT_TEST", "MUON_POOL_PROBE"):
        if name is not None:
            monkeypatch.setenv(name, "tests/dist/test_pool.py::another (call)")
        pool = RankPool(2, hash_seed=0)
        try:
            pool.run(os.getpid, timeout=90)
            zygotes.append([proc.pid for proc, _ in pool.zygotes])
        finally:
            pool.close()
    assert zygotes[0] == zygotes[1] and not set(zygotes[2]) & set(zygotes[0]), zygotes


def _copy_of(raw: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor of its own made of `raw` (the control's pickler)."""
    return (
        torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if raw
        else torch.empty(shape, dtype=dtype)
    )


def _faithful(got: dict, sent: dict) -> list[str]:
    """What of `sent` the answer `got` lost: each tensor's bits, dtype, shape, stride, offset, requires_grad and
    class, the views of one storage sharing one storage, the same tensor one object; [] when nothing."""
    lost = [
        k
        for k, t in sent.items()
        if isinstance(t, torch.Tensor)
        and not (
            type(got[k]) is type(t)
            and same_bits(got[k].detach(), t.detach())
            and (got[k].stride(), got[k].storage_offset(), got[k].requires_grad)
            == (t.stride(), t.storage_offset(), t.requires_grad)
        )
    ]
    ptr = got["base"].untyped_storage().data_ptr()
    if {got[k].untyped_storage().data_ptr() for k in ("rows", "t")} != {ptr}:
        lost.append("views of one storage")
    if got["again"] is not got["base"]:
        lost.append("the same tensor")
    return lost + ([] if got["text"] == sent["text"] else ["text"])


@pytest.mark.timeout(120)
def test_a_ranks_answer_keeps_its_tensors_and_their_views_and_carries_them_by_value(
    monkeypatch,
) -> None:
    """A rank's answer comes back with every tensor as it was on the rank (bits, stride, offset, class,
    requires_grad; views of one storage still share it), its CPU storages carried in the pickle by value, not
    moved into shared memory and passed by file descriptor or name (launch._answer_bytes; the rebuild from
    either is made to fail here). Control: a pickler that sends each tensor as its own contiguous copy loses the views
    and the strides."""
    import io
    import pickle

    import torch.multiprocessing.reductions as reductions

    sent = tensors_of_every_kind()
    assert _faithful(pickle.loads(launch._answer_bytes(sent)), sent) == []

    def refused(*_):
        raise AssertionError("a storage came through shared memory")

    for name in (
        "rebuild_storage_fd",
        "rebuild_storage_filename",
    ):  # torch's two sharing strategies
        monkeypatch.setattr(reductions, name, refused)
    pool = RankPool(2)
    try:
        answers = pool.run(tensors_of_every_kind, timeout=90)
    finally:
        pool.close()
    assert [_faithful(a, sent) for a in answers] == [[], []]

    class Copies(pickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) is torch.Tensor:
                raw = obj.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                return _copy_of, (raw, obj.dtype, tuple(obj.shape))
            return NotImplemented

    out = io.BytesIO()
    Copies(out, pickle.HIGHEST_PROTOCOL).dump(sent)
    assert {"views of one storage", "t"} <= set(_faithful(pickle.loads(out.getvalue()), sent))


@pytest.mark.timeout(120)
def test_a_calls_timeout_counts_from_the_ranks_start_not_from_their_spawn() -> None:
    """A spawned rank's start (torch's import, a CUDA context, the rendezvous) is not the call's: the first call of
    a fresh spawned pool gets its whole timeout once every rank has said it started. When the timeout counted from
    the submit, this call failed as "no answer" (the start alone takes longer than 0.2 s), and on a loaded GPU node
    every case of `--planted --device cuda` timed out the same way, each on a respawned pool."""
    pool = RankPool(2, start_method="spawn")
    try:
        pids = pool.run(
            os.getpid, timeout=0.2
        )  # a call that imports nothing: its time is the ranks' answer
        assert pids == [p.pid for p in pool.procs] and pool.started == {0, 1}
        assert pool.run(os.getpid, timeout=0.2) == pids
    finally:
        pool.close()


def test_a_pool_on_an_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device must be one of"):
        RankPool(2, device="tpu")
    assert RankPool(2, device="cuda").start_method == "spawn" and RankPool(2).start_method == "fork"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGSEGV", "SIGABRT", "exit"])
def test_a_rank_killed_by_a_signal_is_named_with_the_signal_and_the_collective_it_hit(
    how: str,
) -> None:
    """A rank that a fatal signal kills: its failure names the signal and the torch.distributed call from
    faulthandler's dump, and the conformance check's crash says "killed by Segmentation fault in torch.distributed
    all_gather_tensor (...), called from ..." (a segfault inside torch's functional collectives on gloo over CUDA
    tensors reads so). Controls: SIGABRT (what gloo does to the peers of a dead rank) and a plain exit keep the
    "died in a collective" note, and no "killed" is named for the exit."""
    from muon_check import conformance
    from muon_check.adapters.cases import Case

    pool = RankPool(2)
    try:
        with pytest.raises(RankFailure) as failed:
            pool.run(killed_in_a_collective, how, timeout=30)
    finally:
        pool.close()
    first = failed.value.messages[0].splitlines()[0]
    outcome = conformance._failed(Case("even", "dtensor", 2, ((4, 5),)), failed.value)
    if how == "SIGSEGV":
        where = "in torch.distributed all_gather_tensor (_functional_collectives.py), called from workers.py:"
        assert f"; killed: Segmentation fault {where}" in first, first
        assert outcome.error.startswith(f"rank 0: killed by Segmentation fault {where}"), (
            outcome.error
        )
    else:
        assert ("; killed: Aborted in torch.distributed" in first) == (how == "SIGABRT"), first
        assert "; killed: " not in first or how == "SIGABRT", first
        assert (
            outcome.error
            == "rank 0: died in a collective (gloo aborted it; peers: connection reset)"
        )
    assert outcome.status == "crash"
