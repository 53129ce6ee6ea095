"""Runs SkyRL's test files of its fused LM-head log-prob unmodified against ``lmhead_torch``
(origin, commit and licence: tests/upstream/README.md).

- ``shim/`` goes first on ``sys.path`` (and ``PYTHONPATH``, for the processes the tests spawn):
  its ``skyrl`` package makes SkyRL's fused ops ``lmhead_torch``'s drop-ins and keeps SkyRL's own
  references (copied verbatim) as the tests' references.
- The files need CUDA (and import triton): without a GPU the library supports they are not
  collected (the report header says so); on one they carry the ``gpu`` marker.
- ``test_fused_linear_logprob.py`` runs under both fp32 contracts (``precision=bf16``, the
  default, and ``precision=split``); the triton file selects ``split`` itself for its fp32
  cases through the flag it sets (``FORCE_FP32_IEEE_PRECISION``).
- The cases whose bound our contract does not meet are marked expected-to-fail, each with the
  reason (README: the list with the numbers); their assertions are not touched.
"""

import os
import sys

import pytest
import torch

import lmhead_torch as L

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "shim")
sys.path.insert(0, SHIM)
os.environ["PYTHONPATH"] = SHIM + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")

GPU = L.gpu_supported()
collect_ignore_glob = [] if GPU else ["test_*.py"]

BF16_REFERENCE = (
    "SkyRL's _reference_fb computes the logits in bf16 (hidden @ weight.T of bf16 operands) and holds the op "
    "to 1e-5 of that: the bound measures the reference's rounding (up to ~7e-3), while the op is within ~2e-5 of "
    "float64; tests/test_skyrl_port.py holds it to float64 and prints both deviations"
)
FP32_WEIGHT = (
    "precision='bf16' (the default) rounds an fp32 weight to bf16 once per call, for the bf16 path's speed; "
    "SkyRL's bounds (1e-5 forward) assume fp32 logits; the same case runs again under precision=split"
)


def pytest_configure(config):
    config.addinivalue_line("markers", "megatron: SkyRL's marker for its Megatron GPU suite")


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__ == "test_fused_linear_logprob" and "lmhead_precision" in metafunc.fixturenames:
        metafunc.parametrize("lmhead_precision", ["bf16", "split"], indirect=True, ids=lambda m: f"precision={m}")


@pytest.fixture(autouse=True)
def lmhead_precision(request):
    mode = getattr(request, "param", None)
    if mode is None:
        yield None
        return
    old = os.environ.get("LMHEAD_TEST_PRECISION")
    os.environ["LMHEAD_TEST_PRECISION"] = mode
    L.set_precision(mode)
    try:
        yield mode
    finally:
        L.set_precision("bf16")
        if old is None:
            os.environ.pop("LMHEAD_TEST_PRECISION", None)
        else:
            os.environ["LMHEAD_TEST_PRECISION"] = old


def _expected_failure(item):
    if item.module.__name__ != "test_fused_linear_logprob":
        return None
    p = getattr(item, "callspec", None)
    p = p.params if p is not None else {}
    name = item.originalname
    if name == "test_fused_matches_materialized_logits" and p.get("hidden_dtype") == torch.bfloat16 and p.get("weight_dtype") == torch.bfloat16:
        return BF16_REFERENCE
    fp32_weight = (name == "test_fused_matches_materialized_logits" and p.get("weight_dtype") == torch.float32) or name in (
        "test_fused_matches_materialized_logits_edge_cases",
        "test_fused_linear_logprob_tp",
    )
    if fp32_weight and p.get("lmhead_precision") == "bf16":
        return FP32_WEIGHT
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not str(item.fspath).startswith(HERE):
            continue
        item.add_marker(pytest.mark.gpu)
        reason = _expected_failure(item)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
