"""The only module that calls collectives. Each call is recorded under the name its caller gives (a path, or a
check of the step): bytes sent and received by this rank, counted as a direct (one message per peer)
implementation would move them, so the counts are the algorithm's traffic, not the backend's (a ring all-gather
moves the same total). It knows groups of ranks, never layouts or paths.

Two implementations with one interface: TorchComm over torch.distributed (gloo, NCCL) and ThreadComm, ranks
as threads of one process, for fast property tests of the planner and the paths.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

# (world group, parts) -> {part: process group}: new_group is collective over the world, so each partition's
# groups are created once per process and reused by every optimizer and step.
_SUBGROUPS: dict[tuple, dict[tuple[int, ...], Any]] = {}


@dataclass(frozen=True)
class Group:
    """A communication group: its global ranks in group order, and the backend's handle (None for threads)."""

    ranks: tuple[int, ...]
    handle: Any = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


class Pending:
    """A collective in flight (all_to_all(..., async_op=True)): wait() blocks until it is done and returns its
    result. op and path name it, as the ledger does."""

    def __init__(self, op: str, path: str, finish: Callable[[], Tensor]) -> None:
        self.op, self.path, self._finish = op, path, finish

    def wait(self) -> Tensor:
        return self._finish()


class Comm:
    """Ledger and accounting shared by both implementations; subclasses implement the _collectives."""

    rank: int
    world_size: int
    device: torch.device = torch.device(
        "cpu"
    )  # where the step's small control tensors (digests, flags) live

    def __init__(self) -> None:
        self.ledger: dict[str, list[int]] = defaultdict(
            lambda: [0, 0]
        )  # path -> [sent, received] bytes
        # (path, collective, sent, received); collective "carried": control elements inside the call before it
        self.calls: list[tuple[str, str, int, int]] = []

    def _record(self, path: str, op: str, sent: int, received: int) -> None:
        self.ledger[path][0] += sent
        self.ledger[path][1] += received
        self.calls.append((path, op, sent, received))

    def reset(self) -> None:
        self.ledger.clear()
        self.calls.clear()

    def all_to_all(
        self,
        x: Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: Group,
        path: str,
        control: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """all_to_all_single: x is cut by in_splits (one piece per member); piece j of the result came from member j.
        control: the last element of every piece is a control element (a flag the step carries with the data),
        logged under that name, the rest under `path` (so a path's bytes stay its data's). async_op: return a
        Pending at once (the collective runs while the caller computes; every rank must issue the same
        collectives in the same order, as for blocking ones), else the result."""
        me = group.ranks.index(self.rank)
        size = x.element_size()
        flags = size * (group.size - 1) if control else 0
        self._record(
            path,
            "all_to_all",
            size * (sum(in_splits) - in_splits[me]) - flags,
            size * (sum(out_splits) - out_splits[me]) - flags,
        )
        if control:
            self._record(control, "carried", flags, flags)  # not a collective of its own
        if group.size == 1:  # a group of one: the result is the input (no backend call)
            finish = lambda: x.reshape(-1)  # noqa: E731
        else:
            finish = self._all_to_all_start(x, list(out_splits), list(in_splits), group)
        return Pending("all_to_all", path, finish) if async_op else finish()

    def release_done(self) -> None:
        """Let go now of what every asynchronous collective that has already completed holds for its run (its
        send buffer), rather than at its Pending's wait(). A local check, no collective: any rank may call it at
        any time, any number of times, without changing which collectives run or in what order. Nothing to do
        here: a base Comm's collectives complete when issued."""

    def all_gather(self, x: Tensor, group: Group, path: str) -> Tensor:
        """Equal-size all-gather: result[j * n:(j + 1) * n] is member j's x (n = x.numel())."""
        moved = (group.size - 1) * x.numel() * x.element_size()
        self._record(path, "all_gather", moved, moved)
        return x.reshape(-1) if group.size == 1 else self._all_gather(x.reshape(-1), group)

    def reduce_scatter_sum(self, x: Tensor, group: Group, path: str) -> Tensor:
        """Chunk j (of group.size equal chunks) of the elementwise sum over members, returned to member j."""
        assert x.numel() % group.size == 0, (x.numel(), group.size)
        moved = (group.size - 1) * (x.numel() // group.size) * x.element_size()
        self._record(path, "reduce_scatter", moved, moved)
        return x.reshape(-1) if group.size == 1 else self._reduce_scatter_sum(x.reshape(-1), group)

    def check_agreement(self, digest: bytes, what: str) -> list[bytes]:
        """All-gather a 32-byte digest over the world; every rank gets every rank's digest (never a hang). A world
        of one needs no device round trip."""
        assert len(digest) == 32
        if self.world_size == 1:
            self._record(what, "all_gather", 0, 0)
            return [digest]
        world = self.world_group()
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(self.device)
        gathered = self.all_gather(mine, world, what).cpu()
        return [bytes(gathered[32 * r : 32 * (r + 1)].tolist()) for r in range(self.world_size)]

    def world_group(self) -> Group:
        return Group(tuple(range(self.world_size)), self._world_handle())

    def group(self, ranks: tuple[int, ...], handle: Any = None) -> Group:
        """The group of `ranks` (global ranks, in group order) with a backend handle the caller already has (a
        DeviceMesh axis's group), or the default group's when ranks are the whole world."""
        if handle is None and ranks == tuple(range(self.world_size)):
            handle = self._world_handle()
        return Group(ranks, handle)

    def subgroups(self, parts: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], Group]:
        """A Group for each of `parts` (disjoint groups of global ranks). Collective on first use: every rank of
        the world must call it with the same `parts`, in the same order of calls, member or not."""
        return {part: Group(part, handle) for part, handle in self._subgroup_handles(parts).items()}

    def _world_handle(self) -> Any:
        return None

    def _subgroup_handles(self, parts: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], Any]:
        return dict.fromkeys(parts)


