#!/usr/bin/env bash
# On a GPU machine (Python >= 3.9 with a CUDA build of torch, no Rust, no network): install the
# wheel from dist/ into /tmp/site, run the GPU tests (PYTEST_ARGS adds options, e.g. -x) and the
# benchmark (BENCH_ARGS), each under a time limit (PYTEST_TIMEOUT, BENCH_TIMEOUT), and write the
# logs under $OUT. Run from a copy of bindings/python with dist/ built by gpu-wheel.sh.
set -euo pipefail
cd "$(dirname "$0")"
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
rm -rf /tmp/site
"$PYTHON" -m pip install --no-deps --target /tmp/site dist/*.whl 2>&1 | tee "$OUT/install.log"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# Optional comparison packages for the benchmark (e.g. liger-kernel, verl), as wheels in
# $EXTRA_WHEELS, installed without their dependencies (the benchmark imports only their kernels).
if [ -n "${EXTRA_WHEELS:-}" ] && ls "$EXTRA_WHEELS"/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/site-extra
    "$PYTHON" -m pip install -q --no-deps --no-index --target /tmp/site-extra "$EXTRA_WHEELS"/*.whl 2>&1 | tee -a "$OUT/install.log"
    export PYTHONPATH="$PYTHONPATH:/tmp/site-extra"
fi
(cd tests && "$PYTHON" - <<'PY') 2>&1 | tee "$OUT/info.txt"
import torch, lmhead_torch as L
from lmhead_torch import _native
print("lmhead_torch", L.__version__, "from", L.__file__)
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
print("supported:", L.gpu_supported())
if L.gpu_supported():
    print(L.device_info())
    print(_native.kernel_report(torch.cuda.current_device()))
PY
rc=0
# From tests/: the source tree's lmhead_torch/ (no native module) must not shadow /tmp/site.
(cd tests && timeout "${PYTEST_TIMEOUT:-1800}" "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu ${PYTEST_ARGS:-} . ) 2>&1 | tee "$OUT/pytest-gpu.log" || rc=$?
brc=0
(cd tests && timeout "${BENCH_TIMEOUT:-600}" "$PYTHON" -m lmhead_torch.bench --out "$OUT/bench.jsonl" ${BENCH_ARGS:-} ) 2>&1 | tee "$OUT/bench.md" || brc=$?
[ "$rc" -ne 0 ] || rc=$brc
echo "exit code $rc"
exit "$rc"
