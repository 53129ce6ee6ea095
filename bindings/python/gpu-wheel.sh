#!/usr/bin/env bash
# Build the abi3 wheel (CPython >= 3.9) into bindings/python/dist/, to carry to a GPU machine that
# has Python and torch but no Rust and no network (see run-gpu-tests.sh). The wheel embeds the
# kernels as an sm_90a cubin and links neither libtorch nor libcuda.
#
# Linked through zig (PyPI's `ziglang`) for glibc 2.28, the floor of PyPI's torch wheels
# (manylinux_2_28); a plain build on Debian 12 would need glibc 2.34. LMHEAD_WHEEL_ZIG=0 builds
# with the host linker instead.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q maturin==1.16.0
rm -rf dist
if [ "${LMHEAD_WHEEL_ZIG:-1}" != "0" ]; then
    pip install -q ziglang==0.17.1
    maturin build --release --zig --compatibility manylinux_2_28 --out dist
else
    maturin build --release --out dist
fi
ls -l dist
