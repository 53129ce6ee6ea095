"""Shim of ``verl/utils/kernel/linear_cross_entropy.py``: the kernel under test is
``lmhead_torch``'s drop-in (see tests/upstream/README.md)."""

from lmhead_torch import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
