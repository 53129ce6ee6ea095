"""Shim package for running SkyRL's tests unmodified (see tests/upstream/README.md)."""
