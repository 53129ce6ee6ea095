"""verl's two test scripts, unmodified, run against ``lmhead_torch`` (see conftest.py): each
passes when the script exits 0 (they assert with ``torch.testing.assert_close``)."""

import os
import subprocess
import sys

import pytest
import torch

import lmhead_torch as L

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "shim")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not L.gpu_supported(), reason="verl's scripts need a CUDA GPU the library supports")]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SHIM + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(cmd, timeout=1200):
    r = subprocess.run(cmd, cwd=HERE, env=_env(), capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-6000:])
    print(r.stderr[-6000:], file=sys.stderr)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _needs_flash_attn():
    # verl's reference (`run_verl_original_entropy`) passes labels of shape [1, T] with logits of
    # shape [T, V]; only verl's flash-attn branch of `logprobs_from_logits` reshapes them, its
    # torch branch (`logprobs_from_logits_v2`) raises "Index tensor must have the same number of
    # dimensions as input tensor". verl's CI has flash-attn; without it the script cannot run.
    try:
        import flash_attn.ops.triton.cross_entropy  # noqa: F401
    except Exception as e:  # ImportError, or a flash-attn built for another torch
        pytest.skip(f"verl's reference path needs flash-attn's cross entropy ({type(e).__name__}: {e})")


def test_linear_cross_entropy():
    """verl's ``tests/utils/test_linear_cross_entropy.py``: its five shapes, the kernel against
    torch, verl's own torch path and verl's fused torch path (forward atol 1e-3 rtol 2e-4 on
    log-probs, 5e-3 / 5e-4 on entropy; gradients atol 2e-2 rtol 4e-2). Skipped without
    flash-attn, which verl's reference path needs (``_needs_flash_attn``)."""
    _needs_flash_attn()
    _run([sys.executable, "test_linear_cross_entropy.py"])


def test_linear_cross_entropy_tp():
    """verl's ``tests/utils/test_special_linear_cross_entropy_tp.py`` under torchrun, two ranks."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, have {torch.cuda.device_count()}")
    _needs_flash_attn()
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2", "test_special_linear_cross_entropy_tp.py"])
