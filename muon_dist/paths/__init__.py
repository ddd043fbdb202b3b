"""The communication paths, one module each, registered here: PATHS maps a path's name to its record (Path,
muon_dist/paths/interface.py: the interface every path implements, declared once), which each module declares
at its end as PATH.

Each module's docstring states its reference equation, contract and traffic (proofs/paths.md). A new path is its
module with its PATH, its line below, its proof section and its tests; the planner and the step read only the
record.
"""

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
from .interface import Path

PATHS: dict[str, Path] = {
    path.name: path
    for path in (
        all_to_all.PATH,
        agrs.PATH,
        padded_all_to_all.PATH,
        replicated.PATH,
        local.PATH,
        subgroup_all_gather.PATH,
        global_all_to_all.PATH,
        blocks.PATH,
    )
}

__all__ = ["PATHS", "Path"]
