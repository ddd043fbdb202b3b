"""muon_ref: the single-device reference Muon (the oracle every other Muon in this repo is checked against).

Pure math on torch tensors; never imports torch.distributed.
"""

from .config import CONFIG_KEYS, LR_SCALE_ALIASES, MuonConfig, lr_scale
from .functional import (
    LAYOUT_DEFAULTS,
    Block,
    MatrixLayout,
    apply_update,
    map_blocks,
    matrix_layout,
    momentum_buffer,
    momentum_direction,
    muon_step,
    orthogonalize,
    read_block,
)
from .gram import DAO_RESTARTS, gram_newton_schulz, restart_segments
from .newton_schulz import NSOptions, newton_schulz, normalise, resolve_ns_options
from .optim import Muon
from .polar import (
    Band,
    critical_points,
    fixed_points,
    max_singular_value_error,
    normalised_singular_values,
    orthogonality_error,
    polar_error,
    polar_factor,
    scalar_map,
    schedule_band,
    signed_singular_values,
    step_image,
    step_polynomial,
)
from .presets import PRESETS
from .schedules import SCHEDULES, Schedule, get_schedule, register_schedule

__all__ = [
    "Band",
    "Block",
    "CONFIG_KEYS",
    "DAO_RESTARTS",
    "LAYOUT_DEFAULTS",
    "LR_SCALE_ALIASES",
    "MatrixLayout",
    "Muon",
    "MuonConfig",
    "NSOptions",
    "PRESETS",
    "SCHEDULES",
    "Schedule",
    "apply_update",
    "critical_points",
    "fixed_points",
    "get_schedule",
    "gram_newton_schulz",
    "lr_scale",
    "map_blocks",
    "matrix_layout",
    "max_singular_value_error",
    "momentum_buffer",
    "momentum_direction",
    "muon_step",
    "newton_schulz",
    "normalise",
    "normalised_singular_values",
    "orthogonality_error",
    "orthogonalize",
    "polar_error",
    "polar_factor",
    "read_block",
    "register_schedule",
    "resolve_ns_options",
    "restart_segments",
    "scalar_map",
    "schedule_band",
    "signed_singular_values",
    "step_image",
    "step_polynomial",
]
