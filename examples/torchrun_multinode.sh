#!/usr/bin/env bash
# Launch pretrain_gpt.py on one node of a multi-node job: one torchrun agent per node, static
# rendezvous at MASTER_ADDR:MASTER_PORT (node 0). Run the same command on every node with its
# NODE_RANK; everything after the script name goes to pretrain_gpt.py. PYTHON is the interpreter
# (default: the checkout's .venv/bin/python where `make setup` made it, else `python`, e.g. an NGC
# container's own).
#
# A template for two nodes (node0 is node 0's host name; the job's flags follow the script, as in
# examples/slurm/):
#   node 0: NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 examples/torchrun_multinode.sh --residual delta_block ...
#   node 1: NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 examples/torchrun_multinode.sh --residual delta_block ...
# On one machine (CPU too), 20 iterations of the embedded default run over two processes (TP2):
#   NPROC_PER_NODE=2 examples/torchrun_multinode.sh --tensor-model-parallel-size 2 \
#       --train-iters 20 --save runs/tp2-baseline
#
# Under Slurm, examples/slurm/pretrain_qwen3_8b_delta_block.sbatch sets these from SLURM_* variables.
# RDZV=c10d uses torchrun's c10d rendezvous instead (elastic agents; node ranks are then assigned by it).
# The agent is torchrun run by megatron_delta.trainer.launch: a SIGTERM to it (a preemption, Slurm's
# --signal) is passed on to the workers, which save with --exit-signal-handler and exit 0, and so does it.
set -euo pipefail

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV=${RDZV:-static}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-$(if [ -x "$HERE/.venv/bin/python" ]; then echo "$HERE/.venv/bin/python"; else echo python; fi)}

# Megatron-Core: TP communication overlaps compute only with one CUDA work queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [[ "$RDZV" == "c10d" ]]; then
    launch=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
            --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megatron-delta}")
else
    launch=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE"
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi

echo "torchrun_multinode: node $NODE_RANK/$NNODES x $NPROC_PER_NODE procs, rendezvous $RDZV at $MASTER_ADDR:$MASTER_PORT" >&2
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"  # megatron_delta.trainer.launch from this checkout
exec "$PYTHON" -m megatron_delta.trainer.launch "${launch[@]}" "$HERE/pretrain_gpt.py" "$@"
