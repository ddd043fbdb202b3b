"""One module per communication path, each with the same interface, registered here from the modules:

    NAME: str                        the path's name in plans and reports
    GLOBAL_DISPATCH: bool            dispatch="global" merges its batches into global_all_to_all
    REMAINDER: bool                  it takes a batch of any size up to W (Options.remainder / force_path)
    CARRIES_FLAG: bool               run(..., flag=FailureFlag) carries the write group's failure flag in its
                                     last collective (muon_dist/batch.py)
    MOVES_DIRECTIONS: bool           its collectives move directions (so a batch's directions travel in the
                                     entries' narrower send dtype, muon_dist/plan.py; else the param's dtype)
    PIPELINED: bool                  steps(comm, group, batch, directions, kernels, flag=None) -> Steps: run as a
                                     generator that yields right after issuing each collective (muon_dist/batch.py)
    owners(num_params, group_size)   the member that orthogonalises each param of a batch it takes (() when every
                                     member orthogonalises what it holds)
    check(batch)                     the invariants of a batch on this path (asserts: the plan's own mistakes)
    run(comm, group, batch, directions, kernels) -> updates
                                     this member's box of every param's update, from its boxes of the directions
    expected_bytes(batch, member, itemsizes) -> (sent, received) | None
                                     the member's traffic, the formula of the module's Traffic paragraph (None
                                     when the member calls no collective)

Each module's docstring states its reference equation and contract (proofs/paths.md). A new path is its module,
its line below, its proof section and its tests; the planner and the executor read only this interface.
"""

from types import ModuleType

from . import (
    agrs,
    all_to_all,
    blocks,
    global_all_to_all,
    local,
    padded_all_to_all,
    replicated,
    subgroup_all_gather,
)

PATHS: dict[str, ModuleType] = {
    m.NAME: m
    for m in (
        all_to_all,
        agrs,
        padded_all_to_all,
        replicated,
        local,
        subgroup_all_gather,
        global_all_to_all,
        blocks,
    )
}
