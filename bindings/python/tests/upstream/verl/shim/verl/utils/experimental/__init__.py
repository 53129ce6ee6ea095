"""Shim package for running verl's tests unmodified (see tests/upstream/README.md)."""
