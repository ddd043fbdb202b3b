"""muon_dist/comm.py on ranks as threads (ThreadComm): each collective is its equation, and the ledger records
what a direct implementation moves (module docstring), per caller-given name.

    all_to_all(x, out_splits, in_splits)[piece j] == member j's piece for me      sent: x minus my own piece
    all_gather(x)[j * n:(j + 1) * n] == member j's x                               (W - 1) n each way
    reduce_scatter_sum(x) == chunk me of (sum over members of x)                    (W - 1) n / W each way
    check_agreement(digest) == every rank's digest, in rank order                   (W - 1) 32 each way
in any group of the world's ranks (group order is member order), with a group of one answering locally.
On gloo (TorchComm), all_gather runs as an all_to_all_single of x repeated once per member: the same bits and
ledger as the ring all-gather, in one exchange.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_check.fixtures import same_bits
from muon_dist import ThreadComm, ThreadWorld
from muon_dist.comm import Group, run_threads
from tests.conftest import examples


def on_threads(W: int, rank_main) -> list[object]:
    world, results = ThreadWorld(W, timeout_s=10), [None] * W

    def main(rank: int) -> None:
        results[rank] = rank_main(ThreadComm(world, rank))

    run_threads(W, main)
    return results


def payload(rank: int, to: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """What `rank` sends `to`: values that name both (distinct for every pair)."""
    return (torch.arange(length) + 1000 * rank + 100 * to).to(dtype)


@st.composite
def groups(draw) -> tuple[int, tuple[int, ...]]:
    """A world of W ranks and a group of some of them, in any order (group order is member order)."""
    W = draw(st.integers(1, 5))
    ranks = draw(st.permutations(range(W)))
    return W, tuple(ranks[: draw(st.integers(1, W))])


@pytest.mark.timeout(60)
@settings(max_examples=examples(0.5))
@given(
    drawn=groups(),
    lengths=st.lists(st.integers(0, 4), min_size=25, max_size=25),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_all_to_all_delivers_piece_j_from_member_j_and_records_what_left_and_arrived(
    drawn, lengths, dtype
) -> None:
    W, ranks = drawn
    n = len(ranks)
    size = {
        (i, j): lengths[5 * i + j] for i in range(n) for j in range(n)
    }  # member i sends member j

    def rank_main(comm: ThreadComm):
        if comm.rank not in ranks:
            return None
        me = ranks.index(comm.rank)
        x = torch.cat([payload(me, j, size[me, j], dtype) for j in range(n)])
        out = comm.all_to_all(
            x, [size[j, me] for j in range(n)], [size[me, j] for j in range(n)], Group(ranks), "p"
        )
        return me, out, dict(comm.ledger), comm.calls

    for result in filter(None, on_threads(W, rank_main)):
        me, out, ledger, calls = result
        assert same_bits(out, torch.cat([payload(j, me, size[j, me], dtype) for j in range(n)]))
        item = torch.empty(0, dtype=dtype).element_size()
        sent = item * sum(size[me, j] for j in range(n) if j != me)
        received = item * sum(size[j, me] for j in range(n) if j != me)
        assert ledger == {"p": [sent, received]} and calls == [("p", "all_to_all", sent, received)]


@pytest.mark.timeout(60)
@settings(max_examples=examples(0.5))
@given(
    drawn=groups(), numel=st.integers(0, 6), dtype=st.sampled_from([torch.float32, torch.bfloat16])
)
def test_all_gather_concatenates_every_members_tensor_in_group_order(drawn, numel, dtype) -> None:
    W, ranks = drawn

    def rank_main(comm: ThreadComm):
        if comm.rank not in ranks:
            return None
        x = payload(ranks.index(comm.rank), 0, numel, dtype).reshape(numel, 1)
        return comm.all_gather(x, Group(ranks), "g"), dict(comm.ledger)

    moved = (len(ranks) - 1) * numel * torch.empty(0, dtype=dtype).element_size()
    want = torch.cat([payload(j, 0, numel, dtype) for j in range(len(ranks))])
    for out, ledger in filter(None, on_threads(W, rank_main)):
        assert same_bits(out, want) and ledger == {"g": [moved, moved]}


@pytest.mark.timeout(60)
@settings(max_examples=examples(0.5))
@given(drawn=groups(), per_member=st.integers(1, 4))
def test_reduce_scatter_sum_gives_member_j_chunk_j_of_the_sum(drawn, per_member) -> None:
    W, ranks = drawn
    n = len(ranks)
    inputs = [
        torch.arange(n * per_member, dtype=torch.float32) * (j + 1) - 0.5 * j for j in range(n)
    ]

    def rank_main(comm: ThreadComm):
        if comm.rank not in ranks:
            return None
        me = ranks.index(comm.rank)
        return (
            me,
            comm.reduce_scatter_sum(inputs[me].reshape(n, per_member), Group(ranks), "r"),
            dict(comm.ledger),
        )

    total = sum(inputs)
    moved = (n - 1) * per_member * 4
    for me, out, ledger in filter(None, on_threads(W, rank_main)):
        assert same_bits(out, total[me * per_member : (me + 1) * per_member])
        assert ledger == {"r": [moved, moved]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("W", [1, 3])
def test_check_agreement_returns_every_ranks_digest_in_rank_order(W: int) -> None:
    def rank_main(comm: ThreadComm):
        got = comm.check_agreement(hashlib.sha256(bytes([comm.rank])).digest(), "d")
        return got, dict(comm.ledger)

    want = [hashlib.sha256(bytes([r])).digest() for r in range(W)]
    moved = (W - 1) * 32
    assert on_threads(W, rank_main) == [(want, {"d": [moved, moved]})] * W


@pytest.mark.timeout(60)
def test_the_ledger_sums_per_name_and_reset_clears_it() -> None:
    def rank_main(comm: ThreadComm):
        g = comm.world_group()
        comm.all_gather(torch.ones(3), g, "a")
        comm.all_gather(torch.ones(2), g, "a")
        comm.all_gather(torch.ones(1, dtype=torch.bfloat16), g, "b")
        before = dict(comm.ledger), list(comm.calls)
        comm.reset()
        return before, dict(comm.ledger), comm.calls

    (ledger, calls), after, after_calls = on_threads(2, rank_main)[0]
    assert ledger == {"a": [20, 20], "b": [2, 2]} and after == {} and after_calls == []
    assert calls == [
        ("a", "all_gather", 12, 12),
        ("a", "all_gather", 8, 8),
        ("b", "all_gather", 2, 2),
    ]


def test_groups_are_their_ranks_in_order_and_subgroups_one_group_per_part() -> None:
    comm = ThreadComm(ThreadWorld(4), 2)
    assert comm.world_group() == Group((0, 1, 2, 3)) and comm.world_group().size == 4
    assert comm.group((2, 0)).ranks == (2, 0) and comm.group((2, 0)).size == 2
    parts = ((0, 2), (1, 3))
    assert comm.subgroups(parts) == {(0, 2): Group((0, 2)), (1, 3): Group((1, 3))}


@pytest.mark.timeout(60)
def test_a_collective_that_a_member_never_joins_times_out_naming_who_arrived() -> None:
    world = ThreadWorld(2, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"arrived \[0\]"):
        ThreadComm(world, 0).all_gather(torch.ones(1), Group((0, 1)), "x")


def test_run_threads_reraises_a_ranks_exception_in_the_caller() -> None:
    def rank_main(rank: int) -> None:
        if rank == 1:
            raise KeyError("rank 1 failed")

    with pytest.raises(KeyError, match="rank 1 failed"):
        run_threads(3, rank_main)


class NoBackend(ThreadComm):
    """A ThreadComm whose backend collectives fail: what it answers, it answered without them."""

    def _exchange(self, x, group):
        raise AssertionError(f"backend call on group {group.ranks}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_of_one_answers_every_collective_with_its_input_and_no_backend_call(dtype) -> None:
    """Comm's docstrings: a group of one returns the input flattened (a rank alone in a mesh axis: no round trip to
    the device or the network), and records zero bytes."""
    comm, alone = NoBackend(ThreadWorld(3), 1), Group((1,))
    x = torch.arange(6, dtype=dtype).reshape(2, 3)
    assert same_bits(comm.all_to_all(x, [6], [6], alone, "p"), x.reshape(-1))
    assert same_bits(comm.all_gather(x, alone, "p"), x.reshape(-1))
    assert same_bits(comm.reduce_scatter_sum(x, alone, "p"), x.reshape(-1))
    assert comm.ledger == {"p": [0, 0]} and [c[1] for c in comm.calls] == [
        "all_to_all",
        "all_gather",
        "reduce_scatter",
    ]
    with pytest.raises(
        AssertionError, match="backend call"
    ):  # the control: a group of two does call it
        comm.all_gather(x, Group((0, 1)), "p")


@pytest.mark.timeout(60)
def test_the_worlds_mailboxes_are_emptied_once_every_member_has_read() -> None:
    """ThreadWorld keeps a call's contributions only until each member has read them: a long test on threads does
    not hold every tensor it ever exchanged."""
    world = ThreadWorld(3, timeout_s=10)

    def main(rank: int) -> None:
        comm = ThreadComm(world, rank)
        for _ in range(4):
            comm.all_gather(torch.ones(5), comm.world_group(), "g")
        if rank != 1:  # a group that is not the world
            comm.reduce_scatter_sum(torch.ones(6), comm.group((0, 2)), "r")

    run_threads(3, main)
    assert world.slots == {} and dict(world.reads) == {}


def test_only_the_whole_world_gets_the_world_handle_and_a_given_handle_is_kept() -> None:
    """Comm.group: the world's handle for the world's ranks compared by value, none for other ranks, a given handle
    kept."""

    class Handled(ThreadComm):
        def _world_handle(self):
            return "WORLD"

    comm = Handled(ThreadWorld(4), 2)
    assert (
        comm.group(tuple(range(4))).handle == "WORLD"
    )  # a tuple of its own, equal to the world's ranks
    assert comm.group((2, 0)).handle is None and comm.group((0, 1, 2)).handle is None
    assert comm.group((2, 0), "axis").handle == "axis"


def test_reduce_scatter_refuses_a_tensor_that_does_not_split_into_equal_chunks() -> None:
    """reduce_scatter_sum's precondition numel % group.size == 0, asserted before any backend call."""
    comm = NoBackend(ThreadWorld(2), 0)
    with pytest.raises(
        AssertionError, match=r"^\(5, 2\)$"
    ):  # its own precondition, before any backend call
        comm.reduce_scatter_sum(torch.zeros(5), Group((0, 1)), "p")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("members", [(0, 1, 2), (0, 2)])
