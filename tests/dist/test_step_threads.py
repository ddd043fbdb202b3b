"""The whole step (muon_dist/step.py: agree, non-finite check, momentum, paths, failure check, write) on ranks as
threads of one process (ThreadComm), against muon_ref.Muon on the full tensors.

Equation (muon_dist/step.py): on every rank r, for every param that steps,
    new_param == box_r(muon_ref's P'),   new_buf == box_r(muon_ref's M')
bit for bit, over 1-D, HSDP and (ep, fsdp) meshes, every placement code, the layout keys (3-D stacks, fused
experts, split_sizes, num_heads on either dim), the plan's options and write groups; and each rank's ledger is
the plan's bytes (muon_dist.expected_bytes) beside the step's checks. tests/dist/test_equivalence.py
checks the same equation through DistributedMuon on gloo ranks; here an example costs milliseconds, not seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import muon_ref
from muon_check.fixtures import same_bits, seeded
from muon_dist import Entry, Options, ParamLayout, ThreadComm, ThreadWorld, expected_bytes
from muon_dist.agreement import CHECKS
from muon_dist.comm import run_threads
from muon_dist.kernels import Backend, backend, with_kernels
from muon_dist.optim import UPDATE_LAYOUT
from muon_dist.step import ParamInput, execute, prepare
from muon_ref.optim import group_config
from muon_ref.presets import PRESETS, preset_defaults
from tests.conftest import examples

from .checks import timeout_for

KINDS = ("matrix", "stack", "experts", "split", "heads")
ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}


@dataclass(frozen=True)
class Group:
    """A param group: its layout keys and its params' shapes and placement codes (one per mesh axis)."""

    keys: tuple[tuple[str, object], ...]
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Case:
    world_size: int
    mesh: tuple  # global ranks, nested as the mesh
    groups: tuple[Group, ...]
    dtype: str
    preset: str
    options: Options
    atomic: bool
    no_grad: tuple[int, ...] = ()  # params (in param-group order) without a gradient in step 1
    nonfinite: tuple[int, int] | None = None  # (param, flat index) of a NaN in step 0's gradient
    policy: str = "raise"

    def layouts(self) -> list[tuple[int, ParamLayout]]:
        """(group index, layout) of every param, in param-group order."""
        out = []
        for gi, group in enumerate(self.groups):
            keys = dict(group.keys)
            for shape, codes in zip(group.shapes, group.placements):
                out.append(
                    (
                        gi,
                        ParamLayout(
                            f"p{len(out)}",
                            shape,
                            f"torch.{self.dtype}",
                            self.mesh,
                            codes,
                            num_experts=keys.get("num_experts"),
                            split_sizes=keys.get("split_sizes"),
                            num_heads=keys.get("num_heads"),
                            split_dim=keys.get("split_dim", 0),
                        ),
                    )
                )
        return out


