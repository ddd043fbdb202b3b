"""A smoke run of the single-GPU benchmark (benchmarks/gpu.py) on CPU at tiny sizes: `--device cpu --tiny` runs
every line but the CUDA timing and memory readings. It can fail: the tables must have their rows and columns,
every Muon that runs on CPU must equal muon_ref bitwise (and a perturbed one must not), and the NS floor must
be the reference FLOPs at the peak. No timing is asserted."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import runpy
import sys

import pytest
import torch

import muon_ref
from benchmarks import gpu
from muon_check.shapes import ParamSpec
from muon_dist.kernels import BACKENDS

SETS = ("dense", "moe")
STEP_COLUMNS = (
    "optimizer",
    "step ms",
    "[min, max]",
    "x torch",
    "peak GiB",
    "of floor",
    "= muon_ref",
)
KERNEL_COLUMNS = ("shape", "kernel", "ms", "[min, max]", "of peak", "max |diff|")


def run_main(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu.main(argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, dict]:
    path = tmp_path_factory.mktemp("gpu") / "rows.json"
    code, out = run_main(["--device", "cpu", "--tiny", "--json", str(path)])
    assert code == 0
    return out, json.loads(path.read_text())


@pytest.mark.timeout(60)
def test_the_tiny_cpu_run_prints_the_header_both_step_tables_and_the_kernel_table(tiny):
    out, data = tiny
    assert out.startswith("benchmarks gpu: CPU") and "UTC" in out
    assert f"torch {torch.__version__}, triton " in out
    assert data["header"]["command"].startswith(
        "python -m benchmarks gpu --device cpu --tiny --json "
    )
    assert all(column in out for column in STEP_COLUMNS + KERNEL_COLUMNS)
    names = [c.name for c in gpu.contenders(None)]
    assert [(r["set"], r["optimizer"]) for r in data["steps"]] == [
        (s, n) for s in SETS for n in names
    ]
    shapes = ["x".join(map(str, s)) for s in gpu.parse_shapes(gpu.TINY_SHAPES)]
    kernels = [k.name for k in gpu.kernels(gpu.MuonConfig(), [(128, 64, 8)], None)]
    assert [(r["shape"], r["kernel"]) for r in data["kernels"]] == [
        (s, k) for s in shapes for k in kernels
    ]
    assert all(f"muon_dist.kernels backend {b}" in kernels for b in BACKENDS)


@pytest.mark.timeout(60)
def test_every_muon_that_runs_on_cpu_equals_muon_ref_bitwise(tiny):
    _, data = tiny
    rows = {(r["set"], r["optimizer"]): r for r in data["steps"]}
    for name in SETS:
        assert rows[name, gpu.REFERENCE]["oracle"] and rows[name, gpu.REFERENCE]["error"] is None
        for optimizer in (gpu.TORCH_MUON, "DistributedMuon W=1 ns_backend=torch"):
            assert rows[name, optimizer]["equal_muon_ref"] is True, rows[name, optimizer]
        adamw = rows[name, "torch.optim.AdamW(fused=True)"]
        assert (
            adamw["error"] is None
            and adamw["equal_muon_ref"] is None
            and adamw["floor_fraction"] is None
        )
        assert rows[name, gpu.TORCH_MUON]["x_torch"] == 1.0


class OneBitOff(torch.optim.Optimizer):
    """muon_ref.Muon, then the last mantissa bit of one element flipped: a Muon that is almost the oracle."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.inner = muon_ref.Muon(params, preset=gpu.PRESET)
        self.first = params[0]
        super().__init__(params, {})

    def step(self, closure: object = None) -> None:
        self.inner.step()
        self.first.view(torch.int32).view(-1)[0] ^= 1


@pytest.mark.timeout(60)
def test_a_one_bit_perturbed_optimizer_is_reported_as_not_bitwise():
    specs = gpu.step_sets(tiny=True)["dense"][1][:3]
    run = gpu.StepRun(
        "dense", "three tiny matrices", tuple(specs), warmup=1, steps=1, device=torch.device("cpu")
    )
    oracle = gpu.contenders(None)[0]
    again = dataclasses.replace(oracle, name="the oracle again")
    rows = gpu.step_table(run, [oracle, again, gpu.Contender("one bit off", OneBitOff)], 989.0, 5)
    assert [r["equal_muon_ref"] for r in rows] == [None, True, False]
    assert rows[2]["max_abs_diff"] > 0 and gpu.bitwise_cell(rows[2]).startswith("no ")


