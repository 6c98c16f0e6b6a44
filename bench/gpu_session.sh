#!/bin/bash
# One GPU session's measurements as two prepared calls (docs/BENCHMARKS.md, "GPU"). A lent GPU has
# 15 minutes of machine time in all, start-ups included, so each call runs under a budget of its
# own, each part under its own limit; a part that no longer fits is skipped with a line saying so.
#
#   CALL=1 bash bench/gpu_session.sh OUTDIR [WHEELDIR]   # <= 8 min: DeepSpeed's ops; tokens/s and
#          MFU of finetune vs HF Trainer at Llama-3.2-1B's shape, full rows of 2048 tokens, in three
#          settings (the defaults, Liger's kernels, ZeRO-3's thresholds raised); then --async_save's
#          P2, P2b, P2c and P3b (bench/save/async_save.py)
#   CALL=2 bash bench/gpu_session.sh OUTDIR [WHEELDIR]   # <= 4 min: DeepSpeed's ops (unless call 1
#          left them built), then the GPU suite (tests/gpu), four tests at a time
#
# PARTS="ops throughput async-save gpu-suite" names the parts to run instead of a CALL's.
# BUDGET_S: the call's seconds, parts included, setup too (default 465 for call 1, 230 for call 2).
#
# WHEELDIR (default .whl): the wheels the machine lacks, installed into a venv that sees the image's
# torch. Made here, about 21 MB, and carried with the call (carry: [".whl"]):
#   pip download --no-deps -d .whl deepspeed==0.19.8 transformers==5.24.0 datasets==5.2.0 dill \
#       multiprocess hjson pydantic pydantic_core annotated_types typing_inspection \
#       liger-kernel pytest-xdist execnet --python-version 3.12 --only-binary=:all:
# No flash-attn wheel: the throughput runs use sdpa.
#
# VENV=DIR uses an existing venv instead (a dry run on a machine without a GPU: VENV=.venv; every
# part then says it was skipped for want of CUDA, and the GPU suite's tests skip with their reason).
# Logs and JSON go to OUTDIR.
set -u
OUT=${1:?usage: CALL=1|2 gpu_session.sh OUTDIR [WHEELDIR]}
WHL=${2:-.whl}
mkdir -p "$OUT"
T0=$(date +%s)
case "${CALL:-}" in
    1) DEFAULT_PARTS="ops throughput async-save" BUDGET=${BUDGET_S:-465} ;;
    2) DEFAULT_PARTS="ops gpu-suite" BUDGET=${BUDGET_S:-230} ;;
    *) DEFAULT_PARTS="" BUDGET=${BUDGET_S:-900} ;;
esac
PARTS=" ${PARTS:-$DEFAULT_PARTS} "
if [[ $PARTS == "  " ]]; then
    echo "gpu_session: say CALL=1 or CALL=2 (or PARTS=...)" >&2
    exit 2
fi
stamp() { echo "=== +$(($(date +%s) - T0))s $*"; }
want() { [[ $PARTS == *" $1 "* ]]; }

# part NAME LIMIT NEEDS CMD...: CMD under min(LIMIT, the call's seconds left - 5); skipped when
# fewer than NEEDS seconds are left. Its exit status is printed; the call goes on either way.
part() {
    local name=$1 limit=$2 needs=$3
    shift 3
    local left=$((BUDGET - ($(date +%s) - T0) - 5))
    if ((left < needs)); then
        stamp "$name skipped: ${left}s of the call's ${BUDGET}s left, it needs ${needs}s"
        return 0
    fi
    ((limit > left)) && limit=$left
    stamp "$name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@"
    local rc=$?
    ((rc == 124)) && echo "$name: ran past its ${limit}s"
    echo "$name rc=$rc"
}

stamp "setup (call ${CALL:-custom}, budget ${BUDGET}s, parts:${PARTS})"
if [[ -n ${VENV:-} ]]; then
    export PATH=$PWD/$VENV/bin:$PATH
