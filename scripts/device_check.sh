#!/usr/bin/env bash
# One prepared device check for kvtier's GPU data path (issues 6 and 11).
#
# Run from the repository root on a machine with a GPU:  scripts/device_check.sh
# Installs nothing (the device machine may have no network). It reports what is there
# (GPU, nvcc, python, torch+CUDA, cupy, kvikio), compiles the kernels with nvcc, prints the
# nvme backend / hbm availability the daemon would see, runs the GPU tests (tests/gpu:
# kernels, streams, test_hbm.py, test_kvikio.py), the vLLM connector's worker side on real
# CUDA tensors (test_gpu_connector.py: registered arena, load/save streams, HBM device
# views; vLLM itself is not needed) and the bandwidth benchmark (incl. connector load/save
# GB/s against cudaMemcpyAsync of the same bytes), and writes
# everything under $OUT (default ./device-check-out). KVTIER_GPU_TEST_DIR (default
# $BENCH_DIR) puts test_kvikio.py's slot files on a disk-backed directory. Use KVTIER_PY=/path/to/python to pick the interpreter
# (e.g. a carried virtual environment); default: .venv-gpu/bin/python if present,
# else python3. Exit status: 0 all ran and passed, 1 something failed, 2 no usable GPU.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-$REPO/device-check-out}
mkdir -p "$OUT"
LOG="$OUT/summary.txt"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

if [ -n "${KVTIER_PY:-}" ]; then PY=$KVTIER_PY
elif [ -x .venv-gpu/bin/python ]; then PY=.venv-gpu/bin/python
else PY=python3; fi

say "== environment ($(date -u +%FT%TZ))"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
else
  say "nvidia-smi: absent"
fi
command -v nvcc >/dev/null 2>&1 && say "nvcc: $(nvcc --version | tail -1)" || say "nvcc: absent"
say "python: $PY ($("$PY" --version 2>&1))"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$LOG"
import importlib
for name in ("torch", "cupy", "kvikio", "numpy", "pytest"):
    try:
        mod = importlib.import_module(name)
        extra = ""
        if name == "torch":
            extra = f" cuda={mod.version.cuda} available={mod.cuda.is_available()}"
        if name == "cupy":
            extra = f" devices={mod.cuda.runtime.getDeviceCount()}"
        print(f"{name}: {getattr(mod, '__version__', '?')}{extra}")
    except Exception as exc:
        print(f"{name}: MISSING ({type(exc).__name__}: {exc})")
PYEOF

# kvtier.kernels lives in ./kernels (setuptools package-dir). Without an install, build
# a throwaway import shim: kvtier/ = links to the repo's kvtier/* plus kernels/ and
# connectors/, and tests/ beside it. Nothing may put the repo root ahead of the shim (its
# own kvtier/ has no kernels): not the cwd (PYTHONSAFEPATH), and not pytest, which adds
# it for pyproject's `pythonpath = ["."]` and, in its default import mode, as the parent of
# the tests package (found by review: every GPU test failed to collect, "No module named
# 'kvtier.kernels'", and the check exited 1 as if the GPU had failed).
PYTEST_IMPORT=()
if ! "$PY" -c "import kvtier.kernels" >/dev/null 2>&1; then
  SHIM=$(mktemp -d)
  trap 'rm -rf "$SHIM"' EXIT
  mkdir "$SHIM/kvtier"
  for entry in "$REPO"/kvtier/*; do ln -s "$entry" "$SHIM/kvtier/$(basename "$entry")"; done
  ln -s "$REPO/kernels" "$SHIM/kvtier/kernels"
  [ -d "$REPO/connectors" ] && ln -s "$REPO/connectors" "$SHIM/kvtier/connectors"
  ln -s "$REPO/tests" "$SHIM/tests"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONSAFEPATH=1  # keep the repo's own kvtier/ (cwd) from shadowing the shim
  PYTEST_IMPORT=(--import-mode=importlib -o pythonpath=)
  say "kvtier not installed: using import shim $SHIM"
fi

status=0
say "== nvcc check"
if command -v nvcc >/dev/null 2>&1; then
  "$PY" -m kvtier.kernels.build --arch sm_90 2>&1 | tee -a "$LOG" "$OUT/nvcc.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  say "skipped (no nvcc)"
fi

say "== tier backends (what the daemon would pick here)"
"$PY" - <<'PYEOF' 2>&1 | tee -a "$LOG"
from kvtier.tiers.hbm import hbm_available
from kvtier.tiers.nvme.backends import cuda_driver_status, select_nvme_backend
print(f"cuda driver: {cuda_driver_status()}")
print(f"nvme.backend=auto -> {select_nvme_backend('auto')}")
print(f"hbm available (device 0): {hbm_available(0)}")
try:
    import kvikio
    from kvtier.tiers.nvme.kvikio_io import kvikio_mode
    print(f"kvikio mode: {kvikio_mode(kvikio)}")
except ImportError:
    pass
PYEOF

say "== GPU tests (kernels, streams, hbm tier + CUDA IPC, nvme through kvikio)"
# kvikio's GDS path needs a disk-backed directory (tmpfs only runs its compat mode)
export KVTIER_GPU_TEST_DIR=${KVTIER_GPU_TEST_DIR:-${BENCH_DIR:-}}
"$PY" -m pytest ${PYTEST_IMPORT[@]+"${PYTEST_IMPORT[@]}"} -m gpu tests/gpu -q -rs -p no:cacheprovider \
  --ignore=tests/gpu/test_gpu_connector.py \
  --junitxml="$OUT/gpu-tests.xml" >"$OUT/gpu-tests.txt" 2>&1
rc=$?
tail -15 "$OUT/gpu-tests.txt" | tee -a "$LOG"
if grep -q "no GPU:" "$OUT/gpu-tests.txt" && ! grep -qE "[0-9]+ passed" "$OUT/gpu-tests.txt"; then
  say "GPU tests SKIPPED: no usable GPU (see reasons above)"
  status=2
elif [ $rc -ne 0 ]; then
  status=1
fi

say "== vLLM connector worker side on the GPU (issue 11)"
"$PY" -m pytest ${PYTEST_IMPORT[@]+"${PYTEST_IMPORT[@]}"} -m gpu tests/gpu/test_gpu_connector.py -q -s -rs \
  -p no:cacheprovider \
  --junitxml="$OUT/connector-tests.xml" >"$OUT/connector-tests.txt" 2>&1
rc=$?
grep -E "arena registration|passed|failed|error|skipped|no GPU" "$OUT/connector-tests.txt" \
  | tail -15 | tee -a "$LOG"
if [ $rc -ne 0 ] && ! grep -q "no GPU:" "$OUT/connector-tests.txt"; then status=1; fi

say "== bandwidth benchmark"
"$PY" benchmarks/bench_gpu.py --json "$OUT/bench.json" --dir "${BENCH_DIR:-/tmp}" \
  >"$OUT/bench.txt" 2>&1
rc=$?
tee -a "$LOG" <"$OUT/bench.txt"
if [ $rc -eq 2 ]; then [ $status -eq 0 ] && status=2
elif [ $rc -ne 0 ]; then status=1; fi

say "== done: exit $status"
exit $status
