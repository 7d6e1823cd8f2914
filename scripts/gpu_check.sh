#!/usr/bin/env bash
# The GPU path in one go, a few minutes on one GPU. From the course folder, on a machine with an NVIDIA GPU:
#
#     scripts/gpu_check.sh                  # .venv/bin/python if there (make .venv/.installed), else python3
#     PY=/path/to/python scripts/gpu_check.sh
#
#   1. the machine: what nvidia-smi lists, what torch sees, the doctor's torch and gpus rows
#   2. tests/test_gpu.py: stages 0-3 and CPU offload at world size 1 on one GPU over NCCL, against a
#      single-process CPU run, zeroedu.theory and the CUDA allocator; with 2+ GPUs every multi-GPU test too
#   3. with 2+ GPUs: examples/torchrun_allreduce.py under torchrun, over NCCL
#
# Exit status 0 only when every step passed and GPU tests really ran (a run where all of them skipped fails).
# This checkout's zeroedu is used from source (PYTHONPATH), installed or not. Reports land in out/gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${ZEROEDU_GPU_CHECK_OUT:-out/gpu_check}"
mkdir -p "$OUT"
start=$(date +%s)
fail() { echo "gpu_check: FAIL: $*"; exit 1; }

echo "== 1. the machine"
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)") ||
    fail "$PY cannot import torch: make .venv/.installed (it installs the CUDA build where nvidia-smi is found)"
"$PY" - <<'EOF'
import torch
import torch.distributed as dist

from zeroedu import doctor

print(f"torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'} build), "
      f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s) visible, "
      f"NCCL {'available' if dist.is_nccl_available() else 'missing'}")
for row in (doctor.check_torch(), doctor.check_gpus()):
    print(f"doctor {row.check}: {row.status}: {row.detail}" + (f" -- fix: {row.fix}" if row.fix else ""))
EOF
[ "$gpus" -ge 1 ] || fail "torch sees no GPU, so no GPU test can run. Where nvidia-smi lists a GPU, install the CUDA
build of the pinned torch (pip install torch==<pin>: PyPI's Linux wheel is the CUDA build), then run this again."

echo "== 2. GPU tests ($gpus GPU(s))"
"$PY" -m pytest -q -rs -p no:cacheprovider -m gpu --junitxml "$OUT/junit.xml" tests/test_gpu.py 2>&1 |
    tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail "GPU tests failed (pytest exit $rc; output in $OUT/pytest.txt)"
"$PY" - "$OUT/junit.xml" <<'EOF' || fail "no GPU test ran (see the skip reasons above)"
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
tests = sum(int(s.get("tests", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(f"gpu tests: {tests - skipped} ran, {skipped} skipped")
sys.exit(0 if tests > skipped else 1)
EOF

if [ "$gpus" -ge 2 ]; then
    n=$(( gpus < 4 ? gpus : 4 ))
    echo "== 3. torchrun --nproc-per-node $n over NCCL"
    "$PY" -m torch.distributed.run --nproc-per-node "$n" examples/torchrun_allreduce.py 2>&1 | tee "$OUT/torchrun.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail "torchrun failed (output in $OUT/torchrun.txt)"
    "$PY" - "$OUT/torchrun.txt" "$n" <<'EOF' || fail "torchrun: not every rank saw the sum 1 + ... + $n over NCCL"
import re
import sys

text, n = open(sys.argv[1]).read(), int(sys.argv[2])
want = n * (n + 1) / 2
lines = re.findall(r"all_reduce sums \[([^\]]*)\] expected ([\d.]+) backend (\w+)", text)
good = [s for s, e, b in lines if b == "nccl" and float(e) == want and [float(v) for v in s.split(",")] == [want] * n]
print(f"torchrun: {len(good)} of {n} ranks saw all_reduce sums of {want:g} over NCCL")
sys.exit(0 if len(good) == n else 1)
EOF
else
    echo "== 3. torchrun: skipped (needs 2 GPUs, this machine has $gpus)"
fi
echo "gpu_check: PASS in $(( $(date +%s) - start )) s"