else
    # python3 there is itself a venv, so --system-site-packages would not see its torch: a .pth does.
    if [[ ! -x /tmp/v/bin/python ]]; then
        python3 -m venv /tmp/v || exit 1
        python3 -c 'import site; print(site.getsitepackages()[0])' \
            >"$(/tmp/v/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
        /tmp/v/bin/python -m pip install -q --no-index --no-deps --no-compile "$WHL"/*.whl || exit 1
    fi
    export PATH=/tmp/v/bin:$PATH TORCH_EXTENSIONS_DIR=/tmp/v/torch_extensions
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
echo "cores $(nproc)"
python - <<'EOF' || exit 1
import importlib.metadata as md
import torch
for n in ("torch", "deepspeed", "transformers", "datasets", "accelerate", "tokenizers",
          "pyarrow", "fsspec", "huggingface_hub", "safetensors", "triton", "peft",
          "liger_kernel", "pytest", "pytest_xdist"):
    try:
        print(n, md.version(n))
    except md.PackageNotFoundError:
        print(n, "missing")
if torch.cuda.is_available():
    print("cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
else:
    print("no CUDA device: the parts that need one are skipped")
import deepspeed, datasets, transformers, finetune  # noqa: F401  (fails the session early)
EOF
CUDA=$(python -c 'import torch; print(int(torch.cuda.is_available()))')
cuda_part() { # as part, when there is a GPU
    if [[ $CUDA != 1 ]]; then
        stamp "$1 skipped: no CUDA device"
        return 0
    fi
    part "$@"
}

if want ops; then
    # where torch's JIT puts a build: TORCH_EXTENSIONS_DIR/NAME, or ~/.cache/torch_extensions/pyXY_cuZ/NAME
    built="$HOME/.cache/torch_extensions/*/fused_adam*/*.so"
    [[ -n ${TORCH_EXTENSIONS_DIR:-} ]] && built="$TORCH_EXTENSIONS_DIR/fused_adam*/*.so"
    if compgen -G "$built" >/dev/null; then
        stamp "ops: FusedAdam is built already (an earlier call on this machine)"
    else
        cuda_part ops 70 30 python scripts/build_ops.py >"$OUT/ops.log" 2>&1
        tail -6 "$OUT/ops.log"
    fi
fi

if want throughput; then
    # Llama-3.2-1B's shape, full rows of 2048 tokens, one launch of each tool per setting
    for setting in default liger tuned; do
        if [[ $setting == liger ]] && ! python -c 'import liger_kernel' 2>/dev/null; then
            stamp "throughput-liger skipped: liger-kernel is not among the wheels"
            continue
        fi
        cuda_part "throughput-$setting" 90 60 python bench/train/train_throughput.py \
            --num_gpus 1 --precision bf16 --rounds 1 --setting "$setting" \
            --shape llama-3.2-1b --long_rows --max_seq_length 2048 --per_device_train_batch_size 8 \
            --steps 20 --warmup 10 --logging_steps 5 --threads_per_rank 0 --timeout 80 \
            --out "$OUT/throughput_$setting.json" >"$OUT/throughput_$setting.log" 2>&1
        tail -12 "$OUT/throughput_$setting.log"
    done
fi

if want async-save; then
    cuda_part async-save 115 60 python bench/save/async_save.py --num_gpus 1 --precision bf16 \
        --repeats 2 --bg_saves 2 --e2e_steps 20 --every 5 --e2e_repeats 1 --dir /tmp/async \
        --out "$OUT/async_save.json" >"$OUT/async.log" 2>&1
    tail -25 "$OUT/async.log"
fi

if want gpu-suite; then
    workers=()
    python -c 'import xdist' 2>/dev/null && workers=(-n 4)
    part gpu-suite 300 60 python -m pytest -q -ra -m gpu tests/gpu -p no:cacheprovider \
        "${workers[@]}" --durations=0 --timeout 170 >"$OUT/gpu_suite.log" 2>&1
    grep -E "passed|failed|PASSED|FAILED|SKIPPED|Error|s call" "$OUT/gpu_suite.log" | tail -30
fi
stamp done
