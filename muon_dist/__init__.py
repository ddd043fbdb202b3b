"""muon_dist: distributed Muon on DTensor / FSDP2 shards, checked bitwise against muon_ref.

Pieces (/work/shared/STYLE.md): layout (what a param is globally), plan (pure, digest-checked), paths (one
module per communication path; the kernel is muon_ref's, passed in), comm (the only place collectives run).
"""

from .comm import Comm, Group, ThreadComm, ThreadWorld, TorchComm
from .layout import ParamLayout, chunk_bounds, read_layout
from .optim import DistributedMuon, StepReport
from .plan import PATHS, Batch, Entry, Options, Plan, expected_bytes, plan

__all__ = [
    "PATHS", "Batch", "Comm", "DistributedMuon", "Entry", "Group", "Options", "ParamLayout", "Plan", "StepReport",
    "ThreadComm", "ThreadWorld", "TorchComm", "chunk_bounds", "expected_bytes", "plan", "read_layout",
]
