"""muon_dist: distributed Muon on DTensor / FSDP2 shards, checked bitwise against muon_ref.

The optimizer core (docs/design.md): layout (what a param is globally, read from its DTensor), geometry (its
shard groups and every member's box), plan (a pure, digest-checked function of the layouts: batches, paths,
owners), paths (one module per communication path, one interface), comm (the only place collectives run),
elementwise (shard stages with the reference's bits), kernels (orthogonalisation backends), step (the step as a
function) and optim (DistributedMuon, a thin optimizer over it); checkpoint converts state dicts. The checker
(verify, conformance, benchmarks' fixtures) is the package muon_check; nothing here imports it.
"""

from .batch import Batch
from .comm import Comm, Group, ThreadComm, ThreadWorld, TorchComm
from .geometry import Box, Geometry, chunk_bounds
from .layout import ParamLayout, read_layout
from .optim import DistributedMuon, StepReport
from .paths import PATHS
from .plan import (
    Entry,
    Options,
    Plan,
    buffer_bytes,
    expected_bytes,
    expected_collectives,
    expected_flops,
    plan,
)

__all__ = [
    "PATHS",
    "Batch",
    "Box",
    "Comm",
    "DistributedMuon",
    "Entry",
    "Geometry",
    "Group",
    "Options",
    "ParamLayout",
    "Plan",
    "StepReport",
    "ThreadComm",
    "ThreadWorld",
    "TorchComm",
    "buffer_bytes",
    "chunk_bounds",
    "expected_bytes",
    "expected_collectives",
    "expected_flops",
    "plan",
    "read_layout",
]