def test_the_ns_floor_is_the_reference_flops_at_the_peak(tiny):
    # per matrix with m <= n: 5 (4 m^2 n + 2 m^3); (2, 3) and each of the 4 experts (3, 2): 5 (48 + 16) = 320
    specs = [ParamSpec("w", (2, 3), "matrix"), ParamSpec("e", (4, 3, 2), "experts")]
    assert gpu.ns_floor_ms(specs, peak_tflops=1e-9, steps=5) == pytest.approx(
        1600.0
    )  # 1,600 FLOPs at 1,000 FLOP/s
    assert gpu.kernel_flops((8, 1024, 1024), 5) == 8 * 5 * 6 * 1024**3
    # the hand-measured H100 tables (2026-11-23): floors 76 ms (dense, 0.93 B params) and 24 ms (MoE, 1.25 B)
    full = gpu.step_sets(tiny=False)
    for name, floor_ms, billions in (("dense", 76, 0.93), ("moe", 24, 1.25)):
        specs = full[name][1]
        assert round(gpu.ns_floor_ms(specs, 989.0, 5)) == floor_ms
        assert round(sum(torch.Size(s.shape).numel() for s in specs) / 1e9, 2) == billions
    _, data = tiny
    for r in data["steps"]:
        if r["floor_fraction"] is not None:
            tiny_specs = gpu.step_sets(tiny=True)[r["set"]][1]
            assert r["floor_fraction"] * r["ms"] == pytest.approx(
                gpu.ns_floor_ms(tiny_specs, 989.0, 5)
            )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without CUDA"
)
def test_without_cuda_python_m_benchmarks_gpu_says_the_gpu_tables_are_skipped_and_exits_0(
    monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["benchmarks", "gpu"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("benchmarks", run_name="__main__")
    assert exit_.value.code == 0
    assert "no CUDA device here: the GPU tables are skipped" in capsys.readouterr().out


@pytest.fixture
def dion_checkout(tmp_path):
    """A stand-in for a microsoft/dion checkout (the real one is never needed by the tests): dion.Muon and the
    NS functions the benchmark looks for; modules named dion* are removed from sys.modules afterwards."""
    package = tmp_path / "dion"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import torch\n"
        "class Muon(torch.optim.SGD):\n"
        "    def __init__(self, params, lr, mu, weight_decay, nesterov, **options):\n"
        "        super().__init__(params, lr=lr, momentum=mu, weight_decay=weight_decay, nesterov=nesterov)\n"
    )
    ns = "def {}(G, epsilon=1e-7):\n    return G.bfloat16()\n"
    (package / "newton_schulz_triton.py").write_text(
        ns.format("newton_schulz_triton") + ns.format("zeropower_via_newtonschulz5")
    )
    (package / "polar_express.py").write_text(ns.format("polar_express"))
    before = set(sys.modules)
    yield str(tmp_path)
    for name in set(sys.modules) - before:
        if name == "dion" or name.startswith("dion."):
            del sys.modules[name]


@pytest.mark.timeout(60)
def test_a_dion_checkout_adds_its_muon_variants_and_its_ns_functions_as_rows(
    dion_checkout, tmp_path
):
    path = tmp_path / "rows.json"
    code, out = run_main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--sets",
            "dense",
            "--shapes",
            "8x12",
            "--triton-tiles",
            "--dion",
            dion_checkout,
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    steps = {r["optimizer"]: r for r in data["steps"]}
    assert (
        code == 0 and steps["dion.Muon"]["error"] is None and "dion.Muon use_triton=True" in steps
    )
    assert steps["dion.Muon"]["equal_muon_ref"] is None  # another update rule: not compared
    kernels = [r["kernel"] for r in data["kernels"]]
    assert kernels[-3:] == [
        "dion newton_schulz_triton",
        "dion zeropower_via_newtonschulz5",
        "dion polar_express",
    ]
