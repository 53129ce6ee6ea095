#!/usr/bin/env bash
# CPU CI of the PyTorch package (no GPU needed): a venv under bindings/python/.venv with maturin,
# pytest, numpy and torch; the abi3 wheel built with maturin (release; this builds the lmhead
# crate and its kernels: stable + nightly Rust, ptxas from PyPI once); the wheel installed; the
# test suite run on CPU tensors (GPU tests skip with their reason). Exits non-zero on failure.
#
# torch: PyPI's Linux wheel (2.11.0, CUDA 13.0 build) cannot be imported without the NVIDIA
# libraries it links (libcudart, cuBLAS, cuDNN, cuFFT, cuSPARSE(Lt), cuRAND, cuFile, CUPTI, NCCL,
# NVSHMEM, NVRTC, nvJitLink: `import torch` fails on libcudart.so.13 with `--no-deps` alone), so
# this installs torch with --no-deps plus exactly those wheels and its pure-Python deps — not
# triton, cuSOLVER, cuda-bindings or NVTX, which `import torch` does not need (~2.3 GB of
# downloads instead of ~2.7 GB; ~3.5 GB in the venv).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.11.0
start=$(date +%s)
step() { echo "== [$(( $(date +%s) - start ))s] $*"; }

step "venv"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

step "python packages"
pip install -q maturin==1.16.0 pytest numpy
if ! python -c "import torch" >/dev/null 2>&1 || [ "$(python -c 'import torch; print(torch.__version__.split("+")[0])')" != "$TORCH_VERSION" ]; then
    pip install -q --no-deps "torch==$TORCH_VERSION"
    pip install -q filelock "typing-extensions>=4.10.0" "setuptools<82" "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5"
    pip install -q --no-deps \
        nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.1.0.3 nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 \
        nvidia-cuda-cupti==13.0.85 nvidia-curand==10.4.0.35 nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0 \
        nvidia-nccl-cu13==2.28.9 nvidia-nvshmem-cu13==3.4.5
fi
python -c "import torch, torch.distributed as d; assert d.is_gloo_available(); print('torch', torch.__version__, 'cuda available:', torch.cuda.is_available())"

step "wheel (maturin build --release)"
rm -rf target/wheels
maturin build --release
pip install -q --force-reinstall --no-deps target/wheels/lmhead_torch-*.whl

step "tests"
# From tests/: the source tree's lmhead_torch/ (without the native module) must not shadow the
# installed wheel.
cd tests
set +e
python -m pytest -q -rs -p no:cacheprovider . 2>&1 | tee ../.pytest.log
rc=${PIPESTATUS[0]}
set -e
cd ..
step "pytest exit code $rc"
grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* =+$" .pytest.log | tail -1 || true
exit "$rc"