@st.composite
def groups(draw, W: int, axes: str) -> Group:
    """A group of one kind (KINDS) with up to W + 1 params of one shape, some of another shape."""
    kind = draw(st.sampled_from(KINDS))
    small = st.integers(1, 2 * W + 2)
    keys: dict[str, object] = {}
    if kind == "matrix":
        shape = (draw(small), draw(small))
    elif kind == "stack":
        shape = (draw(st.integers(1, 2 * W)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    elif kind == "experts":
        keys["num_experts"] = draw(st.integers(1, 4))
        shape = (keys["num_experts"] * draw(st.integers(1, 4)), draw(st.integers(1, 5)))
    elif kind == "split":
        keys["split_sizes"] = tuple(draw(st.lists(st.integers(1, W + 1), min_size=1, max_size=3)))
        shape = (sum(keys["split_sizes"]), draw(small))
    else:
        keys["num_heads"], keys["split_dim"] = draw(st.integers(1, 3)), draw(st.integers(0, 1))
        shape = [draw(small), draw(small)]
        shape[keys["split_dim"]] *= keys["num_heads"]
        shape = tuple(shape)
    count = draw(st.integers(1, W + 1))
    shapes = [shape] * count
    if kind == "matrix" and draw(st.booleans()):  # another layout in the same group
        shapes.insert(draw(st.integers(0, count)), (draw(small), draw(small)))
    ndim = len(shape)
    if axes == "1d":
        code = st.sampled_from(["R"] + [f"S{d}" for d in range(ndim)]).map(lambda c: (c,))
    elif axes == "hsdp":
        code = st.sampled_from([f"S{d}" for d in range(ndim)]).map(lambda c: ("R", c))
    else:  # (ep, fsdp): both axes cut the same dim, left to right
        code = st.sampled_from([f"S{d}" for d in range(ndim)]).map(lambda c: (c, c))
    return Group(tuple(sorted(keys.items())), tuple(shapes), tuple(draw(code) for _ in shapes))


@st.composite
def cases(draw) -> Case:
    W = draw(st.integers(1, 6))
    axes = draw(st.sampled_from(["1d", "hsdp", "ep"] if W % 2 == 0 else ["1d"]))
    if axes == "1d":
        mesh: tuple = tuple(range(W))
    else:
        mesh = tuple(tuple(range(i * W // 2, (i + 1) * W // 2)) for i in range(2))
    drawn = tuple(draw(groups(W, axes)) for _ in range(draw(st.integers(1, 3))))
    dispatch = draw(st.sampled_from(["batched", "global"]))
    force = (
        draw(st.sampled_from([None, "agrs", "padded_all_to_all"]))
        if dispatch == "batched"
        else None
    )
    options = Options(draw(st.sampled_from(["agrs", "padded_all_to_all"])), force, dispatch)
    num_params = sum(len(g.shapes) for g in drawn)
    no_grad = tuple(draw(st.sets(st.integers(0, num_params - 1), max_size=2)))
    return Case(
        W,
        mesh,
        drawn,
        draw(st.sampled_from(["float32", "bfloat16"])),
        draw(st.sampled_from(sorted(PRESETS))),
        options,
        draw(st.booleans()),
        no_grad,
    )


def param_groups(case: Case, params: list[torch.Tensor]) -> list[dict]:
    out, start = [], 0
    for group in case.groups:
        out.append({"params": params[start : start + len(group.shapes)], **dict(group.keys)})
        start += len(group.shapes)
    return out


def gradients(case: Case, step: int) -> list[torch.Tensor | None]:
    grads = []
    for i, (_, layout) in enumerate(case.layouts()):
        g = seeded(layout.global_shape, 1000 * step + i + 1, case.dtype)
        if step == 0 and case.nonfinite is not None and case.nonfinite[0] == i:
            g.view(-1)[case.nonfinite[1] % g.numel()] = float("nan")
        grads.append(None if step == 1 and i in case.no_grad else g)
    return grads


def initial_params(case: Case) -> list[torch.Tensor]:
    return [
        seeded(layout.global_shape, 7919 + i, case.dtype)
        for i, (_, layout) in enumerate(case.layouts())
    ]


def reference(case: Case, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """muon_ref.Muon on the full tensors: (params, momentum buffers) after `steps` steps."""
    params = initial_params(case)
    opt = muon_ref.Muon(
        param_groups(case, params),
        preset=case.preset,
        nonfinite=case.policy,
        update_layout=UPDATE_LAYOUT,
    )
    for step in range(steps):
        for p, g in zip(params, gradients(case, step)):
            p.grad = g
        opt.step()
    return params, [
        opt.state[p]["momentum_buffer"] if p in opt.state else torch.zeros_like(p) for p in params
    ]


def box(t: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    geometry = layout.geometry
    return t[geometry.boxes[geometry.member(rank)].index].contiguous()


def configs_of(case: Case) -> list:
    """Each param group's MuonConfig: the case's preset with its non-finite policy."""
    return [
        group_config(preset_defaults(case.preset, {"nonfinite": case.policy})) for _ in case.groups
    ]


def on_threads(
    case: Case, steps: int, kernels: Backend | None = None, in_place: bool = False
) -> list[object]:
    """Every rank's (params, buffers) after `steps` steps of prepare + execute on its boxes, or the exception it
    raised. in_place: execute writes each new param into the rank's param tensor (out_params), as DistributedMuon
    has it do, and yields that tensor; the tensors are the ones the rank started with."""
    layouts = case.layouts()
    configs = configs_of(case)
    world, results = ThreadWorld(case.world_size, timeout_s=10), [None] * case.world_size

    def rank_main(rank: int) -> None:
        comm = ThreadComm(world, rank)
        params = [box(p, lay, rank) for p, (_, lay) in zip(initial_params(case), layouts)]
        own = list(params)
        bufs = [torch.zeros_like(p) for p in params]
        try:
            for step in range(steps):
                grads = [
                    None if g is None else box(g, lay, rank)
                    for g, (_, lay) in zip(gradients(case, step), layouts)
                ]
                entries = tuple(
                    Entry(lay, gi, str(configs[gi].ns_dtype or lay.dtype), g is not None)
                    for (gi, lay), g in zip(layouts, grads)
                )
                inputs = [ParamInput(p, g, b) for p, g, b in zip(params, grads, bufs)]
                per_param = [configs[gi] for gi, _ in layouts]
                comm.reset()
                step_plan, skipped = prepare(comm, entries, inputs, per_param, case.options)
                for i, new, buf in execute(
                    comm,
                    step_plan,
                    inputs,
                    per_param,
                    kernels or backend("torch"),
                    lambda batch: comm.group(batch.geometries[0].group_of(rank)),
                    case.atomic,
                    skipped,
                    out_params=own if in_place else None,
                ):
                    assert not in_place or new is own[i], (rank, i)
                    params[i], bufs[i] = new, buf
                moved = {k: tuple(v) for k, v in comm.ledger.items() if k not in CHECKS}
                assert moved == expected_bytes(step_plan, rank, ITEMSIZES), (
                    rank,
                    moved,
                )  # bytes as planned
            results[rank] = (params, bufs)
        except Exception as e:  # noqa: BLE001 - every rank's error is compared by the test
            results[rank] = e

    run_threads(case.world_size, rank_main)
    return results


def assert_boxes_of_reference(case: Case, results: list[object], steps: int) -> None:
    want_params, want_bufs = reference(case, steps)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), (rank, result)
        params, bufs = result
        for i, (_, lay) in enumerate(case.layouts()):
            assert same_bits(params[i], box(want_params[i], lay, rank)), (rank, i, lay)
            assert same_bits(bufs[i], box(want_bufs[i], lay, rank)), (rank, i, lay)


MATRIX = Group((), ((5, 3),) * 3 + ((3, 9),), (("S0",),) * 3 + (("S1",),))


@pytest.mark.timeout(timeout_for(120))
@example(
    case=Case(4, (0, 1, 2, 3), (MATRIX,), "float32", "torch", Options(), False, (1,))
)  # an empty box
@example(
    case=Case(
        4,
        ((0, 1), (2, 3)),
        (Group((("num_experts", 4),), ((8, 3),) * 2, (("S0", "S0"),) * 2),),
        "bfloat16",
        "xtuner",
        Options(),
        False,
    )
)  # local experts on (ep, fsdp)
@example(
    case=Case(
        4,
        (0, 1, 2, 3),
        (Group((("num_experts", 2),), ((4, 3),), (("S0",),)),),
        "float32",
        "torch",
        Options(),
        False,
    )
)  # subgroup all-gather: each expert on two ranks
@example(
    case=Case(
        3,
        (0, 1, 2),
        (Group((("split_sizes", (3, 1, 1)),), ((5, 4),) * 2, (("S0",), ("S1",))),),
        "bfloat16",
        "dion",
        Options(),
        True,
    )
)  # blocks straddling shards
@example(
    case=Case(
        4,
        ((0, 1), (2, 3)),
        (MATRIX, Group((), ((4, 4),), (("R", "S1"),))),
        "float32",
        "keller",
        Options(dispatch="global"),
        False,
    )
)  # HSDP, global dispatch
@settings(max_examples=examples(1.0))
@given(case=cases())
def test_the_step_on_every_ranks_boxes_equals_muon_ref_on_the_full_tensors_bitwise(
    case: Case,
) -> None:
    assert_boxes_of_reference(case, on_threads(case, steps=2), steps=2)


# the paths that hand a batch's kernel calls over at once (muon_dist.batch.run_kernels), and so may stack them
STACKING_PATHS = ("all_to_all", "global_all_to_all", "local", "subgroup_all_gather", "blocks")


def stacking(seen: list, reverse: bool = False) -> Backend:
    """The torch backend with every matrix admitted to a stack (its stack kernel loops where its probe does not show
    the batch bitwise, so the bits stay muon_ref's on every CPU), recording each stack's shape in `seen`. reverse
    plants a bug: the stack kernel's output matrices in reverse order."""
    real = backend("torch")

    def stack(S: torch.Tensor, cfg) -> torch.Tensor:
        seen.append(tuple(S.shape))
        out = real.stack(S, cfg)
        return out.flip(0) if reverse else out

    return dataclasses.replace(real, stack=stack, batches=lambda *args: True)


def plans_a_stacking_path(case: Case) -> bool:
    """Whether the case's first step (every param active) has a batch on a path that stacks its kernel calls."""
    from muon_dist.plan import plan

    configs = configs_of(case)
    entries = tuple(
        Entry(lay, gi, str(configs[gi].ns_dtype or lay.dtype), True) for gi, lay in case.layouts()
    )
    return any(b.path in STACKING_PATHS for b in plan(entries, case.options).batches)


PACKED = Group(
    (), ((4, 6),) * 3 + ((8, 8),), (("S0",),) * 4
)  # in a group of one: batches of two (4, 6) params


@pytest.mark.timeout(timeout_for(120))
@example(
    case=Case(1, (0,), (PACKED,), "float32", "torch", Options(), False)
)  # a group of one: the run packed
@example(
    case=Case(
        2, (0, 1), (PACKED,), "bfloat16", "torch", Options(dispatch="global", rounds=1), False
    )
)
@example(
    case=Case(
        4,
        ((0, 1), (2, 3)),
        (Group((("num_experts", 4),), ((8, 3),) * 2, (("S0", "S0"),) * 2),),
        "bfloat16",
        "xtuner",
        Options(),
        False,
    )
)  # local experts, two params' experts in one stack
@settings(max_examples=examples(0.5))
@given(case=cases())
def test_with_kernel_calls_stacked_across_params_the_step_keeps_muon_refs_bits(case: Case) -> None:
    """The same equation with each batch's kernel calls stacked by matrix shape (muon_dist.kernels.orthogonalize_many
    through Kernels.many, every matrix admitted); wherever the plan has a path that stacks, stacks ran."""
    seen: list = []
    assert_boxes_of_reference(case, on_threads(case, steps=2, kernels=stacking(seen)), steps=2)
    assert bool(seen) == plans_a_stacking_path(case), seen


@pytest.mark.timeout(timeout_for(60))
def test_where_onednn_leaves_bf16_to_aten_the_torch_backend_stacks_params_and_the_batch_only_where_bitwise(
    monkeypatch,
) -> None:
    """The real torch backend, with oneDNN off (ATen's own bf16 kernel: its rule's static parts hold on every CPU):
    three (16, 32) bf16 params in a group of one share a batch and one stack of three matrices; the stack runs
    batched exactly where the probe found the batch bitwise for that stack (else the loop), and the step's bits
    are muon_ref's either way."""
    from muon_dist.kernels import reference
    from tests.test_kernels import onednn

    seen, batched = [], []
    real_batched = reference.newton_schulz_batched

    def spy(G, *args, **kwargs):
        batched.append(tuple(G.shape))
        return real_batched(G, *args, **kwargs)

    def stack(S, cfg):
        seen.append(tuple(S.shape))
        return reference.orthogonalize_stack(S, cfg)

    monkeypatch.setattr(reference, "newton_schulz_batched", spy)
    reference.forget_probes()
    case = Case(
        1,
        (0,),
        (Group((), ((16, 32),) * 3, (("S0",),) * 3),),
        "bfloat16",
        "torch",
        Options(),
        False,
    )
    with onednn(False):
        results = on_threads(
            case, steps=2, kernels=dataclasses.replace(backend("torch"), stack=stack)
        )
    verdicts = {key[0]: verdict for key, verdict in reference.probed().items()}
    reference.forget_probes()
    assert_boxes_of_reference(case, results, steps=2)
    assert seen == [(3, 16, 32)] * 2, seen
    # each probe runs the batch once on its own stack; the step's calls are the rest
    assert [s for s in batched if s in seen] == (
        [(3, 16, 32)] * 3 if verdicts[(3, 16, 32)] else [(3, 16, 32)]
    )


@pytest.mark.timeout(timeout_for(60))
@pytest.mark.parametrize("W", [1, 2])
def test_negative_control_a_stack_kernel_that_returns_its_matrices_out_of_order_is_caught(
    W: int,
) -> None:
    """Planted: the stack kernel hands the matrices back in reverse order (a wrong split of a stack): the step's
    params then differ from muon_ref's, though each matrix is orthogonalised right."""
    case = Case(
        W,
        tuple(range(W)),
        (PACKED,),
        "float32",
        "torch",
        Options(dispatch="global", rounds=1),
        False,
    )
    seen: list = []
    results = on_threads(case, steps=1, kernels=stacking(seen, reverse=True))
    assert any(shape[0] > 1 for shape in seen), seen
    with pytest.raises(AssertionError):
        assert_boxes_of_reference(case, results, steps=1)


@pytest.mark.timeout(timeout_for(60))
@example(
    case=Case(4, (0, 1, 2, 3), (MATRIX,), "float32", "torch", Options(), False),
    where=4 * 12,
    policy="skip",
)  # param 0's element 12: in rank 2's box only
@example(
    case=Case(
        2,
        (0, 1),
        (Group((("num_heads", 2),), ((4, 6),), (("S1",),)),),
        "float32",
        "torch",
        Options(),
        False,
    ),
    where=0,
    policy="skip",
)  # head 0 skipped, head 1 steps
@settings(max_examples=examples(0.5))
@given(case=cases(), where=st.integers(0, 10**6), policy=st.sampled_from(["raise", "skip"]))
def test_a_non_finite_gradient_in_one_box_is_raised_or_skipped_on_every_rank_as_muon_ref_does(
    case: Case, where: int, policy: str
) -> None:
    num_params = len(case.layouts())
    case = dataclasses.replace(
        case, nonfinite=(where % num_params, where // num_params), policy=policy
    )
    results = on_threads(case, steps=1)
    if policy == "skip":
        assert_boxes_of_reference(case, results, steps=1)
        return
    name = case.layouts()[case.nonfinite[0]][1].name
    with pytest.raises(ValueError, match="non-finite"):
        reference(case, steps=1)
    for result in results:
        assert isinstance(result, ValueError) and f"{name} of shape" in str(result), result


@pytest.mark.timeout(timeout_for(120))
# contiguous shards of multiples of 64 elements outside the tail: the update's ops write in place; (7, 32): rank 0's
# 4 rows in place, rank 1's 3 rows hold the tail (elements 192-223), computed and copied
@example(
    case=Case(
        2,
        (0, 1),
        (Group((), ((128, 64), (64, 64), (7, 32)), (("S0",), ("S1",), ("S0",))),),
        "bfloat16",
        "torch",
        Options(),
        False,
    )
)
# (65, 64): shards of 33 and 32 rows in place; (64, 65): shards of 2,080 elements, padded, computed and copied
@example(
    case=Case(
        2,
        (0, 1),
        (Group((), ((128, 64), (65, 64), (64, 65)), (("S0",), ("S0",), ("S0",))),),
        "bfloat16",
        "emerging",
        Options(),
        True,
    )
)
@example(
    case=Case(
        2,
        (0, 1),
        (Group((), ((64, 65),) * 2, (("R",), ("S1",))),),
        "float32",
        "xtuner",
        Options(),
        False,
    )
)  # a replicated param (the whole box) in place
@example(
    case=Case(
        2,
        (0, 1),
        (Group((("split_sizes", (64, 64)),), ((128, 64),), (("S0",),)),),
        "bfloat16",
        "dion",
        Options(),
        False,
    )
)  # a separate layout: computed per block, then copied
@settings(max_examples=examples(0.5))
@given(case=cases())
def test_with_out_params_the_step_writes_each_new_param_into_its_own_tensor_with_muon_refs_bits(
    case: Case,
) -> None:
    """execute(out_params=...): the same equation, with each rank's new params written into its param tensors
    (in place where run_stage runs the update as it is, else computed and copied), which it then yields."""
    assert_boxes_of_reference(case, on_threads(case, steps=2, in_place=True), steps=2)


@pytest.mark.timeout(timeout_for(60))
@example(
    case=Case(
        2,
        (0, 1),
        (Group((("num_heads", 2),), ((128, 64),), (("S0",),)),),
        "float32",
        "torch",
        Options(),
        False,
    ),
    where=0,
    policy="skip",
)  # head 0 skipped: its shard keeps its bits
@example(
    case=Case(
        2, (0, 1), (Group((), ((128, 64),), (("S0",),)),), "bfloat16", "torch", Options(), False
    ),
    where=64 * 64,
    policy="skip",
)  # the whole param skipped, on rank 1's shard
@settings(max_examples=examples(0.25))
@given(case=cases(), where=st.integers(0, 10**6), policy=st.just("skip"))
def test_with_out_params_skipped_blocks_and_params_keep_their_bits(
    case: Case, where: int, policy: str
) -> None:
    """execute(out_params=...) under nonfinite="skip": the same equation, a skipped param or block keeping its
    param's and buffer's bits in the rank's own tensors."""
    num_params = len(case.layouts())
    case = dataclasses.replace(
        case, nonfinite=(where % num_params, where // num_params), policy=policy
    )
    assert_boxes_of_reference(case, on_threads(case, steps=1, in_place=True), steps=1)


def _fail_on_rank_1(flag_reads: bool, expert: bool = False, stacked: bool = False) -> list[object]:
    """Two (4, 4) Shard(0) params on W = 2 (one all_to_all batch over the world, every rank owns one): rank 1's
    kernel raises. Each rank's result is (its error, the ledger's calls); flag_reads=False plants a bug: the
    failure flag that the update all-to-all carries always reads "no failure". `expert`: a (2, 4, 4) expert stack
    comes first (the local path: each rank orthogonalises its own expert, no collective), global dispatch, and
    only the expert's kernel raises on rank 1. `stacked`: the backend has a stack kernel that admits every matrix
    and raises on rank 1 too (Kernels.many: the calls then run one by one, guarded)."""
    import threading

    from muon_dist import step as step_module

    here = threading.local()
    reference_kernel = backend("torch")

    def orthogonalize(x, layout, cfg):
        if here.rank == 1 and (x.ndim == 3 or not expert):
            raise RuntimeError("planted kernel failure")
        return reference_kernel.orthogonalize(x, layout, cfg)

    def stack(S, cfg):
        if here.rank == 1:
            raise RuntimeError("planted stack kernel failure")
        return reference_kernel.stack(S, cfg)

    failing = Backend("failing", orthogonalize, False)
    if stacked:
        failing = dataclasses.replace(failing, stack=stack, batches=lambda *args: True)
    layouts = [ParamLayout(f"p{i}", (4, 4), "torch.float32", (0, 1), ("S0",)) for i in range(2)]
    if expert:
        layouts.insert(0, ParamLayout("experts", (2, 4, 4), "torch.float32", (0, 1), ("S0",)))
    options = Options(dispatch="global") if expert else Options()
    cfg = group_config(preset_defaults("torch", {}))
    world, results = ThreadWorld(2, timeout_s=10), [None, None]
    flag_type = step_module.FailureFlag

    class Blind(flag_type):  # the planted bug
        def __init__(self, local, name):
            super().__init__(lambda: False, name)

    def rank_main(rank: int) -> None:
        here.rank = rank
        comm = ThreadComm(world, rank)
        grads = [box(seeded(lay.global_shape, 7 + i), lay, rank) for i, lay in enumerate(layouts)]
        inputs = [ParamInput(torch.zeros_like(g), g, torch.zeros_like(g)) for g in grads]
        entries = tuple(Entry(lay, 0, "torch.bfloat16", True) for lay in layouts)
        configs = [cfg] * len(layouts)
        try:
            step_plan, skipped = prepare(comm, entries, inputs, configs, options)
            assert not expert or step_plan.path_of()[:2] == ("local", "global_all_to_all"), (
                step_plan
            )
            list(
                execute(
                    comm,
                    step_plan,
                    inputs,
                    configs,
                    failing,
                    lambda batch: comm.group(batch.geometries[0].group_of(rank)),
                    False,
                    skipped,
                )
            )
            results[rank] = (None, list(comm.calls))
        except (RuntimeError, AssertionError) as e:
            results[rank] = (f"{type(e).__name__}: {e}", list(comm.calls))

    step_module.FailureFlag = flag_type if flag_reads else Blind
    try:
        run_threads(2, rank_main)
    finally:
        step_module.FailureFlag = flag_type
    return results


@pytest.mark.timeout(timeout_for(30))
@pytest.mark.parametrize(
    "expert, stacked",
    [(False, False), (True, False), (False, True)],
    ids=["all_to_all", "local_then_global", "stacked"],
)
def test_a_failure_rides_on_the_update_all_to_all_and_every_rank_raises_without_a_check_of_its_own(
    expert: bool, stacked: bool
) -> None:
    """agreement.py step 3: a kernel failure on rank 1 is carried by the update all-to-all's flag, every rank raises
    and writes nothing, with no failure-check all-gather. `expert`: the failing kernel is a local expert batch's
    (no collective of its own); the global round the plan puts after it (plan.interleave) closes its write group
    (agreement.write_groups) and carries its flag."""
    results = _fail_on_rank_1(flag_reads=True, expert=expert, stacked=stacked)
    assert "rank 1 failed mid-step in the kernel" in results[1][0], results[1]
    assert "ranks [1] failed mid-step" in results[0][0], results[0]
    for error, calls in results:
        checks = [(path, op) for path, op, *_ in calls if path == "failure_check"]
        assert checks == [("failure_check", "carried")], (
            calls
        )  # the flag's bytes, no all-gather of its own
        assert "no param or momentum buffer was written" in error
    # negative control: with the carried flag read as "no failure", rank 0 finishes the step and writes a param
    # whose update rank 1 never computed, and only rank 1 stops: the flag is what keeps the ranks' writes the same
    blind = _fail_on_rank_1(flag_reads=False, expert=expert)
    assert blind[0][0] is None and blind[1][0] is not None, blind


@pytest.mark.timeout(timeout_for(30))
@pytest.mark.parametrize("direction_dtype", [None, "torch.bfloat16"])
def test_directions_sent_in_the_kernels_input_cast_give_the_same_bits_and_half_the_forward_bytes(
    direction_dtype,
) -> None:
    """Entry.direction_dtype: the step casts each direction before its path moves it. On W = 4 (uneven
    boxes, an empty one), the boxes equal muon_ref's and each rank's bytes are the plan's (expected_bytes with
    the batch's direction dtype): bf16 directions halve the forward all-to-all's bytes."""
    case = Case(
        4,
        (0, 1, 2, 3),
        (Group((), ((5, 3),) * 4, (("S0",),) * 4),),
        "float32",
        "torch",
        Options(),
        False,
    )
    layouts = case.layouts()
    cfg = group_config(preset_defaults("torch", {}))
    world, results = ThreadWorld(4, timeout_s=10), [None] * 4

    def rank_main(rank: int) -> None:
        comm = ThreadComm(world, rank)
        params = [box(p, lay, rank) for p, (_, lay) in zip(initial_params(case), layouts)]
        grads = [box(g, lay, rank) for g, (_, lay) in zip(gradients(case, 0), layouts)]
        inputs = [ParamInput(p, g, torch.zeros_like(p)) for p, g in zip(params, grads)]
        entries = tuple(
            Entry(lay, 0, "torch.bfloat16", True, direction_dtype) for _, lay in layouts
        )
        step_plan, skipped = prepare(comm, entries, inputs, [cfg] * 4, Options())
        for i, new, buf in execute(
            comm,
            step_plan,
            inputs,
            [cfg] * 4,
            backend("torch"),
            lambda batch: comm.group(batch.geometries[0].group_of(rank)),
            False,
            skipped,
        ):
            params[i] = new
        moved = {k: tuple(v) for k, v in comm.ledger.items() if k not in CHECKS}
        assert moved == expected_bytes(step_plan, rank, ITEMSIZES), (rank, moved)
        results[rank] = (params, moved["all_to_all"][0])

    run_threads(4, rank_main)
    want, _ = reference(case, steps=1)
    for rank, (params, _) in enumerate(results):
        for p, w, (_, lay) in zip(params, want, layouts):
            assert same_bits(p, box(w, lay, rank)), rank
    # rank 0 owns p0 and sends its boxes of p1..p3 (fp32 or bf16) and the update boxes of p0 (bf16) back
    own, others = (
        2 * 3,
        3 * 2 * 3,
    )  # its box of each param: 2 rows of 3 (torch.chunk of 5 rows over 4 ranks)
    sent = results[0][1]
    assert sent == others * (2 if direction_dtype else 4) + (5 * 3 - own) * 2, sent


@settings(max_examples=examples(1.0))
@given(
    W=st.integers(2, 5), rows=st.lists(st.integers(1, 9), min_size=1, max_size=6), data=st.data()
)
def test_the_send_offsets_lay_each_direction_where_the_exchange_would_pack_it(
    W: int, rows: list[int], data
) -> None:
    """Batch.send_offsets(member), where the momentum stage writes each param's box of its direction (a Packed),
    is the layout the exchange packs the boxes into (exchange.forward_send): owner 0's params in travel order,
    then owner 1's, and so on; any owners, uneven and empty boxes (torch.chunk of `rows` over W members).
    Control: the boxes written in param order alone differ from it where the owners are not in param order."""
    from muon_dist.batch import Batch
    from muon_dist.paths import exchange

    from .batches import layout_1d

    geometries = tuple(layout_1d((r, 3), "S0", W, "torch.float32").geometry for r in rows)
    owners = tuple(
        data.draw(st.lists(st.integers(0, W - 1), min_size=len(rows), max_size=len(rows)))
    )
    batch = Batch(
        "global_all_to_all",
        tuple(range(len(rows))),
        geometries,
        owners,
        "torch.float32",
        "torch.float32",
    )
    for member in range(W):
        boxes = [
            torch.full((g.sizes[member],), float(k)) + torch.arange(g.sizes[member]) / 100
            for k, g in enumerate(geometries)
        ]
        offsets, length = batch.send_offsets(member)
        written = torch.full((length,), float("nan"))
        for k, b in enumerate(boxes):
            written[offsets[k] : offsets[k] + b.numel()] = b
        packed = exchange.forward_send(boxes, geometries, owners, member, torch.empty(0))
        assert same_bits(written, packed), (member, owners, offsets)
        in_param_order = torch.cat(boxes)
        if owners != tuple(sorted(owners)) and all(b.numel() for b in boxes):
            assert not same_bits(in_param_order, packed)  # the control


@pytest.mark.timeout(timeout_for(30))
@pytest.mark.parametrize("dispatch", ["global", "batched"])
def test_the_momentum_stage_packs_the_forward_send_and_the_exchange_sends_it_as_it_is(
    monkeypatch: pytest.MonkeyPatch, dispatch: str
) -> None:
    """On the paths that take their directions packed (Path.packed_directions), the momentum stage writes every
    direction into the forward send buffer (its cast to bf16 included: the torch preset's directions travel in the
    kernel's input dtype), so exchange.pack runs once per exchange, for the updates' way back; the boxes stay
    muon_ref's bit for bit. Control: a path that is not marked packed still packs both ways (two calls per batch)."""
    from muon_dist.paths import PATHS, exchange

    case = Case(
        2,
        (0, 1),
        (Group((), ((5, 3),) * 3 + ((6, 4),), (("S0",),) * 4),),
        "float32",
        "torch",
        Options(dispatch=dispatch),
        False,
    )
    real_pack, calls = exchange.pack, []
    monkeypatch.setattr(
        exchange, "pack", lambda pieces, empty: calls.append(1) or real_pack(pieces, empty)
    )
    results = on_threads(case, steps=1)
    assert_boxes_of_reference(case, results, steps=1)
    packed_calls = len(calls)
    assert packed_calls > 0 and packed_calls % 2 == 0, (
        packed_calls
    )  # one per exchange on each of the 2 ranks
    calls.clear()
    for name in ("all_to_all", "global_all_to_all"):
        monkeypatch.setitem(PATHS, name, dataclasses.replace(PATHS[name], packed_directions=False))
    assert_boxes_of_reference(case, on_threads(case, steps=1), steps=1)
    assert len(calls) == 2 * packed_calls, (len(calls), packed_calls)


@pytest.mark.timeout(timeout_for(30))
@pytest.mark.parametrize("dispatch", ["global", "batched"])
def test_the_forward_send_buffer_is_let_go_once_sent(
    monkeypatch: pytest.MonkeyPatch, dispatch: str
) -> None:
    """A batch's forward send buffer (the Packed the momentum stage writes) is held by nothing once its all-to-all
    is done: when a batch's kernels run, no send buffer of that rank is alive (the pipeline issues the next
    batch's directions after these kernels, and ThreadComm is made to hand the peers copies of the pieces, so its
    mailbox holds none); so the batches in flight do not hold their directions through the kernels, and the boxes
    stay muon_ref's. Negative control: an exchange stage whose frame keeps its directions (as the step's did once)
    leaves its own alive at its kernels."""
    import threading
    import weakref

    from muon_dist.batch import Packed
    from muon_dist.comm import ThreadComm
    from muon_dist.step import StepRun

    def copying(self, x, out_splits, in_splits, group):
        pieces = self._exchange([p.clone() for p in x.split(in_splits)], group)
        me = group.ranks.index(self.rank)
        out = torch.cat([p[me] for p in pieces]) if pieces else x.new_empty(0)
        return lambda: out

    monkeypatch.setattr(ThreadComm, "_all_to_all_start", copying)

    case = Case(
        2,
        (0, 1),
        (Group((), ((6, 4),) * 6, (("S0",),) * 6),),
        "float32",
        "torch",
        Options(dispatch=dispatch, rounds=3),
        False,
    )
    sends: dict[int, list] = {}
    real_momentum = StepRun.momentum

    def momentum(self, batch):
        directions = real_momentum(self, batch)
        if isinstance(directions, Packed):
            sends.setdefault(threading.get_ident(), []).append(weakref.ref(directions.buffer))
        return directions

    monkeypatch.setattr(StepRun, "momentum", momentum)
    alive = []

    def watched(kernel):
        def run(*args):
            alive.append(sum(w() is not None for w in sends.get(threading.get_ident(), [])))
            return kernel(*args)

        return run

    watching = with_kernels(backend("torch"), watched)  # a stacked call too
    assert_boxes_of_reference(case, on_threads(case, steps=1, kernels=watching), steps=1)
    assert sends and alive and max(alive) == 0, (len(sends), alive)

    real_exchange = StepRun.exchange

    def holding(self, batch, directions):
        kept = directions  # noqa: F841 - the planted hold
        return (yield from real_exchange(self, batch, directions))

    monkeypatch.setattr(StepRun, "exchange", holding)
    sends.clear()
    alive.clear()
    assert_boxes_of_reference(case, on_threads(case, steps=1, kernels=watching), steps=1)
    assert min(alive) >= 1, alive
