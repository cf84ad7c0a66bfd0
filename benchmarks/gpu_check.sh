#!/usr/bin/env bash
# GPU check kit: prove distlab's CUDA paths on a real GPU in one short run (< 10 min).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# Runs config/gpu_check.yaml through Snakemake in its own work folder (build/gpu_check,
# so the default config's CPU experiments are not merged in): DDP over NCCL with bf16,
# DeepSpeed ZeRO-3 with CPU offload, FSDP2 with mixed precision, a run under a memory
# budget that must end in a recorded OOM, checkpoint validation of those runs; MFU
# against the datasheet peak of the board at the run's precision (distlab.tools.hardware
# GPU_PEAKS; H200 dense bf16: 989.5e12), or a measured matmul probe for an unknown board.
# First a preflight (distlab/tools/gpu_preflight.py) says exactly what is missing, if anything.
# Everything lands in OUT_DIR (default: $OUT, else build/gpu_check_out), one folder to
# copy back whole. Without a CUDA GPU it says so in one line and exits 2.
#
# Packages the GPU machine lacks travel as wheels in .whl/ (see benchmarks/gpu_wheels.sh);
# they are installed into /tmp/site, nothing is fetched there.
#
# DISTLAB_KIT_CPU_REHEARSAL=1 rehearses the whole kit on a machine without a GPU: the same
# steps with config/gpu_check_cpu_rehearsal.yaml merged over the kit's config (CPU ranks, a
# tiny model) and no CUDA check; tests/test_gpu_rehearsal.py runs it with the box's versions.
# KIT_WHEELS, KIT_SITE and KIT_WORK move the wheel folder, the install target and the work folder.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=${1:-${OUT:-$REPO/build/gpu_check_out}}
REHEARSAL=${DISTLAB_KIT_CPU_REHEARSAL:-0}
WHEELS=${KIT_WHEELS:-.whl}
SITE=${KIT_SITE:-/tmp/site}
# Snakemake's timeout: the box stops a command after 10 minutes; the wheels, the preflight and
# the summary get the rest. config/gpu_check.yaml plans its serial GPU jobs at <= 70% of it
# (tests/test_gpu_check.py).
SNAKEMAKE_CAP_S=520
WORK=${KIT_WORK:-$REPO/build/gpu_check}
PY=${PYTHON:-python3}
CONFIGS=("$REPO/config/gpu_check.yaml")
PREFLIGHT_ARGS=(--min-free-gib "${DISTLAB_MIN_FREE_GIB:-8}")
if [ "$REHEARSAL" = 1 ]; then
  CONFIGS+=("$REPO/config/gpu_check_cpu_rehearsal.yaml")
  PREFLIGHT_ARGS=(--cpu-rehearsal)
fi

kit_started=$(date +%s)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=$SITE
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
# Preflight (distlab/tools/gpu_preflight.py): torch >= the project's lowest, every import the
# jobs need and their own requirements, the torch APIs used, CUDA and free memory. It says
# exactly what is missing; 2 = no CUDA GPU, 3 = something else is missing.
"$PY" -m distlab.tools.gpu_preflight "${PREFLIGHT_ARGS[@]}"
preflight=$?
[ $preflight -eq 0 ] || exit $preflight
mkdir -p "$WORK" "$OUT_DIR"
# Snakemake only counts GPUs: give it the real total so no job is planned past it.
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
{
  echo "date: $(date -u +%FT%TZ)"
  [ "$REHEARSAL" = 1 ] && echo "CPU rehearsal: no GPU was used; no figure below is a GPU figure"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers, accelerate, huggingface_hub, safetensors, tokenizers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'huggingface_hub', huggingface_hub.__version__, 'safetensors', safetensors.__version__, 'tokenizers', tokenizers.__version__)"
  "$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
} > "$OUT_DIR/versions.txt" 2>&1

start=$(date +%s)
echo "before Snakemake (wheels, preflight, versions): $(( start - kit_started )) s" >> "$OUT_DIR/versions.txt"
timeout "$SNAKEMAKE_CAP_S" "$PY" -m snakemake -s "$REPO/Snakefile" -d "$WORK" --configfile "${CONFIGS[@]}" \
  --cores all --resources gpu="$GPUS" --keep-going --rerun-incomplete > "$OUT_DIR/snakemake.log" 2>&1
status=$?
echo "snakemake exit $status after $(( $(date +%s) - start )) s" | tee -a "$OUT_DIR/versions.txt"

# One folder to copy back: summary, report, every run's metrics/validation, the logs.
cp "$WORK/results/summary.csv" "$OUT_DIR/" 2>/dev/null
cp -r "$WORK/results/report" "$OUT_DIR/" 2>/dev/null
(cd "$WORK/results" && tar czf "$OUT_DIR/runs.tgz" --exclude='checkpoint*' --exclude='*.safetensors' \
   --exclude='*.pt' --exclude='prep' . 2>/dev/null)
# The figures a reader wants, from the results (distlab/tools/gpu_summary.py): tokens/s, MFU and
# its peak, peak memory, the recorded OOM, checkpoint validations, NCCL bandwidth. Every run
# the config plans is listed with its status; a failed or missing one makes the kit fail.
: > "$OUT_DIR/figures.txt"
[ "$REHEARSAL" = 1 ] && echo "CPU rehearsal: no GPU was used; no figure here is a GPU figure" | tee "$OUT_DIR/figures.txt"
"$PY" -m distlab.tools.gpu_summary "$WORK/results" --configfile "${CONFIGS[@]}" --gpus "$GPUS" | tee -a "$OUT_DIR/figures.txt"
summary_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] && exit "$status"
exit "$summary_status"
