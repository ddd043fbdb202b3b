"""An example of a project keeping "our Muon conforms to muon_ref under preset keller" as a test in its own suite
(docs/conformance.md, "In your own tests"). Copy it into your tests and put your optimizer where muon.SingleDeviceMuon
(KellerJordan's Muon, PyPI muon-optimizer) is, and name the plugin in your top-level conftest.py:
    pytest_plugins = ["muon_check.pytest_plugin"]      # the muon_check fixture, --muon-device
(this repository's tests/conftest.py registers it the same way). `pytest -m gpu` runs the gpu test on the node's
GPU (device "cuda").
"""

import pytest

from muon_check.adapters.cases import SINGLE_FAMILIES
from muon_check.api import check

muon = pytest.importorskip("muon", reason="muon-optimizer is not installed (pip install -e .[dev])")
FAMILIES_BUT_CONV = tuple(sorted(SINGLE_FAMILIES - {"conv4d"}))


def test_our_muon_conforms_through_the_api():
    """The API: a report to assert on, read or save (report.json())."""
    report = check(
        muon.SingleDeviceMuon, claim="keller", families=("tall", "square"), world_sizes=(1,)
    )
    report.assert_conforms()
    assert report.verdict == "conforms" and all(c["status"] == "bitwise" for c in report.cases)


def test_our_muon_conforms_through_the_fixture(muon_check):
    """The fixture: the same check on the test's device (cpu here; cuda under the gpu marker)."""
    muon_check.assert_conforms(
        muon.SingleDeviceMuon, claim="keller", families=("wide",), world_sizes=(1,)
    )


@pytest.mark.gpu
def test_our_muon_conforms_on_the_gpu(muon_check):
    """On a GPU node (`pytest -m gpu`): params, gradients and the reference on CUDA, in every single-device family
    but conv4d: muon-optimizer 0.1.0 views a 4-D update as a matrix and adds that matrix to the 4-D param, which
    raises (docs/public-muons.md); a project whose Muon takes conv weights keeps conv4d in."""
    muon_check.assert_conforms(
        muon.SingleDeviceMuon, claim="keller", families=FAMILIES_BUT_CONV, world_sizes=(1,)
    )


def test_our_training_setup_routes_as_it_claims(muon_check):
    """A training setup (here the project's own FSDP2 + DistributedMuon + AdamW): every param routed, split and
    orthogonalised as claimed, on 2 gloo ranks."""
    muon_check.assert_audit_clean("muon_check.adapters.setups:DistributedMuonFSDP", world_size=2)
