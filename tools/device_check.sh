#!/usr/bin/env bash
# One prepared script for a CUDA machine: kernel correctness on the real backend, then the kernel
# benchmark (copy bandwidth measured in the same run). Uses the machine's own python3 with its
# torch + triton (nothing is installed); results land in ${OUT:-bench-out}/.
# Usage, from the repository root:  bash tools/device_check.sh
set -euo pipefail
out="${OUT:-bench-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
"$py" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_triton.py 2>&1 | tee "$out/kernel-tests.txt" || true
"$py" tools/bench_kernels.py --json-out "$out/int2-kernels.json" 2>&1 | tee "$out/int2-kernels.txt"
"$py" tools/bench_kernels.py --clip 0 --json-out "$out/int2-kernels-noclip.json" 2>&1 | tee "$out/int2-kernels-noclip.txt"
