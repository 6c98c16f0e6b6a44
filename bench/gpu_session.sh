#!/bin/bash
# One GPU session's measurements, as one script (docs/BENCHMARKS.md, "GPU"): a lent GPU machine has
# minutes, not hours, so everything runs in one call, each part under its own time limit.
#
#   [PARTS="ops gpu-suite throughput async-save"] bash bench/gpu_session.sh OUTDIR [WHEELDIR]
#
# PARTS (default all four) picks the parts after setup, so a session with little device time left
# runs what it needs most.
#
# WHEELDIR (default .whl) holds the wheels the machine lacks (deepspeed, datasets and their needs,
# the transformers finetune is tested with); they go into a venv that sees the system's torch.
# Parts: versions; DeepSpeed's ops built side by side (FusedAdam, CPU Adam); the GPU suite
# (tests/gpu); tokens/s and MFU of finetune vs HF Trainer in bf16 (bench/train/train_throughput.py); the
# --async_save stall and interference (bench/save/async_save.py). Logs and JSON go to OUTDIR.
set -u
OUT=${1:?usage: gpu_session.sh OUTDIR [WHEELDIR]}
WHL=${2:-.whl}
mkdir -p "$OUT"
T0=$(date +%s)
PARTS=" ${PARTS:-ops gpu-suite throughput async-save} "
stamp() { echo "=== +$(($(date +%s) - T0))s $*"; }
want() { [[ $PARTS == *" $1 "* ]] && stamp "$1"; }

stamp setup
# python3 there is itself a venv, so --system-site-packages would not see its torch: a .pth does.
python3 -m venv /tmp/v || exit 1
python3 -c 'import site; print(site.getsitepackages()[0])' \
    >"$(/tmp/v/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
/tmp/v/bin/python -m pip install -q --no-index --no-deps --no-compile "$WHL"/*.whl || exit 1
export PATH=/tmp/v/bin:$PATH PYTHONPATH=$PWD PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/tmp/v/torch_extensions HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc
python - <<'EOF' || exit 1
import importlib.metadata as md
import torch
for n in ("torch", "deepspeed", "transformers", "datasets", "accelerate", "tokenizers",
          "pyarrow", "fsspec", "huggingface_hub", "safetensors", "triton", "peft"):
    try:
        print(n, md.version(n))
    except md.PackageNotFoundError:
        print(n, "missing")
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
import deepspeed, datasets, transformers, finetune  # noqa: F401  (fails the session early)
EOF

if want ops; then
    timeout 200 python scripts/build_ops.py >"$OUT/ops.log" 2>&1
    echo "build_ops rc=$?"; tail -8 "$OUT/ops.log"
fi

if want gpu-suite; then
    timeout 420 python -m pytest -q -ra -m gpu tests/gpu -p no:cacheprovider --durations=0 \
        --timeout 180 >"$OUT/gpu_suite.log" 2>&1
    echo "gpu suite rc=$?"; grep -E "passed|failed|PASSED|FAILED|SKIPPED|Error|s call" "$OUT/gpu_suite.log" | tail -30
fi

if want throughput; then
    # Llama-3.2-1B's shape, full rows of 2048 tokens: tokens/s and MFU of both tools
    timeout 160 python bench/train/train_throughput.py --num_gpus 1 --precision bf16 --rounds 1 \
        --shape llama-3.2-1b --long_rows --steps 30 --warmup 10 --logging_steps 5 \
        --per_device_train_batch_size 8 --max_seq_length 2048 --threads_per_rank 0 \
        --out "$OUT/train_throughput.json" >"$OUT/throughput.log" 2>&1
    echo "throughput rc=$?"; tail -25 "$OUT/throughput.log"
fi

if want async-save; then
    timeout 140 python bench/save/async_save.py --num_gpus 1 --precision bf16 --repeats 2 --bg_saves 2 \
        --e2e_steps 20 --every 5 --e2e_repeats 1 --dir /tmp/async \
        --out "$OUT/async_save.json" >"$OUT/async.log" 2>&1
    echo "async rc=$?"; tail -25 "$OUT/async.log"
fi
stamp done
