"""The interface every communication path implements: one typed, frozen record per path (Path), declared at the
end of the path's module as PATH and registered in muon_dist.paths.PATHS.

A reader (or a type checker) follows PATHS[name] to the record and each field to the module's function. The
planner reads name, owners, check, global_dispatch, remainder and moves_directions; the step reads run / steps,
carries_flag and packed_directions; the accounting reads expected_bytes (traffic) and work (kernel calls). Each module's docstring states its reference
equation, its contract and its traffic formula (proofs/paths.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from ..batch import Batch, FailureFlag, Kernel
from ..comm import Comm, Group
from ..geometry import Box
from ..runtime import Steps


class Run(Protocol):
    """This member's box of every param's update, from its boxes of the directions (one kernel per param)."""

    def __call__(
        self,
        comm: Comm,
        group: Group,
        batch: Batch,
        directions: list[Tensor],
        kernels: list[Kernel],
    ) -> list[Tensor]: ...


class StepsRun(Protocol):
    """Run as Steps (muon_dist/runtime.py): it yields right after issuing each collective and returns what Run
    returns; `flag`, where given, travels in its last collective (carries_flag)."""

    def __call__(
        self,
        comm: Comm,
        group: Group,
        batch: Batch,
        directions: list[Tensor],
        kernels: list[Kernel],
        flag: FailureFlag | None = None,
    ) -> Steps: ...


class Owners(Protocol):
    """The member that orthogonalises each param of a batch of num_params (() when every member orthogonalises
    what it holds)."""

    def __call__(self, num_params: int, group_size: int) -> tuple[int, ...]: ...


class Check(Protocol):
    """The invariants of a batch on this path (asserts: the plan's own mistakes)."""

    def __call__(self, batch: Batch) -> None: ...


class ExpectedBytes(Protocol):
    """The member's (sent, received) bytes, the formula of the module's traffic paragraph; None when the member
    calls no collective. itemsizes: bytes per element of each dtype name."""

    def __call__(
        self, batch: Batch, member: int, itemsizes: Mapping[str, int]
    ) -> tuple[int, int] | None: ...


class Work(Protocol):
    """The kernel calls this member makes in a run of the batch: (k, box) for each call of kernel k on the whole
    blocks of batch param k inside `box` (k = 0 for a padding matrix, which runs param 0's kernel)."""

    def __call__(self, batch: Batch, member: int) -> tuple[tuple[int, Box], ...]: ...


@dataclass(frozen=True)
class Path:
    """name: the path's name in plans and reports; run (every path) and steps (pipelined paths: run as Steps by
    the step's pipeline, muon_dist/runtime.py); owners, check, expected_bytes, work as their Protocols say;
    collectives: the data collectives a batch calls on each member that calls any (one whose expected_bytes is
    not None), so a rank's count in a step is a function of the plan (muon_dist.plan.expected_collectives);
    global_dispatch: dispatch="global" merges its batches into global_all_to_all; remainder: it takes a batch of
    any size up to W (Options.remainder / force_path); carries_flag: steps(..., flag=) carries the write
    group's failure flag in its last collective (muon_dist/agreement.py); moves_directions: its collectives move
    directions (a batch's directions then travel in the entries' narrower send dtype, muon_dist/plan.py);
    packed_directions: in a shard group of more than one, steps(...) takes the directions as a Packed
    (muon_dist/batch.py), written by the step's momentum stage straight into the forward send buffer, and sends
    that buffer as it is."""

    name: str
    run: Run
    owners: Owners
    check: Check
    expected_bytes: ExpectedBytes
    work: Work
    collectives: int
    steps: StepsRun | None = None
    global_dispatch: bool = False
    remainder: bool = False
    carries_flag: bool = False
    moves_directions: bool = True
    packed_directions: bool = False

    def __post_init__(self) -> None:
        assert not self.carries_flag or self.steps is not None, (
            f"{self.name}: a flag travels in steps"
        )
        assert not self.packed_directions or self.steps is not None, (
            f"{self.name}: packed directions go to steps"
        )

    @property
    def pipelined(self) -> bool:
        """Whether the step runs it as Steps (steps), else as one call (run)."""
        return self.steps is not None
