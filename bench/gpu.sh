#!/usr/bin/env bash
# Run the benchmark tables on a CUDA machine in one command:
#
#   bash bench/gpu.sh            # from the repository root, on a host with an NVIDIA GPU
#
# Creates .venv-gpu with jax[cuda12] (CUDA/cuDNN come as pip wheels; only the NVIDIA
# driver is needed), installs both packages, checks that JAX sees a GPU, then runs the
# same tables as on CPU and saves them as bench/results/*-gpu.md. wrk (apt-get install
# wrk) is needed for the throughput table; it is skipped with a note when absent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
JAX_EXTRA=${JAX_EXTRA:-cuda12}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "jax[$JAX_EXTRA]>=0.6,<0.11" -e ./clients/python[jax] -e .
fi
PY=$VENV/bin/python
# Several JAX processes share the GPU here (each bench process and its servers; six servers
# in the throughput table). By default each one grabs 75% of the GPU's memory at start-up
# and the second one fails, so allocate on demand instead.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$PY" -c "import jax; d = jax.devices(); print('devices:', d); assert d[0].platform == 'gpu', 'no GPU visible to JAX'"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" bench/hvp.py --save hvp-gpu.md
"$PY" bench/latency.py --quick --save latency-gpu.md
"$PY" bench/profile_wire.py --rounds 5 --save profile-wire-gpu.md
"$PY" bench/batching_bits.py | tee bench/results/batching-bits-gpu.md
"$PY" bench/cold_start.py --save cold-start-gpu.md
"$PY" bench/health_latency.py --n 4000 --save health-latency-gpu.md
if command -v wrk >/dev/null; then
  "$PY" bench/throughput.py --save throughput-gpu.md
  # a function with real work per request, where merging requests should pay on a GPU
  "$PY" bench/throughput.py --n 1000000 --save throughput-n1e6-gpu.md
  # opt-in rounding batching vs exact vs off, 32 clients
  "$PY" bench/batching_rounding.py --seconds 2 --rounds 3 --save batching-rounding-gpu.md
else
  echo "wrk not installed: throughput table skipped (apt-get install wrk)"
fi
echo "tables saved under bench/results/*-gpu.md"
