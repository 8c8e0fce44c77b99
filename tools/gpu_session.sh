#!/usr/bin/env bash
# The GPU checks of one session on a GPU machine, in one go (pytest -v: each test's result is in the log as it ends,
# even when the time limit stops the suite): versions and the device, the GPU smoke suite (tests/gpu,
# its tests side by side on the GPU(s) with pytest-xdist), the step budget on the GPU (benchmarks/step_budget.py:
# host syncs, collectives and operators per step, any other sync an error), then the GPU throughput benchmark alone
# on the machine (benchmarks/gpu_speed.py). Figures are appended to results/ (RESULTS.md: benchmarks/results.py). Logs go to $OUT (default gpu_out/). Needs torch with CUDA and the project's
# dependencies importable (PYTHONPATH may point at packages installed elsewhere); the repository root is added here.
#
#   bash tools/gpu_session.sh         # SMOKE_S / BUDGET_S / BENCH_S: time limits; BENCH_ARGS: benchmark arguments
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PY" - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import platform, torch, lightning, lhotse
from importlib.metadata import version
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| lightning", lightning.__version__, "| megatron-core", version("megatron-core"), "| lhotse", lhotse.__version__)
print("devices:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
      "| bf16:", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
PY
parallel=$("$PY" -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-6}")
start=$(date +%s)
# shellcheck disable=SC2086
timeout "${SMOKE_S:-240}" "$PY" -m pytest -v tests/gpu -rs --tb=short -p no:cacheprovider $parallel \
    --junitxml="$OUT/smoke.xml" 2>&1 | tee "$OUT/smoke.log"
echo "smoke suite: $(( $(date +%s) - start )) s" | tee -a "$OUT/smoke.log"
start=$(date +%s)
gpus=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")
for family in ctc hybrid tts salm; do
    timeout "${BUDGET_S:-60}" "$PY" benchmarks/step_budget.py --family "$family" --accelerator gpu \
        --devices "$gpus" --cuda-sync-errors 2>&1 | tee -a "$OUT/step_budget.log"
done
echo "step budget: $(( $(date +%s) - start )) s" | tee -a "$OUT/step_budget.log"
start=$(date +%s)
# shellcheck disable=SC2086
timeout "${BENCH_S:-200}" "$PY" benchmarks/gpu_speed.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
echo "benchmark: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log"
