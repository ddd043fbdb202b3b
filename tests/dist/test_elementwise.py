"""The elementwise stages on a shard give the bits the reference gets on the whole tensor (muon_dist/elementwise.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_check.fixtures import bits
from muon_dist import Box
from muon_dist.elementwise import run_stage, runs_as_is
from muon_ref.functional import apply_update, matrix_layout, momentum_direction
from muon_ref.optim import group_config
from muon_ref.presets import PRESETS, preset_defaults
from tests.conftest import examples

from .batches import layout_1d
from .checks import timeout_for

pytestmark = pytest.mark.timeout(timeout_for(60))


def shard_box(shape: tuple[int, int], placement: str, rank: int, W: int) -> Box:
    geometry = layout_1d(shape, placement, W, "torch.bfloat16").geometry
    return geometry.boxes[geometry.member(rank)]


def assert_every_shard_equals_the_whole(shape, placement, W, preset, dtype, seed) -> None:
    cfg = group_config(preset_defaults(preset, {}))
    gen = torch.Generator().manual_seed(seed)
    grad, buf, param = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    update = torch.randn(shape, generator=gen).to(torch.bfloat16)
    mlayout = matrix_layout(shape)
    momentum = functools.partial(momentum_direction, cfg=cfg)
    apply = lambda p, u: (apply_update(p, u, mlayout, cfg),)  # noqa: E731
    whole = momentum(grad, buf) + apply(param, update)
    for rank in range(W):
        mine = shard_box(shape, placement, rank, W)
        on = lambda t: t[mine.index].contiguous()  # noqa: E731
        got = run_stage(momentum, [on(grad), on(buf)], shape, mine) + run_stage(
            apply, [on(param), on(update)], shape, mine
        )
        for g, w in zip(got, whole):
            assert torch.equal(bits(g), bits(on(w))), (rank, mine)
        if runs_as_is(
            [on(param), on(update)], shape, mine
        ):  # the update written into the shard itself
            own = on(param)
            apply_update(own, on(update), mlayout, cfg, out=own)
            assert torch.equal(bits(own), bits(on(whole[-1]))), (rank, mine)


@settings(max_examples=examples(2.0))
@given(
    shape=st.tuples(st.integers(1, 70), st.integers(1, 70)),
    placement=st.sampled_from(["S0", "S1"]),
    W=st.integers(1, 8),
    preset=st.sampled_from(sorted(PRESETS)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 999),
)
def test_momentum_and_update_on_every_shard_equal_the_whole_tensor_bitwise(
    shape, placement, W, preset, dtype, seed
) -> None:
    """run_stage's padded calls, and the step's own stage functions (which run a shard unpadded wherever
    position_free takes the stage as position-free: bitwise when chosen), give every shard the whole tensor's bits;
    a stage with a bf16 output is never taken as position-free (the dtype rule, on every CPU)."""
    assert_every_shard_equals_the_whole(shape, placement, W, preset, dtype, seed)
    seen = step_stages_on_every_shard(shape, placement, W, preset, dtype, seed)
    if dtype == torch.bfloat16:
        assert not any(free for free, _ in seen)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, W",
    [((256, 64), 2), ((256, 64), 4), ((96, 64), 4), ((130, 64), 4), ((129, 65), 2), ((129, 63), 2)],
)
def test_shards_of_whole_blocks_run_unpadded_with_the_same_bits(shape, W, preset, dtype) -> None:
    """Boxes of a multiple of BLOCK elements outside the tail take run_stage's unpadded call; the last box of
    (129, 65) and of (129, 63) holds the global tail and takes the padded one (negative control: without the tail
    condition, (129, 63)'s last box of 64 x 63 elements runs its 63 tail elements in the body and differs in
    bf16)."""
    assert_every_shard_equals_the_whole(shape, "S0", W, preset, dtype, seed=sum(shape) + W)


def test_bf16_add_alpha_depends_on_the_position_in_the_call_on_this_cpu() -> None:
    """Why run_stage exists (measured on an x86 CPU with AVX-512, torch 2.13): the vector body and the scalar tail differ."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4096, generator=gen).to(torch.bfloat16) for _ in range(2))
    whole = a.add(b, alpha=0.95)
    one_by_one = torch.cat([a[i : i + 1].add(b[i : i + 1], alpha=0.95) for i in range(4096)])
    differing = int((whole != one_by_one).sum())
    if differing == 0:
        pytest.skip(
            "the CPU build running the test gives bf16 add(alpha) position-independent bits"
        )
    assert differing > 0