class TorchComm(Comm):
    """Collectives of torch.distributed on the default process group and on DeviceMesh sub-groups.

    Only collectives that exist in every supported torch (2.9 and newer) are called: all_to_all_single,
    all_gather_into_tensor, reduce_scatter_tensor (torch 2.13's all_gather_single / reduce_scatter_single
    are newer names; tests/test_torch_api.py fails on any name newer than 2.9)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        super().__init__()
        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._gloo: dict[Any, bool] = {}  # group handle -> whether its backend is gloo
        # the works of asynchronous all-to-alls not yet waited for, each in a list of its own (emptied once
        # waited for, by its Pending or by release_done)
        self._in_flight: list[list[Any]] = []
        if dist.get_backend() == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _world_handle(self) -> Any:
        return self.dist.group.WORLD

    def _subgroup_handles(self, parts: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], Any]:
        """new_group for every part, once per process: cached by the parts themselves (global ranks: a stable
        identity of the mesh and its axes; xtuner keys on id(mesh), which Python reuses) and the world group."""
        key = (self.dist.group.WORLD, parts)
        if key not in _SUBGROUPS:
            for part in parts:  # new_group orders members by global rank; ours are in mesh order
                if list(part) != sorted(part):
                    raise ValueError(
                        f"DistributedMuon: mesh ranks {part} of one shard group do not increase in "
                        "mesh order; use a mesh whose ranks increase along its sharding axes"
                    )
            _SUBGROUPS[key] = {part: self.dist.new_group(list(part)) for part in parts}
        return _SUBGROUPS[key]

    def _all_to_all_start(
        self, x: Tensor, out_splits: list[int], in_splits: list[int], group: Group
    ) -> Callable[[], Tensor]:
        out = x.new_empty(sum(out_splits))
        # the work holds the send buffer until it goes: dropped once waited for, so that a Pending kept by its
        # caller holds only the result
        works = [
            self.dist.all_to_all_single(
                out, x.contiguous(), out_splits, in_splits, group=group.handle, async_op=True
            )
        ]
        del x
        self._in_flight = [w for w in self._in_flight if w] + [works]

        def finish() -> Tensor:
            if works:
                works.pop().wait()
            return out

        return finish

    def release_done(self) -> None:
        """Comm.release_done: each work in flight that reports itself completed (Work.is_completed, which does not
        block) is waited for now, which returns at once, and dropped with its send buffer; its Pending's wait()
        then returns the result alone. On CUDA the wait orders the current stream after the collective, as the
        Pending's own wait would."""
        for works in self._in_flight:
            if works and works[0].is_completed():
                works.pop().wait()
        self._in_flight = [w for w in self._in_flight if w]

    def _all_gather(self, x: Tensor, group: Group) -> Tensor:
        if self.gathers_by_all_to_all(group):
            # every member's x to every member: one exchange, not a ring
            n = x.numel()
            splits = [n] * group.size
            return self._all_to_all_start(x.repeat(group.size), splits, splits, group)()
        out = x.new_empty(group.size * x.numel())
        with older_collective_names():
            self.dist.all_gather_into_tensor(out, x.contiguous(), group=group.handle)
        return out

    def gathers_by_all_to_all(self, group: Group) -> bool:
        """Whether an all-gather on this group runs as an all_to_all_single of x repeated once per member (the same
        result, bytes and ledger): on gloo, whose all-gather passes the pieces round a ring in size - 1 steps one
        after another while its all-to-all sends to every peer at once, so a small all-gather (the step's control
        digests and flags) waits for one message instead of size - 1 (docs/distributed.md, "Control collectives
        on gloo"). Other backends (NCCL) keep their all-gather."""
        if group.handle not in self._gloo:
            self._gloo[group.handle] = self.dist.get_backend(group.handle) == "gloo"
        return self._gloo[group.handle]

    def _reduce_scatter_sum(self, x: Tensor, group: Group) -> Tensor:
        out = x.new_empty(x.numel() // group.size)
        with older_collective_names():
            self.dist.reduce_scatter_tensor(
                out, x.contiguous(), op=self.dist.ReduceOp.SUM, group=group.handle
            )
        return out


@contextlib.contextmanager
def older_collective_names() -> Any:
    """torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor (FutureWarning) for names that torch
    2.9-2.12 lack; we call the older names on purpose, so their deprecation warning is not the user's to see."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`",
            category=FutureWarning,
        )
        yield


def run_threads(world_size: int, rank_main: Any, timeout_s: float = 60.0) -> None:
    """rank_main(rank) for every rank of an in-process world, one thread each; re-raises the first rank's
    exception (a rank that outlives the timeout fails through its ThreadWorld collective's own timeout)."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    if errors:
        raise errors[0]


class ThreadWorld:
    """Mailboxes shared by the threads of one in-process world: member j's contribution to call k of a group."""

    def __init__(self, world_size: int, timeout_s: float = 30.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cv = threading.Condition()
        self.slots: dict[tuple, dict[int, Any]] = {}
        self.reads: dict[tuple, int] = defaultdict(int)

    def exchange(self, key: tuple, ranks: tuple[int, ...], rank: int, value: Any) -> list[Any]:
        with self.cv:
            self.slots.setdefault(key, {})[rank] = value
            self.cv.notify_all()
            if not self.cv.wait_for(
                lambda: len(self.slots[key]) == len(ranks), timeout=self.timeout_s
            ):
                raise TimeoutError(
                    f"rank {rank}: collective {key} timed out; arrived {sorted(self.slots[key])}"
                )
            values = [self.slots[key][r] for r in ranks]
            self.reads[key] += 1
            if self.reads[key] == len(ranks):
                del self.slots[key], self.reads[key]
        return values


class ThreadComm(Comm):
    """Rank `rank` of a ThreadWorld; collectives match in call order per group (as on a real backend)."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__()
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.sequence: dict[tuple[int, ...], int] = defaultdict(int)

    def _exchange(self, x: Any, group: Group) -> list[Any]:
        self.sequence[group.ranks] += 1
        return self.world.exchange(
            (group.ranks, self.sequence[group.ranks]), group.ranks, self.rank, x
        )

    def _all_to_all_start(
        self, x: Tensor, out_splits: list[int], in_splits: list[int], group: Group
    ) -> Callable[[], Tensor]:
        """Done at once (threads meet in the world's mailbox); the result waits for wait()."""
        pieces = self._exchange(list(x.split(in_splits)), group)
        me = group.ranks.index(self.rank)
        out = torch.cat([p[me] for p in pieces]) if pieces else x.new_empty(0)
        return lambda: out

    def _all_gather(self, x: Tensor, group: Group) -> Tensor:
        return torch.cat(self._exchange(x.clone(), group))

    def _reduce_scatter_sum(self, x: Tensor, group: Group) -> Tensor:
        parts = self._exchange(x.clone(), group)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.chunk(group.size)[group.ranks.index(self.rank)].clone()