@pytest.mark.parametrize("numel, dtype", [(32, "float32"), (5, "bfloat16"), (0, "float32")])
def test_gloo_all_gather_by_all_to_all_gives_the_ring_all_gathers_bits_and_ledger(
    members, numel, dtype
) -> None:
    """TorchComm.all_gather on gloo, on the world and on a sub-group: the route gloo takes (gathers_by_all_to_all)
    gives piece j = member j's x, bit for bit, and the same ledger as the ring all-gather. Negative control: a
    planted route that exchanges nothing (each member's own x, repeated) fails the same check."""
    from .conftest import get_pool
    from .workers import all_gather_routes_on_gloo

    results = get_pool(3).run(all_gather_routes_on_gloo, numel, dtype, members, timeout=30)
    moved = (len(members) - 1) * numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    for rank, r in enumerate(results):
        if rank not in members:
            assert r is None
            continue
        assert r["by_all_to_all"] is True, (rank, r)  # a property of the gloo backend, not of a CPU
        for route in ("chosen", "ring"):
            assert r[route]["bits"] and r[route]["ledger"] == {"g": [moved, moved]}, (
                rank,
                route,
                r,
            )
        assert r["planted"]["bits"] is (numel == 0), (
            rank,
            r,
        )  # the control: caught wherever there is data