@pytest.mark.parametrize(
    "shape, W",
    [
        ((256, 64), 4),
        ((130, 64), 4),
        ((129, 65), 2),
        ((129, 63), 2),
        ((7, 32), 2),
        ((5, 3), 1),
        ((5, 3), 3),
    ],
)
@pytest.mark.parametrize("placement", ["S0", "S1"])
def test_runs_as_is_says_whether_run_stage_calls_the_stage_once_on_the_shard_as_it_is(
    shape, W, placement
) -> None:
    """runs_as_is is run_stage's rule: True exactly where run_stage makes one call of the stage, on the shard's own
    storage (no padded copy, no tail call); on a non-contiguous shard it is False unless the box is the whole
    tensor."""
    x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    for rank in range(W):
        mine = shard_box(shape, placement, rank, W)
        calls: list[tuple[int, int]] = []
        stage = lambda t: (calls.append((t.numel(), t.data_ptr())), (t + 1,))[1]  # noqa: E731
        for shard in (x[mine.index].contiguous(), x[mine.index]):
            calls.clear()
            (y,) = run_stage(stage, [shard], shape, mine)
            assert torch.equal(y, shard + 1)
            as_is = calls == [(shard.numel(), shard.data_ptr())]
            assert runs_as_is([shard], shape, mine) == as_is, (rank, mine, calls)
            if not shard.is_contiguous():
                assert runs_as_is([shard], shape, mine) == (tuple(mine.shape) == shape)


@pytest.mark.parametrize(
    "global_shape, box, calls",
    [
        # 130 elements: the body ends at 128, two elements in the tail; the box holds 65, the tail's two among them
        ((10, 13), Box((5, 0), (5, 13)), [128, 2]),
        # 128 elements, no tail; a box of 48 is padded to one BLOCK of 64 all the same
        ((8, 16), Box((0, 0), (3, 16)), [64]),
        # a box of 64 in the body of a tensor without a tail runs as it is
        ((8, 16), Box((0, 0), (4, 16)), [64]),
    ],
)
def test_a_stage_runs_once_on_the_box_padded_to_whole_blocks_and_once_on_the_tensors_tail(
    global_shape, box, calls
) -> None:
    """run_stage's calls, by the length of their inputs: the box padded to the next multiple of BLOCK (64), no
    further; then, where the box holds elements of the whole tensor's tail (its last numel % 64), the tail alone."""
    seen = []

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(x.numel())
        return (x * 2,)

    x = torch.arange(box.numel, dtype=torch.float32).reshape(box.shape)
    (out,) = run_stage(stage, [x], global_shape, box)
    assert seen == calls and torch.equal(out, x * 2)


# ------------------------------------------------------------------------------------------ position-free stages


def step_stages_on_every_shard(
    shape, placement, W, preset, dtype, seed, check_bits: bool = True
) -> list[tuple[bool, bool]]:
    """The step's own stage functions (momentum_on_box, buffer_on_box in place, update_on_box into the param) on
    every shard equal the whole tensor's muon_ref stages bit for bit (asserted unless check_bits is False);
    returns, per rank, (whether the momentum stage was taken as position-free, whether the box alone runs as it
    is)."""
    from muon_dist import elementwise

    cfg = group_config(preset_defaults(preset, {}))
    gen = torch.Generator().manual_seed(seed)
    grad, buf, param = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    update = torch.randn(shape, generator=gen).to(cfg.ns_dtype or dtype)
    mlayout = matrix_layout(shape)
    new_buf, direction = momentum_direction(grad, buf, cfg)
    new_param = apply_update(param, update, mlayout, cfg)
    seen = []
    for rank in range(W):
        mine = shard_box(shape, placement, rank, W)
        on = lambda t: t[mine.index].contiguous()  # noqa: E731
        got_buf, got_dir = elementwise.momentum_on_box(cfg, on(grad), on(buf), mlayout, shape, mine)
        own_buf = on(buf)
        written = elementwise.buffer_on_box(cfg, on(grad), own_buf, mlayout, shape, mine, True)
        own = on(param)
        got_param = elementwise.update_on_box(cfg, own, on(update), mlayout, shape, mine, out=own)
        for got, want in (
            (got_buf, new_buf),
            (got_dir, direction),
            (written, new_buf),
            (got_param, new_param),
        ):
            assert not check_bits or torch.equal(bits(got), bits(on(want))), (rank, mine)
        inputs = [on(grad), on(buf)]
        free = mine.numel > 0 and elementwise.position_free(
            "momentum_direction", cfg, lambda g, b: momentum_direction(g, b, cfg), inputs
        )
        seen.append((free, elementwise.runs_as_is(inputs, shape, mine)))
    return seen


