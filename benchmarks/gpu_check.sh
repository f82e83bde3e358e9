#!/usr/bin/env bash
# The GPU check (issue 23 item 6), sized for under 8 minutes on one large GPU: keras-dist against raw Keras on
# ResNet-50 and a small transformer (float32, mixed precision, mixed precision + XLA) and the all-reduce bus
# bandwidth of 2 logical GPUs carved from one. Writes JSON to $1 (default benchmarks/results/gpu_check.json).
#   bash benchmarks/gpu_check.sh [out.json] [gpu_check.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu_check.json}
shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
python -c 'import keras, tensorflow as tf; print("keras", keras.__version__, "tensorflow", tf.__version__, tf.config.list_physical_devices("GPU"))'
timeout --signal=INT 470 python benchmarks/gpu_check.py --budget-s 440 --json "$out" "$@"
echo "gpu_check: wrote $out"
