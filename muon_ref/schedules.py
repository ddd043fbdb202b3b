"""Newton-Schulz coefficient schedules, pinned literally as published, with provenance.

A schedule is a list of quintic steps p_t(x) = a_t x + b_t x^3 + c_t x^5. Step t of a run of k steps
uses the coefficients chosen by the schedule's step policy:
    "cycle":       coefficients[t % L]           (constant schedules; Emerging-Optimizers' rule for sets)
    "repeat_last": coefficients[min(t, L - 1)]   (Polar Express, CANS, DeepSeek-V4)
    "fixed":       k must equal L                 (schedules tuned for exactly L steps)
Normalisation recommended by the origin (safety factor, eps) and the AOL preconditioner travel with the
schedule, so `newton_schulz(G, "polar_express")` reproduces the shipped pipeline.

References: docs/schedules.md (catalogue); each entry's `source` names its origin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Coefficients = tuple[float, float, float]
StepPolicy = Literal["cycle", "repeat_last", "fixed"]


@dataclass(frozen=True)
class Schedule:
    """A Newton-Schulz schedule.

    Invariants (checked in __post_init__): at least one step; every step is a triple of finite floats;
    default_steps >= 1 and, for policy "fixed", equal to the number of listed steps.
    """

    name: str
    coefficients: tuple[Coefficients, ...]
    source: str
    policy: StepPolicy
    default_steps: int
    safety: float = 1.0  # X / (||X||_F * safety + eps): origin's prescale of the input
    eps: float | None = None  # origin's normalisation eps (None: the caller's)
    precondition: Literal["aol"] | None = None  # replaces Frobenius normalisation when set
    design_lower_bound: float | None = None  # l of the interval [l, 1] the schedule was tuned for
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.coefficients:
            raise ValueError(f"schedule {self.name!r}: no coefficients")
        for t, step in enumerate(self.coefficients):
            if len(step) != 3 or not all(isinstance(v, float) for v in step):
                raise ValueError(
                    f"schedule {self.name!r}: step {t} must be three floats, got {step!r}"
                )
        if self.policy not in ("cycle", "repeat_last", "fixed"):
            raise ValueError(f"schedule {self.name!r}: unknown policy {self.policy!r}")
        if self.default_steps < 1:
            raise ValueError(f"schedule {self.name!r}: default_steps must be >= 1")
        if self.policy == "fixed" and self.default_steps != len(self.coefficients):
            raise ValueError(
                f"schedule {self.name!r}: a fixed schedule runs exactly its {len(self.coefficients)} steps"
            )

    def steps_for(self, steps: int | None = None) -> tuple[Coefficients, ...]:
        """The coefficients of each of `steps` steps (default: default_steps) under the step policy."""
        k = self.default_steps if steps is None else steps
        if k < 0:
            raise ValueError(f"steps must be >= 0, got {k}")
        L = len(self.coefficients)
        if self.policy == "fixed" and k != L:
            raise ValueError(
                f"schedule {self.name!r} is tuned for exactly {L} steps, got steps={k}"
            )
        if self.policy == "cycle":
            return tuple(self.coefficients[t % L] for t in range(k))
        return tuple(self.coefficients[min(t, L - 1)] for t in range(k))

    @property
    def matmuls_per_step(self) -> int:
        """Matrix products per step: A = X X^T, A @ A (skipped when c == 0 in exact arithmetic), B @ X."""
        return 3


def _scaled(steps: list[Coefficients], factor: float, upto: int) -> tuple[Coefficients, ...]:
    """Evaluate each of the first `upto` polynomials at x / factor: (a/f, b/f^3, c/f^5), as shipped."""
    return tuple(
        (a / factor, b / factor**3, c / factor**5) if t < upto else (a, b, c)
        for t, (a, b, c) in enumerate(steps)
    )


# Amsel, Persson, Musco, Gower, "The Polar Express", arXiv 2505.16932; NoahAmsel/PolarExpress basic.py
_POLAR_EXPRESS_PAPER: list[Coefficients] = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]

_KELLER: Coefficients = (3.4445, -4.7750, 2.0315)

_ALL: list[Schedule] = [
    Schedule(
        name="cubic",
        coefficients=((1.5, -0.5, 0.0),),
        source="classical Newton-Schulz; Higham, Functions of Matrices (2008), ch. 8",
        policy="cycle",
        default_steps=10,
        notes="default_steps=10 is this repo's choice; converges to 1 on (0, sqrt(3)) but slowly near 0",
    ),
    Schedule(
        name="quintic",
        coefficients=((15 / 8, -10 / 8, 3 / 8),),
        source="classical quintic Newton-Schulz; also the limit polynomial of Polar Express",
        policy="cycle",
        default_steps=8,
        notes="default_steps=8 is this repo's choice",
    ),
    Schedule(
        name="keller",
        coefficients=(_KELLER,),
        source="KellerJordan/Muon muon.py; torch.optim.Muon (torch/optim/_muon.py); Moonlight examples/toy_train.py",
        policy="cycle",
        default_steps=5,
    ),
    Schedule(
        name="you5",
        coefficients=(
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        ),
        source=(
            "YouJiacheng, x.com/YouJiacheng/status/1905861218138804534; modded-nanogpt train_gpt_medium.py; "
            "microsoft/dion dion/muon.py; InternLM/xtuner xtuner/v1/optim/muon.py; "
            "NVIDIA-NeMo/Emerging-Optimizers muon_utils.py ('quintic')"
        ),
        policy="cycle",
        default_steps=5,
    ),
    Schedule(
        name="you6",
        coefficients=tuple(
            (a / 1024, b / 1024, c / 1024)
            for a, b, c in [
                (3955.0, -8306.0, 5008.0),
                (3735.0, -6681.0, 3463.0),
                (3799.0, -6499.0, 3211.0),
                (4019.0, -6385.0, 2906.0),
                (2677.0, -3029.0, 1162.0),
                (2172.0, -1833.0, 682.0),
            ]
        ),
        source="YouJiacheng, twitter.com/YouJiacheng/status/1893704552689303901 (exact in bf16: all /1024)",
        policy="cycle",
        default_steps=6,
    ),
    Schedule(
        name="polar_express_paper",
        coefficients=tuple(_POLAR_EXPRESS_PAPER),
        source="Amsel et al., The Polar Express, arXiv 2505.16932; NoahAmsel/PolarExpress polar_express/basic.py",
        policy="repeat_last",
        default_steps=8,
        design_lower_bound=1e-3,
        notes="unmodified: no safety factor; overshoots in bf16",
    ),
    Schedule(
        name="polar_express",
        coefficients=_scaled(_POLAR_EXPRESS_PAPER, 1.01, upto=len(_POLAR_EXPRESS_PAPER) - 1),
        source="NoahAmsel/PolarExpress polar_express/basic.py (as shipped: safety 1.01 on all but the last step)",
        policy="repeat_last",
        default_steps=8,
        safety=1.01,
        eps=1e-7,
        design_lower_bound=1e-3,
    ),
    Schedule(
        name="polar_express_nemo",
        coefficients=(
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        source="NVIDIA-NeMo/Emerging-Optimizers muon_utils.py 'polar_express' (PR #74)",
        policy="repeat_last",
        default_steps=8,
    ),
    Schedule(
        name="polar_express_modded",
        coefficients=(
            (8.156554524902461, -22.48329292557795, 15.878769915207462),
            (4.042929935166739, -2.808917465908714, 0.5000178451051316),
            (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
            (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
            (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        ),
        source="KellerJordan/modded-nanogpt train_gpt.py; microsoft/dion polar_express (l=1e-3, cushion 0.02)",
        policy="fixed",
        default_steps=5,
        safety=1.02,
        eps=1e-6,
        design_lower_bound=1e-3,
    ),
    Schedule(
        name="polar_express_dao",
        coefficients=_scaled(_POLAR_EXPRESS_PAPER[:5], 1.05, upto=5),
        source="Dao-AILab/gram-newton-schulz coefficients.py (first 5 paper steps, safety 1.05)",
        policy="fixed",
        default_steps=5,
        design_lower_bound=1e-3,
    ),
    Schedule(
        name="cans",
        coefficients=(
            (8.4703, -25.1081, 18.6293),
            (4.1828, -3.1087, 0.5806),
            (3.9619, -2.9541, 0.5630),
            (3.2866, -2.4647, 0.5074),
            (2.2737, -1.6447, 0.4162),
        ),
        source="Grishina, Smirnov, Rakhuba, arXiv 2506.10935 (CANS), as shipped in Emerging-Optimizers",
        policy="repeat_last",
        default_steps=5,
        notes="no safety factor: overshoots in bf16",
    ),
    Schedule(
        name="aol_old",
        coefficients=(
            (4.0098, -7.0585, 2.4635),
            (3.4585, -5.5479, 2.5959),
            (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169),
        ),
        source="thib-s/flash-newton-schulz before 2025-09-22; Emerging-Optimizers muon_utils.py 'aol'",
        policy="cycle",
        default_steps=4,
        notes="designed for AOL-preconditioned inputs; with Frobenius normalisation p_1(1) = -0.585 flips signs",
    ),
    Schedule(
        name="aol",
        coefficients=(
            (4.6051, -9.6552, 5.6769),
            (4.7505, -6.0861, 2.1790),
            (2.7763, -2.3190, 0.5523),
            (2.4231, -2.2861, 0.8193),
        ),
        source="thib-s/flash-newton-schulz newton_schulz_triton.py (2025-09-22, Turbo-Muon); modded-nanogpt 2025-11-11",
        policy="fixed",
        default_steps=4,
        precondition="aol",
    ),
    Schedule(
        name="deepseekv4",
        coefficients=(_KELLER,) * 8 + ((2.0, -1.5, 0.5),) * 2,
        source="DeepSeek-V4 report, as shipped in Emerging-Optimizers",
        policy="repeat_last",
        default_steps=10,
    ),
    Schedule(
        name="cubic5",
        coefficients=(
            (3.3656576, -3.3420992, 0.0),
            (2.5744352, -1.4957376, 0.0),
            (2.5368962, -1.4312570, 0.0),
            (2.4418906, -1.2764040, 0.0),
            (2.2230472, -0.9630650, 0.0),
        ),
        source="Hua Huang, How Much Orthogonalization Does Muon Need?, arXiv 2606.00371",
        policy="fixed",
        default_steps=5,
        design_lower_bound=7e-3,
    ),
]

SCHEDULES: dict[str, Schedule] = {s.name: s for s in _ALL}


def register_schedule(schedule: Schedule, *, overwrite: bool = False) -> Schedule:
    """Add a schedule to SCHEDULES so that every API taking a schedule name accepts it."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    if schedule.name in SCHEDULES and not overwrite and SCHEDULES[schedule.name] != schedule:
        raise ValueError(
            f"a different schedule named {schedule.name!r} is registered; pass overwrite=True"
        )
    SCHEDULES[schedule.name] = schedule
    return schedule


def get_schedule(schedule: str | Schedule) -> Schedule:
    """Resolve a schedule name (or pass a Schedule through)."""
    if isinstance(schedule, Schedule):
        return schedule
    try:
        return SCHEDULES[schedule]
    except KeyError:
        raise ValueError(f"unknown schedule {schedule!r}; known: {sorted(SCHEDULES)}") from None
