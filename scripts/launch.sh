#!/usr/bin/env bash
# One entry point for finetune on a workstation, or on several nodes with a hostfile or torchrun.
#
#   scripts/launch.sh [wrapper options] [--] [finetune flags...]
#
# Wrapper options (each also read from the environment variable in brackets):
#   --launcher deepspeed|torchrun  [LAUNCHER]        default: deepspeed
#   --nproc N                      [NPROC_PER_NODE]  processes per node; default: the GPUs that
#                                                    nvidia-smi lists, else 1
#   --hostfile FILE                [HOSTFILE]        deepspeed over pdsh/ssh (see scripts/hostfile.example)
#   --nnodes N --node_rank R       [NNODES NODE_RANK] torchrun on several nodes: run once per node
#   --master_addr A --master_port P [MASTER_ADDR MASTER_PORT] default: 127.0.0.1 and 29500
#   --offline                      [FINETUNE_OFFLINE=1] no hub access (HF_HUB_OFFLINE etc.)
#
# What it adds to a bare launcher:
#   * a quiet DeepSpeed launcher: its own log at warning (DS_LAUNCHER_LOG_LEVEL=info shows its
#     command and spawn lines);
#   * environment: OMP_NUM_THREADS = cores / processes (unless set), TOKENIZERS_PARALLELISM=false,
#     TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (a dead rank becomes an error, not a hang), unbuffered output;
#   * a log: everything is also appended to OUT/logs/launch-<time>-<host>-<pid>.log;
#   * signals: SIGTERM, SIGUSR1 and SIGINT sent to this script go to the training processes
#     themselves, not to the launcher. The DeepSpeed launcher answers SIGTERM by killing its ranks
#     30 s later, and torchrun by killing them too; finetune's ranks instead save a checkpoint at the
#     next step boundary and exit with 75 ("preempted, requeue me"). A second signal is forwarded
#     too and does not interrupt the save;
#   * the exit code: torchrun turns any rank's non-zero code into 1, so when OUT/exit_status.json
#     of this run says 75, this script exits 75.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

launcher=${LAUNCHER:-deepspeed}
nproc=${NPROC_PER_NODE:-}
hostfile=${HOSTFILE:-}
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
offline=${FINETUNE_OFFLINE:-0}
PYTHON=${PYTHON:-python3}

die() { echo "launch.sh: $*" >&2; exit 2; }
need() { [[ $# -ge 2 && -n $2 ]] || die "$1 needs a value"; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --launcher) need "$@"; launcher=$2; shift 2 ;;
        --nproc) need "$@"; nproc=$2; shift 2 ;;
        --hostfile) need "$@"; hostfile=$2; shift 2 ;;
        --nnodes) need "$@"; nnodes=$2; shift 2 ;;
        --node_rank) need "$@"; node_rank=$2; shift 2 ;;
        --master_addr) need "$@"; master_addr=$2; shift 2 ;;
        --master_port) need "$@"; master_port=$2; shift 2 ;;
        --offline) offline=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        *) break ;;
    esac
done

[[ $launcher == deepspeed || $launcher == torchrun ]] || die "--launcher must be deepspeed or torchrun, got '$launcher'"
if [[ -z $nproc ]]; then
    nproc=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ $nproc -gt 0 ]] || nproc=1
fi
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$nproc'"
[[ -z $hostfile || -f $hostfile ]] || die "--hostfile: file not found: $hostfile"
[[ -z $hostfile || $launcher == deepspeed ]] || die "--hostfile needs --launcher deepspeed (torchrun: --nnodes/--node_rank)"

out=$("$PYTHON" -m finetune.exit_status outdir "$@") || die "cannot run '$PYTHON -m finetune' (activate finetune's environment, or set PYTHON)"
mkdir -p "$out/logs" || die "--output_dir: cannot create $out/logs"
log="$out/logs/launch-$(date +%Y%m%d-%H%M%S)-$(hostname -s)-$$.log"