def test_an_fp32_shard_runs_unpadded_exactly_where_the_probe_says_so(monkeypatch) -> None:
    """run_stage is asked for the unpadded call (free) on a padded box exactly when the probe's verdict is True,
    with the verdict forced either way (so the test holds on a CPU whatever its verdict): with True one call of
    the stage on the shard itself, with False the padded calls. The bits equal the whole tensor's with False, and
    with True where the CPU's own probe says True too (a probe that wrongly said True would be caught by the
    equality in test_momentum_and_update_on_every_shard_equal_the_whole_tensor_bitwise)."""
    from muon_dist import elementwise

    cfg = group_config(preset_defaults("torch", {}))
    genuine = elementwise.probe_position_free(
        lambda g, b: momentum_direction(g, b, cfg), (torch.float32,) * 2, torch.device("cpu")
    ) and elementwise.probe_position_free(
        lambda p, u: (apply_update(p, u, matrix_layout((13, 7)), cfg),),
        (torch.float32, cfg.ns_dtype),
        torch.device("cpu"),
    )
    calls: list[bool] = []
    original = elementwise.run_stage

    def recording(stage, inputs, global_shape, box, free=False):
        calls.append(free)
        return original(stage, inputs, global_shape, box, free)

    monkeypatch.setattr(elementwise, "run_stage", recording)
    for verdict in (True, False):
        monkeypatch.setattr(elementwise, "_POSITION_FREE", {})
        monkeypatch.setattr(elementwise, "probe_position_free", lambda *a, v=verdict: v)
        calls.clear()
        seen = step_stages_on_every_shard(
            (13, 7), "S0", 2, "torch", torch.float32, 0, check_bits=genuine or not verdict
        )
        assert [free for free, as_is in seen] == [verdict, verdict]
        assert not any(as_is for _, as_is in seen)  # 13 x 7 on 2 ranks: both boxes need padding
        assert calls and all(free == verdict for free in calls)


def test_the_probe_tells_a_stage_whose_tail_rounds_otherwise_from_one_whose_bits_do_not_move() -> (
    None
):
    """Negative control of probe_position_free: an fp32 stage whose scalar tail (the last numel % 64 elements of a
    call) lands one ulp away is found position-dependent, and so is one that differs only on NaN's sign in the
    tail; the same stage without the tail's difference is found position-free; a stage with a bf16 output, or
    with a pointwise op computing in bf16 on the way to an fp32 output, is never taken."""
    from muon_dist.elementwise import BLOCK, probe_position_free

    def tail_off(x: torch.Tensor) -> tuple[torch.Tensor]:
        y = x * 3.0
        n = x.numel() - x.numel() % BLOCK
        y[n:] = torch.nextafter(y[n:], torch.tensor(float("inf")))
        return (y,)

    def nan_sign_off(x: torch.Tensor) -> tuple[torch.Tensor]:
        y = x * 3.0
        n = x.numel() - x.numel() % BLOCK
        y[n:] = torch.where(y[n:].isnan(), -y[n:], y[n:])
        return (y,)

    cpu, f32 = torch.device("cpu"), (torch.float32,)
    assert not probe_position_free(tail_off, f32, cpu)
    assert not probe_position_free(nan_sign_off, f32, cpu)
    assert probe_position_free(lambda x: (x * 3.0,), f32, cpu)
    assert not probe_position_free(lambda x: (x.to(torch.bfloat16),), f32, cpu)
    # an fp32 output computed through a bf16 intermediate (O * s in bf16, as some presets scale the update) is not
    # taken; the same stage with the intermediate in fp32 is
    mixed = lambda p, u: (p - u * 0.3,)  # noqa: E731
    assert not probe_position_free(mixed, (torch.float32, torch.bfloat16), cpu)
    assert probe_position_free(mixed, (torch.float32, torch.float32), cpu)


def test_position_free_keeps_its_verdict_across_learning_rates_and_probes_again_for_another_config(
    monkeypatch,
) -> None:
    """The verdict is cached per stage, config but its lr, dtypes, device and threads: a new lr (a schedule's next
    step) asks no new probe, a new momentum, dtype or thread count does; a tensor off the CPU, or of a tensor
    subclass (as fake and traced tensors are), is never taken; a Parameter is a plain tensor."""
    from muon_dist import elementwise

    probes = []
    monkeypatch.setattr(elementwise, "_POSITION_FREE", {})
    monkeypatch.setattr(
        elementwise,
        "probe_position_free",
        lambda stage, dtypes, device: probes.append(dtypes) or True,
    )
    cfg = group_config(preset_defaults("torch", {}))
    x = [torch.zeros(3), torch.zeros(3)]
    stage = lambda g, b: momentum_direction(g, b, cfg)  # noqa: E731
    assert elementwise.position_free("m", cfg, stage, x)
    assert elementwise.position_free("m", cfg.replace(lr=cfg.lr / 3), stage, x)
    assert len(probes) == 1
    elementwise.position_free("m", cfg.replace(momentum=0.5), stage, x)
    elementwise.position_free("m", cfg, stage, [t.double() for t in x])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        elementwise.position_free("m", cfg, stage, x)
    finally:
        torch.set_num_threads(threads)
    assert len(probes) == 4
    assert not elementwise.position_free("m", cfg, stage, [t.to("meta") for t in x])

    class Traced(torch.Tensor):  # a tensor subclass, as fake and traced tensors are
        pass

    assert not elementwise.position_free("m", cfg, stage, [t.as_subclass(Traced) for t in x])
    assert elementwise.position_free("m", cfg, stage, [torch.nn.Parameter(t) for t in x])
    assert len(probes) == 4


