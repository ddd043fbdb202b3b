"""apply_update's `out` contract on CUDA (run: pytest -m gpu): tests/test_apply_update_out.py's check, on a CUDA
device, where an op whose promoted dtype is wider than its out casts on store inside the kernel rather than through
a temporary as on CPU.

The GPU runs: docs/gpu.md.
"""

from __future__ import annotations

import pytest
import torch

from muon_ref import PRESETS
from tests.test_apply_update_out import DTYPES, assert_out_is_the_fresh_result

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("update_dtype", DTYPES, ids=str)
def test_apply_update_into_out_is_bitwise_the_fresh_result_on_cuda(
    preset, param_dtype, update_dtype
):
    assert_out_is_the_fresh_result(preset, param_dtype, update_dtype, device="cuda")
