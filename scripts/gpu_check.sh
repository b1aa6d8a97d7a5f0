#!/usr/bin/env bash
# f8dist on a CUDA machine, one command: the figures docs/performance.md records for a GPU.
#
#   bash scripts/gpu_check.sh [OUTDIR]            # every part; logs and CSVs under OUTDIR
#   PARTS="bench train" bash scripts/gpu_check.sh # some parts
#
# Parts (in this order, timings first so nothing else runs beside them):
#   env    the device, driver and torch
#   block  scripts/cuda_block_check.py: CUDA's block-scaled gemms against f8dist's exact CPU kernel
#          on the same float8 data, and a Float8Linear per block recipe on CUDA against the CPU,
#          eager and compiled: DeepSeek's blocks ("blockwise") on sm90, MXFP8 ("mxfp8",
#          "mxfp8_wgrad_with_hp", "mxfp8_square_weights") and NVFP4 ("nvfp4": dense gemms, the
#          grouped one's refusal) on sm100+; the kernel the GPU lacks is skipped with its reason
#          printed
#   bench  bench_matmul and bench_linear on the LLaMa-2-70B shapes, compiled: bf16 vs f8dist vs
#          torchao in one run (torchao's columns when it is importable; BENCH_RECIPES picks)
#   train  scripts/train.py, bf16 and each float8 recipe, compiled, one process: tps and memory
#          (TRAIN_RECIPES and TRAIN_STEPS pick)
#   bytes  scripts/bench_bytes.py on CUDA (inductor's byte accounting with Triton kernels)
#   tests  the test suite with CUDA as the default device (tests/conftest.py; the block-scaled
#          recipes' tests stay on the CPU, checked against CUDA by the block part); the multi-process
#          tests run on gloo (NCCL needs one GPU per rank, so they stay on the CPU ranks of gloo
#          where there is one GPU)
#
# No install is needed: the repository goes on PYTHONPATH (GPU machines without a registry).
# torch >= 2.11 with CUDA; pytest-xdist, when present, spreads the tests over the CPU cores.
# Each part's exit status is printed; the script exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# every part needs CUDA: without it, one line and nothing else (the train part would otherwise
# train a compiled 270M-parameter model on the CPU)
PYTHONPATH="$PWD/scripts" "$py" -c "import sys; from bench_common import cuda_missing; why = cuda_missing()
sys.exit(why and f'gpu_check.sh: needs CUDA and {why}; on a CPU run the scripts one by one (README.md)')" || exit 2
out=${1:-gpu_check}
parts=${PARTS:-env block bench train bytes tests}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the block recipes this GPU has a kernel for ([Note: the block-scaled gemm] in f8dist/core/gemm.py):
# DeepSeek's blocks on sm90, MXFP8 on sm100+, none elsewhere
major=$("$py" -c "import torch; print(torch.cuda.get_device_capability()[0])" 2>/dev/null || echo 0)
if [ "$major" -eq 9 ]; then block_recipes="blockwise"
elif [ "$major" -ge 10 ]; then block_recipes="mxfp8 mxfp8_square_weights"
else block_recipes=""; fi
bench_recipes=${BENCH_RECIPES:-tensorwise rowwise rowwise_with_gw_hp $block_recipes}
train_recipes=${TRAIN_RECIPES:-none tensorwise rowwise rowwise_with_gw_hp delayed $block_recipes}
failed=()

part() {  # part NAME CMD...: run, log to OUTDIR/NAME.log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee -a "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

wants() { [[ " $parts " == *" $1 "* ]]; }

if wants env; then
  part env nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  part env "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
fi

if wants block; then
  part block "$py" scripts/cuda_block_check.py --csv "$out/block.csv"
fi

if wants bench; then
  part bench "$py" scripts/bench_matmul.py --shapes llama70b --device cuda --csv "$out/matmul.csv"
  part bench "$py" scripts/bench_linear.py --shapes llama70b --device cuda --modes compile \
    --recipes $bench_recipes --csv "$out/linear.csv"
fi

if wants train; then
  for recipe in $train_recipes; do
    part train "$py" scripts/train.py --float8 "$recipe" --compile --steps "${TRAIN_STEPS:-40}" --log-every 10 \
      --dim 2048 --n-layers 4 --n-heads 16 --seq-len 2048 --batch-size 8 --warmup-steps 5 \
      --ffn-dim-multiplier 1.5  # FFN 8192 wide: whole 128-blocks for the block-scaled recipes
  done
fi

if wants bytes; then
  # the block recipes with a CUDA gemm on this GPU ($block_recipes, chosen above)
  part bytes "$py" scripts/bench_bytes.py --device cuda --csv "$out/bytes.csv" \
    --recipes tensorwise rowwise rowwise_with_gw_hp delayed delayed_rescaled $block_recipes
fi

if wants tests; then
  xdist=()
  "$py" -c "import xdist" 2>/dev/null && xdist=(-n "${JOBS:-8}")
  part tests env F8DIST_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" tests
fi

if [ ${#failed[@]} -ne 0 ]; then
  echo "gpu_check: failed parts: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all parts passed ($parts)"