class _Work:
    """A stand-in for torch's Work of an asynchronous all_to_all_single: it holds the send buffer until waited for,
    and reports itself completed as _Work.done says."""

    done = False

    def __init__(self, out: torch.Tensor, x: torch.Tensor) -> None:
        self.out, self.x = out, x

    def is_completed(self) -> bool:
        return _Work.done

    def wait(self) -> None:
        self.out.copy_(self.x)


class _Dist:
    """A stand-in for torch.distributed whose all_to_all_single returns a `work` (a _Work class) at once."""

    def __init__(self, work: type = _Work) -> None:
        self.work = work

    def all_to_all_single(self, out, x, out_splits, in_splits, group=None, async_op=False):
        return self.work(out, x)


def _fake_torch_comm(work: type = _Work):
    """A TorchComm of rank 0 in a world of 2 whose backend is _Dist(work) (no process group)."""
    from muon_dist.comm import Comm, TorchComm

    comm = TorchComm.__new__(TorchComm)
    Comm.__init__(comm)
    comm.dist, comm.rank, comm.world_size, comm._in_flight = _Dist(work), 0, 2, []
    return comm


def test_a_waited_all_to_all_lets_its_send_buffer_go() -> None:
    """TorchComm's asynchronous all_to_all: the backend's work holds the send buffer while the collective runs (as
    torch's Work does); once wait() returned, a Pending its caller keeps holds the result only, and the send buffer
    goes with its last other reference. Negative control: a finish that keeps the work (as TorchComm's did before)
    keeps the send buffer alive after wait()."""
    import weakref

    comm = _fake_torch_comm()
    group = Group((0, 1), None)
    send = torch.arange(4.0)
    sent = weakref.ref(send)
    pending = comm.all_to_all(send, [2, 2], [2, 2], group, "p", async_op=True)
    del send
    assert sent() is not None  # in flight: the work holds it
    assert pending.wait().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sent() is None and pending.wait().tolist() == [0.0, 1.0, 2.0, 3.0]

    def keeping(x, out_splits, in_splits, group):
        out = x.new_empty(sum(out_splits))
        work = _Dist().all_to_all_single(out, x, out_splits, in_splits)
        return lambda: (work.wait(), out)[1]

    comm._all_to_all_start = keeping
    send = torch.arange(4.0)
    sent = weakref.ref(send)
    pending = comm.all_to_all(send, [2, 2], [2, 2], group, "p", async_op=True)
    del send
    pending.wait()
    assert sent() is not None


