#!/usr/bin/env bash
# The GPU checks a session runs when it is lent a CUDA machine (docs/scale-out.md, "What was tested where"): the
# `gpu`-marked tests (DeepSpeed ZeRO-2/3 and FSDP real runs, fp16 AMP), every family under a real ZeRO-3 engine
# (tests/runtime/test_z3_families.py), the bf16 MFU benchmark, the EP code path on one GPU, and the methods under
# DeepSpeed on a tiny model. Wheels of missing packages may be carried in .whl/ (installed into /tmp/site).
# Output goes to $OUT (or ./gpu_checks_out) as log files.
set -uo pipefail
OUT=${OUT:-gpu_checks_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, lightning, deepspeed, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '| deepspeed', deepspeed.__version__, '| peft', peft.__version__)"
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, print the tail and the status
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
    echo "=== $name rc=$rc wall=$((SECONDS - t0))s"; tail -n "${TAIL:-15}" "$OUT/$name.log"
}
TAIL=25 step gpu_tests "${TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA --durations=5 \
    tests/runtime/test_strategies.py tests/callbacks/test_training_callbacks.py
TAIL=12 step z3_families "${Z3_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider --durations=3 tests/runtime/test_z3_families.py
TAIL=12 step mfu "${MFU_LIMIT:-150}" python3 bench/mfu.py --layers 4 --batch 8 --seq 2048 --steps 8 --warmup 2 \
    ${MFU_METHODS:+--methods $MFU_METHODS}
# issue 29's GPU item: the EP code path at EP size 1 (AllToAllEP + the ZeRO-1 composite) against the plain step
TAIL=4 step ep_one_gpu "${EP_LIMIT:-120}" python3 bench/expert_parallel.py --steps 10 --batch 8 --seq 2048
if [ -n "${MFU16:-}" ]; then  # issue 28's sweep: 16 layers, seq 2048 and 8192, every method (a longer step)
    TAIL=20 step mfu16 "${MFU16_LIMIT:-300}" python3 bench/mfu.py --layers 16 --batch 1 --seq 2048,8192 --steps 4 \
        --warmup 1 ${MFU_METHODS:+--methods $MFU_METHODS}
fi
for extra in "${@}"; do  # further run.py invocations given as arguments, e.g. "hardware=deepspeed_zero3 method=condenser"
    # shellcheck disable=SC2086
    step "run_$(echo "$extra" | tr -c 'a-z0-9' '_' | cut -c1-60)" "${RUN_LIMIT:-120}" python3 run.py debug=fast logger=none hardware.trainer.devices=1 \
        task.trainer.max_steps=4 hydra.run.dir="/tmp/runs/$RANDOM" $extra
done