def test_a_probe_that_took_bf16_stages_as_position_free_would_be_caught(monkeypatch) -> None:
    """Planted bug: every stage taken as position-free, bf16 included (the dtype rule and the probe bypassed). The
    bitwise check of the step's stages on uneven shards then fails on CPUs whose bf16 body and tail differ (as the
    x86 AVX-512 build does); on a build where they do not, the plant changes no bits and the test says so."""
    from muon_dist import elementwise

    monkeypatch.setattr(elementwise, "_POSITION_FREE", {})
    monkeypatch.setattr(elementwise, "probe_position_free", lambda *a: True)
    caught = 0
    for shape, W, preset in [
        ((129, 63), 2, "torch"),
        ((70, 33), 3, "moonlight"),
        ((65, 65), 4, "keller"),
    ]:
        try:
            step_stages_on_every_shard(shape, "S0", W, preset, torch.bfloat16, 1)
        except AssertionError:
            caught += 1
    if not caught:
        pytest.skip("bf16 stages give position-independent bits on the CPU build running the test")
    assert caught > 0


def test_the_measurement_finds_every_position_free_stage_bitwise_and_catches_a_wrong_verdict(
    monkeypatch, capsys
) -> None:
    """muon_dist.elementwise.measure (`python -m benchmarks elementwise`): no stage the probe takes as
    position-free differs between the whole call and an unpadded shard's, for every preset and dtype; with every
    verdict forced True (planted), the bf16 stages that differ are counted as violations (on a CPU build whose bf16
    body and tail agree there is nothing to count, and the test says so)."""
    from muon_dist import elementwise
    from muon_ref.presets import PRESETS

    assert elementwise.measure(3) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.split()[0] in PRESETS]
    assert len(rows) == 3 * len(PRESETS)
    assert all("False, False, False" in row for row in rows if " bfloat16 " in row)
    monkeypatch.setattr(elementwise, "_POSITION_FREE", {})
    monkeypatch.setattr(elementwise, "probe_position_free", lambda *a: True)
    planted = elementwise.measure(3)
    out = capsys.readouterr().out
    differing = [
        row
        for row in out.splitlines()
        if " bfloat16 " in row and row.split()[-3:] != ["0,", "0,", "0"]
    ]
    if not differing:
        pytest.skip("bf16 stages gave position-independent bits on the CPU build running the test")
    assert planted >= len(differing) > 0


def test_ranks_as_threads_get_each_configs_own_verdict(monkeypatch) -> None:
    """Ranks may be threads of one process (ThreadComm): configs asked about at once from several threads each get
    a token of their own (equal configs but their lr one token), so no config is answered with another's verdict;
    the verdicts are each config's (the probe planted to answer by the momentum the stage was built with)."""
    import threading

    from muon_dist import elementwise

    monkeypatch.setattr(elementwise, "_POSITION_FREE", {})
    monkeypatch.setattr(elementwise, "probe_position_free", lambda stage, *a: stage.free)
    base = group_config(preset_defaults("torch", {}))
    configs = [base.replace(momentum=0.5 + 0.05 * k) for k in range(8)]
    tokens: dict[int, set] = {k: set() for k in range(8)}
    verdicts: dict[int, set] = {k: set() for k in range(8)}
    start = threading.Barrier(8)

    def rank(k: int) -> None:
        stage = lambda g, b: (g,)  # noqa: E731
        stage.free = k % 2 == 0
        start.wait()
        for step in range(50):
            cfg = configs[k].replace(
                lr=0.01 * (step + 1)
            )  # a schedule: a new config object every step
            tokens[k].add(elementwise._token(cfg))
            verdicts[k].add(elementwise.position_free("m", cfg, stage, [torch.zeros(2)]))

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(len(tokens[k]) == 1 for k in range(8))
    assert len(set.union(*tokens.values())) == 8
    assert all(verdicts[k] == {k % 2 == 0} for k in range(8))