def test_release_done_lets_the_send_buffer_of_a_completed_all_to_all_go_before_its_wait() -> None:
    """TorchComm.release_done: a work that reports itself completed is waited for and dropped, with its send buffer,
    and its Pending's wait() then returns the result; a work still running is left as it is. Negative control: the
    base Comm's release_done (nothing to do) keeps the completed work's send buffer."""
    import weakref

    from muon_dist.comm import Comm

    def issued() -> tuple:
        comm = _fake_torch_comm()
        _Work.done = False
        send = torch.arange(4.0)
        sent = weakref.ref(send)
        pending = comm.all_to_all(send, [2, 2], [2, 2], Group((0, 1), None), "p", async_op=True)
        return comm, pending, sent

    comm, pending, sent = issued()
    comm.release_done()
    assert sent() is not None  # still running: left as it is
    _Work.done = True
    comm.release_done()
    assert sent() is None and comm._in_flight == []
    assert pending.wait().tolist() == [0.0, 1.0, 2.0, 3.0]

    comm, pending, sent = issued()
    _Work.done = True
    Comm.release_done(comm)
    assert sent() is not None


@pytest.mark.timeout(60)
def test_on_gloo_release_done_lets_a_send_buffer_go_once_its_all_to_all_completes() -> None:
    """On gloo (2 ranks), an asynchronous all-to-all's send buffer goes by release_done alone once the collective has
    completed, before its Pending is waited for, and the result is the exchange's (a property of torch's gloo Work:
    is_completed turns true without a wait). Control: the same exchange without release_done keeps the send buffer
    until the wait."""
    from .conftest import get_pool
    from .workers import release_done_on_gloo

    for r in get_pool(2).run(release_done_on_gloo, timeout=30):
        assert r == {"released": True, "result": True, "kept_without": True}, r


def test_release_done_raises_the_error_of_a_failed_collective_as_its_wait_would() -> None:
    """A completed work whose wait raises (a collective that failed: a peer gone) raises from release_done with the
    backend's error, as the Pending's own wait would have; it is not swallowed. Control: the same work left running
    raises nothing until it completes."""

    class Failed(_Work):
        def wait(self) -> None:
            raise RuntimeError("Connection reset by peer")

    comm = _fake_torch_comm(Failed)
    _Work.done = False
    comm.all_to_all(torch.arange(4.0), [2, 2], [2, 2], Group((0, 1), None), "p", async_op=True)
    comm.release_done()  # still running: nothing raised
    _Work.done = True
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        comm.release_done()
