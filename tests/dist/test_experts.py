"""Expert parallelism: MoE expert stacks (3-D [E, m, n] and fused [E * m, n] with num_experts) on a 1-D FSDP
mesh and on (ep, fsdp) meshes with (Shard(0), Shard(0)) equal muon_ref.Muon bitwise, per expert, on every
path (local, subgroup_all_gather, the all-to-all fallback); the path is the one the boxes call for; every
mesh shape of one model gives the same parameters; bytes are EP-local; mistakes raise on every rank.

Byte formulas (b: bytes per element of the gradient, fp32 here; R: params of the batch):
  local:                no collective at all.
  subgroup_all_gather:  E_local = E / ep experts per EP rank, k = fsdp / E_local members per expert, each box
                        (m / k) n elements: every member sends and receives (k - 1) R (m / k) n b, whatever E
                        (xtuner's open OOM bug sized these buffers from the global E * m).
  fallback:             the all-to-all family over all ep * fsdp members with their nested boxes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_check.fixtures import same_bits
from muon_dist import Entry, Group, Options, ThreadComm, ThreadWorld, expected_bytes, plan
from muon_dist.comm import run_threads
from muon_dist.paths import PATHS
from muon_ref.presets import PRESETS
from tests.conftest import examples

from .batches import box, layout_ep
from .checks import run_case, run_unchecked, timeout_for
from .conftest import get_pool
from .workers import Case, bad_expert_step, subgroup_cache_probe

MESHES = [(ep, fsdp) for ep in (1, 2, 4) for fsdp in (1, 2, 4) if ep * fsdp <= 8]
FP32 = (("ns_dtype", None),)


def expert_case(
    E: int, m: int, n: int, fused: bool, ep: int, fsdp: int, count: int = 1, **kwargs
) -> tuple[int, Case]:
    """(world size, Case): `count` expert stacks of E experts (m, n) on an (ep, fsdp) mesh ("fsdp" when ep == 1
    and kwargs ask for it)."""
    shape = (E * m, n) if fused else (E, m, n)
    overrides = (("num_experts", E),) if fused else ()
    mesh = kwargs.pop("mesh", f"ep{ep}")
    return ep * fsdp, Case(
        (shape,) * count,
        ("S0",) * count,
        mesh=mesh,
        overrides=overrides + kwargs.pop("overrides", ()),
        **kwargs,
    )


def textbook_path(E: int, m: int, fused: bool, ep: int, fsdp: int) -> str | None:
    """The three cases of the field (distributed_paths.md), where they apply: None outside them."""
    if not fused:
        return "local"  # Shard(0) of a 3-D stack cuts between experts only
    if E % ep:
        return None
    E_local = E // ep
    if E_local % fsdp == 0:
        return "local"
    if fsdp % E_local == 0 and m % (fsdp // E_local) == 0:
        return "subgroup_all_gather"
    return None


@st.composite
def models(draw, mesh: tuple[int, int] = (1, 1)) -> dict:
    """E in 1..16, m in 1..8, n in 1..6; half the draws aim at the subgroup case on `mesh` (E = E_local * ep with
    E_local dividing fsdp, m a multiple of fsdp / E_local), which uniform draws rarely give."""
    ep, fsdp = mesh
    if draw(st.booleans()):
        E, m = draw(st.integers(1, 16)), draw(st.integers(1, 6))
    else:
        E_local = draw(st.sampled_from([d for d in (1, 2, 4) if fsdp % d == 0 and d * ep <= 16]))
        E, m = E_local * ep, fsdp // E_local * draw(st.integers(1, 2))
    return dict(
        E=E,
        m=m,
        n=draw(st.integers(1, 6)),
        fused=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        preset=draw(st.sampled_from(sorted(PRESETS))),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def placed_models(draw) -> tuple[dict, tuple[int, int]]:
    mesh = draw(st.sampled_from(MESHES))
    return draw(models(mesh)), mesh


@pytest.mark.timeout(timeout_for(60))
@example(
    drawn=(dict(E=4, m=4, n=3, fused=True, dtype="float32", preset="torch", seed=0), (2, 4)),
    count=2,
    one_d=False,
)  # subgroup_all_gather: E_local = 2 on fsdp = 4
@example(
    drawn=(dict(E=3, m=2, n=5, fused=True, dtype="bfloat16", preset="torch", seed=0), (2, 1)),
    count=1,
    one_d=False,
)  # E % ep != 0: an expert cut between two EP ranks
@example(
    drawn=(dict(E=5, m=3, n=2, fused=False, dtype="bfloat16", preset="keller", seed=0), (2, 4)),
    count=3,
    one_d=False,
)  # 3 and 2 experts per EP block on 4 FSDP ranks: empty boxes
@example(
    drawn=(dict(E=6, m=2, n=3, fused=True, dtype="float32", preset="torch", seed=0), (2, 2)),
    count=4,
    one_d=False,
)  # the all-to-all fallback
@settings(max_examples=examples(1.0))
@given(drawn=placed_models(), count=st.integers(1, 3), one_d=st.booleans())
def test_every_expert_equals_reference_bitwise_on_the_path_its_boxes_call_for(
    drawn: tuple[dict, tuple[int, int]], count: int, one_d: bool
) -> None:
    model, (ep, fsdp) = drawn
    W, case = expert_case(
        model["E"],
        model["m"],
        model["n"],
        model["fused"],
        ep,
        fsdp,
        count,
        mesh="fsdp" if ep == 1 and one_d else f"ep{ep}",
        dtype=model["dtype"],
        preset=model["preset"],
        seed=model["seed"],
    )
    results = run_case(W, case)  # bits of params and buffers, the planned paths, the planned bytes
    want = textbook_path(model["E"], model["m"], model["fused"], ep, fsdp)
    if want is not None:
        assert {p for _, p in results[0]["paths"]} == {want}, (results[0]["paths"], want)


@pytest.mark.timeout(timeout_for(60))
@settings(max_examples=examples(0.1))
@given(model=models(mesh=(2, 4)))  # half the models split experts on the largest mesh
def test_every_mesh_shape_gives_the_same_parameters(model: dict) -> None:
    finals = {}
    for ep, fsdp in MESHES:
        W, case = expert_case(
            model["E"],
            model["m"],
            model["n"],
            model["fused"],
            ep,
            fsdp,
            dtype=model["dtype"],
            preset=model["preset"],
            seed=model["seed"],
        )
        finals[(ep, fsdp)] = torch.cat(
            [r["params"][0] for r in run_case(W, case)]
        )  # nested chunks: rank order
    for mesh, got in finals.items():
        assert same_bits(got, finals[(1, 1)]), f"mesh (ep, fsdp) = {mesh} and (1, 1) differ"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "E, m, want", [(1, 4, "subgroup_all_gather"), (2, 2, "local"), (3, 2, "agrs")]
)
def test_hsdp_rows_run_the_expert_paths_each_in_its_own_sub_groups(
    E: int, m: int, want: str
) -> None:
    """(Replicate, Shard(0)) on 2 x 2: each replica row is a shard group of 2; its sub-groups are its own."""
    results = run_case(
        4,
        Case(
            ((E * m, 3),),
            ("S0",),
            mesh="hsdp",
            overrides=(("num_experts", E),),
            options=(("dispatch", "batched"),),
        ),
    )  # the fallback: agrs when batched
    assert {p for _, p in results[0]["paths"]} == {want}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "E, ep, fsdp, m, n, count",
    [
        (1, 1, 4, 8, 3, 1),  # one expert over 4 ranks: k = 4
        (2, 2, 2, 4, 5, 2),  # E_local = 1, k = 2
        (4, 2, 4, 4, 3, 2),  # E_local = 2, k = 2, W = 8
        (4, 4, 2, 6, 2, 3),  # E_local = 1, k = 2, W = 8
    ],
)
def test_subgroup_all_gather_moves_the_ep_local_boxes_only(
    E: int, ep: int, fsdp: int, m: int, n: int, count: int
) -> None:
    W, case = expert_case(E, m, n, True, ep, fsdp, count, overrides=FP32)
    k = fsdp // (E // ep)
    for r in run_case(W, case):
        assert r["bytes"]["subgroup_all_gather"] == ((k - 1) * count * (m // k) * n * 4,) * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "E, ep, fsdp, fused", [(4, 2, 2, True), (8, 2, 4, False), (3, 1, 4, False)]
)
def test_local_experts_move_no_bytes(E: int, ep: int, fsdp: int, fused: bool) -> None:
    W, case = expert_case(E, 2, 3, fused, ep, fsdp, 2)
    for r in run_case(W, case):
        assert {p for _, p in r["paths"]} == {"local"}
        assert set(r["bytes"]) == {"plan_digest", "failure_check"}, r[
            "bytes"
        ]  # the step's checks only


@pytest.mark.timeout(60)
def test_fallback_moves_the_all_to_all_of_the_nested_boxes() -> None:
    """E = 6 experts of 2 rows on (ep 2, fsdp 2): boxes of 3 rows cut expert 1 (and 4) between two members;
    4 stacks on the 4 members take the all-to-all: each member sends (W - 1) boxes and receives as many, and
    the same back. Box: 3 n elements, from E_local = 3 experts per EP rank (never E * m = 12 rows)."""
    n = 3
    # batches of W (batched dispatch): every member owns one stack
    W, case = expert_case(
        6, 2, n, True, 2, 2, 4, overrides=FP32, options=(("dispatch", "batched"),)
    )
    box = 3 * n
    for r in run_case(W, case):
        assert r["bytes"]["all_to_all"] == (2 * (W - 1) * box * 4,) * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "sabotage, E, m, fused, ep, fsdp",
    [
        (
            "wrong_slice",
            2,
            4,
            True,
            1,
            4,
        ),  # each member keeps its mirror's rows of the gathered expert
        (
            "bundle_ns",
            4,
            3,
            False,
            1,
            2,
        ),  # two experts per rank orthogonalised as one (2 m, n) matrix
    ],
    ids=["wrong_slice", "bundle_ns"],
)
def test_a_broken_expert_path_fails_the_equality_check(
    sabotage: str, E: int, m: int, fused: bool, ep: int, fsdp: int
) -> None:
    W, case = expert_case(E, m, 3, fused, ep, fsdp, 1, sabotage=sabotage)
    results = run_unchecked(W, case)
    want = "subgroup_all_gather" if sabotage == "wrong_slice" else "local"
    assert {p for _, p in results[0]["paths"]} == {want}
    assert any(r["differing"] for r in results), (
        "the sabotaged step still equals muon_ref: the check is blind"
    )


@pytest.mark.timeout(60)
def test_sub_groups_are_created_once_per_rank_layout_and_reused_by_a_new_mesh_object() -> None:
    """2 experts of 4 rows on (ep 2, fsdp 2): one sub-group per expert, made at the first step; a second
    DeviceMesh of the same ranks (a new Python object) reuses them (a cache keyed on id(mesh) would not)."""
    for r in get_pool(4).run(subgroup_cache_probe, timeout=30):
        assert r["paths"] == ["subgroup_all_gather"] * 2, r
        # 2 partitions: the flattened (ep, fsdp) group ((0, 1, 2, 3),) and the experts' ((0, 1), (2, 3));
        # [0, 0] when an earlier test on this pool made the same partitions (any mesh with these ranks)
        assert r["counts"] in ([2, 2], [0, 0]), r
        assert r["subgroup_calls"] == 2 and r["distinct_groups"] == 1, r


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind, message",
    [
        ("num_experts_does_not_divide_rows", "num_experts=3 does not divide 8 rows"),
        ("num_experts_differs_on_one_rank", "disagree with rank 0 on the step's plan"),
    ],
)
def test_expert_mistakes_raise_on_every_rank(kind: str, message: str) -> None:
    errors = get_pool(4).run(bad_expert_step, kind, timeout=30)
    assert all(message in e for e in errors), errors


def _labelled_kernel(calls: list, matrix: tuple[int, int]):
    """Records its input's number of experts; maps each expert X to 2 X + its first element (per expert, so a
    kernel fed a wrong or partial expert gives other values)."""

    def kernel(x: torch.Tensor, frame=None) -> torch.Tensor:
        experts = x.reshape(-1, *matrix)
        calls.append(experts.shape[0])
        return (2 * experts + experts[:, :1, :1]).reshape(x.shape)

    return kernel


@pytest.mark.timeout(timeout_for(30))
@settings(max_examples=examples(5.0))
@given(drawn=placed_models(), count=st.integers(1, 3))
def test_expert_paths_on_threads_give_each_rank_its_box_of_the_per_expert_kernel(
    drawn: tuple, count: int
) -> None:
    """ThreadComm, float64 labels: every path the plan picks returns box_r(kernel(full)) on every rank r, and
    its bytes are the plan's; local and subgroup ranks feed the kernel whole experts only."""
    model, (ep, fsdp) = drawn
    E, m, n, W = model["E"], model["m"], model["n"], ep * fsdp
    shape, num_experts = ((E * m, n), E) if model["fused"] else ((E, m, n), None)
    fulls = [
        torch.arange(k * E * m * n, (k + 1) * E * m * n, dtype=torch.float64).reshape(shape) + 1
        for k in range(count)
    ]
    world, results = ThreadWorld(W, timeout_s=20), [None] * W

    layout = layout_ep(shape, ep, fsdp, "torch.float64", num_experts)

    def rank_main(rank: int) -> None:
        comm, calls = ThreadComm(world, rank), []
        step_plan = plan(tuple(Entry(layout, 0, "torch.float64", True) for _ in fulls), Options())
        boxes = [box(f, layout, rank) for f in fulls]
        kernel = _labelled_kernel(calls, (m, n))
        ups = []
        for b in step_plan.batches:
            ups += PATHS[b.path].run(
                comm,
                Group(layout.geometry.group_of(rank)),
                b,
                [boxes[i] for i in b.params],
                [kernel] * len(b.params),
            )
        results[rank] = (
            rank,
            ups,
            dict(comm.ledger),
            expected_bytes(step_plan, rank, {"torch.float64": 8}),
            step_plan.batches[0].path,
            calls,
        )

    run_threads(W, rank_main)
    reference = _labelled_kernel([], (m, n))
    for rank, ups, ledger, want_bytes, path, calls in results:
        local_rows = box(fulls[0], layout, rank).shape[0]
        for got, full in zip(ups, fulls):
            want = box(reference(full), layout, rank)
            assert torch.equal(got, want), (path, layout, rank)
        assert {k: tuple(v) for k, v in ledger.items()} == want_bytes, (path, ledger, want_bytes)
        if path in ("local", "subgroup_all_gather"):
            unit = m if model["fused"] else 1
            assert all(c * unit <= max(local_rows, unit) for c in calls), (path, calls, layout)