cores=$(nproc 2>/dev/null || echo 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTHONUNBUFFERED=1
if [[ $offline == 1 ]]; then
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi
# Tells this run's OUT/exit_status.json from an older one. Several torchrun nodes share one id
# (each node's script reads the same file on shared storage): set it yourself, or it is
# derived from the rendezvous address.
if [[ $nnodes -gt 1 ]]; then
    export FINETUNE_RUN_ID=${FINETUNE_RUN_ID:-$master_addr-$master_port}
else
    export FINETUNE_RUN_ID=${FINETUNE_RUN_ID:-$(hostname -s)-$$-$(date +%s)}
fi

if [[ $launcher == deepspeed ]]; then
    # The launcher's own INFO lines (its command, world info, each spawn) only at --log_level info.
    cmd=("$PYTHON" -m deepspeed.launcher.runner --master_port "$master_port" --log_level "${DS_LAUNCHER_LOG_LEVEL:-warning}")
    if [[ -n $hostfile ]]; then
        cmd+=(--hostfile "$hostfile" --master_addr "$master_addr")
    else
        cmd+=(--num_gpus "$nproc")
    fi
    cmd+=(--module finetune)
else
    cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node "$nproc" --nnodes "$nnodes" --node_rank "$node_rank"
         --master_addr "$master_addr" --master_port "$master_port" -m finetune)
fi

echo "[launch.sh] $(date '+%F %T') $(hostname -s): ${cmd[*]} $* (log: $log)" | tee -a "$log" >&2

descendants() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done; }
is_rank() {  # a training process: runs `-m finetune` and has a LOCAL_RANK (launchers have neither both)
    grep -qz '^LOCAL_RANK=' "/proc/$1/environ" 2>/dev/null && grep -qzx 'finetune' "/proc/$1/cmdline" 2>/dev/null
}
rank_pids() {  # ranks only: not their own children (op builds, data workers), which inherit both
    local p
    [[ -n $launcher_pid ]] || return 0
    for p in $(descendants "$launcher_pid"); do
        if is_rank "$p" && ! is_rank "$(ps -o ppid= -p "$p" | tr -d ' ')"; then echo "$p"; fi
    done
    return 0
}
pending=
forward() {
    local sig=$1 pids
    pids=$(rank_pids | tr '\n' ' ')
    if [[ -z ${pids// /} ]]; then
        # Still starting (or between ranks): keep it and try again from the wait loop below.
        [[ $pending == "$sig" ]] || echo "[launch.sh] SIG$sig: no ranks yet; forwarding it when they start" | tee -a "$log" >&2
        pending=$sig
    else
        echo "[launch.sh] SIG$sig: forwarding to ranks $pids" | tee -a "$log" >&2
        kill -s "$sig" $pids 2>/dev/null || true
        pending=
    fi
    if [[ -n $hostfile ]]; then  # ranks started over pdsh are not our descendants
        pdsh -R ssh -w "$(awk '!/^#/ && NF {print $1}' "$hostfile" | paste -sd,)" \
            "pkill -$sig -f -- '-m finetune --local_rank'" 2>&1 | tee -a "$log" >&2 || true
    fi
}
# Before the launcher starts, so no signal falls between its start and the traps.
launcher_pid=
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT

# The launcher and its log writer get a session of their own: a signal meant for this script
# (Ctrl-C in a terminal, a scheduler signalling the process group) must reach the ranks only
# through forward(), and must not kill `tee` (the ranks would die of SIGPIPE on their next line).
LOG=$log setsid bash -c '"$@" 2>&1 | tee -a "$LOG"; exit "${PIPESTATUS[0]}"' launch "${cmd[@]}" "$@" &
launcher_pid=$!

# Wait for the launcher; a trapped signal interrupts the short `wait` at once.
set +e
while kill -0 "$launcher_pid" 2>/dev/null; do
    [[ -z $pending ]] || forward "$pending"
    sleep 1 &
    wait $!
done
wait "$launcher_pid"  # bash kept the status of the child it reaped
rc=$?

final=$("$PYTHON" -m finetune.exit_status code "$rc" "$@") || final=$rc
if [[ $final != "$rc" ]]; then
    echo "[launch.sh] preempted after a committed checkpoint (launcher exit $rc): exiting $final" | tee -a "$log" >&2
    rc=$final
fi
echo "[launch.sh] $(date '+%F %T') exit $rc" | tee -a "$log" >&2
exit "$rc"
