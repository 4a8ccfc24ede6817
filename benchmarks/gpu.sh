#!/usr/bin/env bash
# The GPU acceptance run: the real `megaformer prepare/train/parity/translate/evaluate` commands on one
# CUDA GPU, 8 minutes in all on an H200 (budgets below, not yet timed there in this form), one summary
# line per check.
#
#   benchmarks/gpu.sh                      on a machine with a CUDA GPU (nccl, torch with CUDA)
#   benchmarks/gpu.sh --plan               each check's time budget and the total, one line each; nothing runs
#   DEVICE=cpu benchmarks/gpu.sh --dry     every step for a few steps on the CPU (gloo), to check the script
#
# The checks run in the order CHECKS names them (default dabc: the most informative first), each in
# a child of this script under `timeout` of its budget (the BUDGET table below; BUDGET_A .. BUDGET_D
# set one in seconds): a check that runs over is stopped, fails, and the next one starts. The script
# refuses, in one line and before anything runs, a plan over 480 s in all (--dry: 1,200 s) or with a check
# over 540 s.
#
# d. transformer_big, then transformer_base (bf16, compiled layers; COMPILE=false for eager) on a
#    WMT'14-shaped corpus (60,000 pairs on a GPU, ~27 pieces a side, 37,000 pieces) through the
#    Trainer on one GPU, one line each: the layout, steady target tokens/s and MFU against the dense
#    bf16 peak (H200: 989 TFLOP/s) as the Trainer logs them, held to MIN_MFU_BIG (default 0.40) and
#    MIN_MFU_BASE (0.30) on a GPU (no threshold in --dry unless set); beside them the step
#    benchmarks/gpu_sim.py predicts for the same config and --set overrides on this GPU (h100 or
#    h200, from its name; "predicted n/a" where the simulation is missing or fails, which fails
#    nothing); the model alone (benchmarks/gpu_throughput.py: the same micro-batch, bf16 weights with
#    fp32 copies, so its compiled layers come from the Trainer's Inductor cache) and the Trainer's share
#    of it; from a 3-step profile (train.profile_from) the GPU's busy share and the top 10 kernels.
#    Then the host's work in a steady step (benchmarks/host_overhead.py, bf16 at transformer_big's
#    width on a GPU, the engine the Trainer picks): its reads of the device and CUDA synchronisations
#    against the engine's target, and its step time against a plain loop doing the same work.
#    --dry runs d eagerly unless COMPILE=true.
# a. nccl on 1 GPU, bf16 ZeRO-1 and fp16 ZeRO-2 side by side: tiny for 200 steps, a checkpoint at 100,
#    kill -9 at step ~120, `--resume auto` to 200; steps 101-200 against an uninterrupted run of the
#    same settings that trains at the same time. Tolerance: bitwise where the GPU kernels are
#    deterministic; the embedding backward (index_add with atomics) and attention backward are not,
#    so two uninterrupted bf16/fp16 runs already differ in the last bits of a 7-bit (bf16) / 10-bit
#    (fp16) mantissa: a resume that restores every state exactly stays within RESUME_TOL (1 %) per
#    step, while a wrong restore (warm-up, Adam step, loss scale, data position, dropout masks) moves
#    the loss by more (the first step after a restart from a fresh optimizer moves it by > 10 %).
# b. two processes on the one GPU, gloo, TP=2: `megaformer parity` and 50 training steps
#    (CUDA tensors through gloo where the tree has `parallel.device`; said on the line).
# c. a CPU-written checkpoint resumed on CUDA (losses of steps 31-60 against the CPU's own
#    continuation, CROSS_TOL 2 %: TF32 vs fp32 matmuls), and translate/evaluate on CUDA against the
#    CPU (200 test sentences: the same hypotheses for >= 95 %, BLEU within 1).
#
# Exit status: 0 when every check passes, 2 for a refused setting, 124 when stopped by TERM or INT
# (the summary so far is printed). WORK=DIR keeps the runs (default: a temporary folder; a second call
# with the same WORK keeps its prepared data and replaces its runs); CHECKS=da runs only those, in
# that order; LOGS=DIR receives every run's log, metrics and profile summary as each check ends.
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # the children that run one check each
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=${DEVICE:-cuda}
DRY=0 PLAN=0
for arg in "$@"; do
    case $arg in
        --dry) DRY=1 ;;
        --plan) PLAN=1 ;;
        *) echo "gpu.sh: unknown argument $arg: the options are --dry and --plan" >&2; exit 2 ;;
    esac
done
ONLY=${GPU_SH_CHECK:-}  # set by this script for a child that runs one check
CHECKS=${CHECKS:-dabc}
LOGS=${LOGS:-}
if [[ ! "$CHECKS" =~ ^[abcd]+$ ]] || [ -n "$(fold -w1 <<<"$CHECKS" | sort | uniq -d)" ]; then
    echo "gpu.sh: CHECKS=$CHECKS: name the checks to run with the letters a, b, c and d, each once, in the order to run them (e.g. CHECKS=da)" >&2
    exit 2
fi
if [ -n "$LOGS" ] && ! mkdir -p "$LOGS" 2>/dev/null; then
    echo "gpu.sh: LOGS=$LOGS: cannot make that folder (a file there, or no write permission)" >&2
    exit 2
fi

# ---- the plan: seconds per check ----------------------------------------------------------------
# On an H200 (the total must leave the script's own start, ~15 s, within 8 minutes): d prepares its
# corpus (~20 s), trains big and base (each ~20 s to start, ~60 s compiling, 30 steps of 25,000
# tokens, the model alone ~20 s, the simulation ~15 s), host_overhead ~30 s; a runs its 2 x 2
# trainings side by side (~15 s to start each, 200 steps of ~25 ms); b and c start 2-4 processes
# each. --dry: a 2-core CPU shared with other work, which ran it in ~3 minutes alone and in 523 s beside
# other jobs (d 337 s, host_overhead's steps 40x slower than alone): 540 s a check there too, 20 minutes in all.
CHECK_LIMIT=540 PLAN_LIMIT=480
declare -A BUDGET WHAT
if [ "$DRY" = 1 ]; then
    BUDGET=([d]=480 [a]=240 [b]=150 [c]=180)
    PLAN_LIMIT=1200
else
    BUDGET=([d]=270 [a]=70 [b]=55 [c]=65)
fi
WHAT=(
    [d]="transformer_big and transformer_base through the Trainer (MFU, prediction), host overhead"
    [a]="tiny, 200 steps, kill -9 at ~120 and resume, bf16 ZeRO-1 and fp16 ZeRO-2 side by side"
    [b]="TP=2 parity and 50 training steps, 2 processes on the GPU over gloo"
    [c]="a CPU checkpoint resumed on the GPU, translate/evaluate on the GPU against the CPU"
)
for x in a b c d; do
    name=BUDGET_${x^^}
    [ -n "${!name:-}" ] || continue
    if [[ ! "${!name}" =~ ^[1-9][0-9]*$ ]]; then
        echo "gpu.sh: $name=${!name}: give check $x's budget in whole seconds (e.g. $name=${BUDGET[$x]})" >&2
        exit 2
    fi
    BUDGET[$x]=${!name}
done
PLANNED=0
for ((i = 0; i < ${#CHECKS}; i++)); do
    x=${CHECKS:i:1}
    if [ "${BUDGET[$x]}" -gt "$CHECK_LIMIT" ]; then
        echo "gpu.sh: check $x's budget is ${BUDGET[$x]} s, over the $CHECK_LIMIT s a check may take: lower BUDGET_${x^^}" >&2
        exit 2
    fi
    PLANNED=$((PLANNED + BUDGET[$x]))
done
if [ "$PLANNED" -gt "$PLAN_LIMIT" ]; then
    echo "gpu.sh: CHECKS=$CHECKS takes $PLANNED s by its budgets, over the $PLAN_LIMIT s a run may take: run fewer CHECKS or lower a BUDGET_<check>" >&2
    exit 2
fi
if [ "$PLAN" = 1 ]; then
    for ((i = 0; i < ${#CHECKS}; i++)); do
        x=${CHECKS:i:1}
        printf '%s %4d s  %s\n' "$x" "${BUDGET[$x]}" "${WHAT[$x]}"
    done
    printf 'total %d s of %d (%s; a check at most %d s)\n' "$PLANNED" "$PLAN_LIMIT" \
        "$([ "$DRY" = 1 ] && echo "--dry on a CPU" || echo "on an H200")" "$CHECK_LIMIT"
    exit 0
fi

if [ "$DRY" = 1 ]; then
    MIN_MFU_BASE=${MIN_MFU_BASE:-} MIN_MFU_BIG=${MIN_MFU_BIG:-}  # no threshold unless set
else
    MIN_MFU_BASE=${MIN_MFU_BASE:-0.30} MIN_MFU_BIG=${MIN_MFU_BIG:-0.40}
fi
for name in MIN_MFU_BASE MIN_MFU_BIG; do
    if [ -n "${!name}" ] && [[ ! "${!name}" =~ ^(0|1|0?\.[0-9]+|0\.|1\.0*)$ ]]; then
        echo "gpu.sh: $name=${!name}: give the lowest MFU to accept as a fraction from 0 to 1 (e.g. 0.40), or empty for none" >&2
        exit 2
    fi
done
WORK=${WORK:-$(mktemp -d /tmp/megaformer-gpu.XXXXXX)}
mkdir -p "$WORK"
export WORK
RESUME_TOL=${RESUME_TOL:-0.01}
CROSS_TOL=${CROSS_TOL:-0.02}
BEGAN=$SECONDS
SUMMARY=()
FAILED=0
declare -A SESSIONS  # check a's killed trainers, each in a session of its own while it runs
child=""             # the parent's child running one check
TIMES=()             # the parent's: each check's seconds

if [ "$DRY" = 1 ]; then
    STEPS=20 SAVE=10 KILL_AT=12 TP_STEPS=5 CPU_STEPS=12 CPU_SAVE=6 BIG_STEPS=8 TEST_LINES=20
    WMT_PAIRS=3000 WMT_VOCAB=4000 PROFILE_FROM=3 COMPILE=${COMPILE:-false}
    # big and base at a CPU's size: one layer each side, half their width
    NARROW_big=(--set model.d_model=512 --set model.d_ff=2048 --set model.num_heads=8)
    NARROW_base=(--set model.d_model=256 --set model.d_ff=1024 --set model.num_heads=4)
    BIG_SIZE=(--set model.encoder_layers=1 --set model.decoder_layers=1 --set train.tokens_per_step=1024
        --set data.max_tokens=512 --set data.num_workers=1 --set train.log_interval=1)
    ALONE=(--set model.encoder_layers=1 --set model.decoder_layers=1 --steps 2 --warmup 1)
    SMALL=(--set train.tokens_per_step=256 --set data.max_tokens=256)  # tiny's steps, 8x smaller
    HOST=(--shape tiny --steps 2 --warmup 1)
else
    STEPS=200 SAVE=100 KILL_AT=120 TP_STEPS=50 CPU_STEPS=60 CPU_SAVE=30 BIG_STEPS=30 TEST_LINES=200
    WMT_PAIRS=60000 WMT_VOCAB=37000 PROFILE_FROM=15 COMPILE=${COMPILE:-true}
    NARROW_big=() NARROW_base=()
    BIG_SIZE=(--set train.log_interval=5)
    ALONE=(--steps 5 --warmup 3)
    SMALL=()
    HOST=(--shape big --steps 10 --warmup 3)
fi
SIM_LIMIT=90  # seconds gpu_sim.py may take for one prediction
if [ "$DEVICE" = cpu ]; then
    export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu
    BACKEND=gloo
else
    BACKEND=nccl
fi

mf() { "$PY" -m megaformer.cli "$@" 3>&- 4>&-; }  # fds 3 and 4: the script's own output (below)
cpu_mf() { CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu "$PY" -m megaformer.cli "$@" 3>&- 4>&-; }
fresh() { rm -rf -- "$@"; }  # a run folder from an earlier call with the same WORK: --resume none refuses it
keep_logs() {                # the small files only: checkpoints stay in $WORK
    [ -n "$LOGS" ] || return 0
    (cd "$WORK" && find . -maxdepth 3 \( -name '*.log' -o -name metrics.jsonl -o -name 'summary-rank*.json' \) \
        -exec cp --parents {} "$LOGS" \;)
}
result() { # result PASS|FAIL text...: a summary line (a child's go to its results file, which the parent reads)
    local line
    line=$(printf '%-4s %s' "$1" "${*:2}")
    SUMMARY+=("$line")
    [ "$1" = PASS ] || FAILED=1
    [ -n "$ONLY" ] && echo "$line" >>"$GPU_SH_RESULTS"
    echo "== $line"
}
collect() { # collect X EXIT WHY: the child's summary lines; a line of its own where it was stopped or gave none
    local x=$1 code=$2 line lines=0
    while IFS= read -r line; do
        SUMMARY+=("$line")
        lines=$((lines + 1))
        [[ "$line" == PASS* ]] || FAILED=1
    done <"$WORK/.results-$x"
    if [ "$3" = signal ]; then
        result FAIL "$x: stopped by a signal"
    elif [ "$code" = 124 ] || [ "$code" = 137 ]; then
        result FAIL "$x: stopped at its budget of ${BUDGET[$x]} s (the lines before this one are what it finished)"
    elif [ "$lines" = 0 ]; then
        result FAIL "$x: exited $code without a result"
    fi
}
finish() { # finish STATUS: the logs and the summary, also when a time limit's TERM ends the script
    trap - TERM INT
    local s
    for s in "${SESSIONS[@]}"; do kill -9 -- "-$s" 2>/dev/null; done
    if [ -n "$child" ]; then # the parent: stop the running check (timeout passes TERM to its process group)
        kill -TERM "$child" 2>/dev/null
        wait "$child" 2>/dev/null
        child=""
        collect "$CURRENT" 124 signal
    fi
    keep_logs
    [ -n "$ONLY" ] && exit "$1"
    echo
    echo "summary ($((SECONDS - BEGAN)) s, runs in $WORK):"
    printf '%s\n' "${SUMMARY[@]}"
    [ ${#TIMES[@]} -gt 0 ] && echo "time by check (budget): ${TIMES[*]}"
    exit "$1"
}
exec 3>&1 4>&2  # the script's own output: a trap runs inside the command it interrupted, with its redirections
trap 'exec 1>&3 2>&4; echo "gpu.sh${ONLY:+ check $ONLY}: stopped by a signal"; finish 124' TERM INT
last_step() { grep -o '"step": [0-9]*' "$1/metrics.jsonl" 2>/dev/null | tail -1 | grep -o '[0-9]*$' || echo 0; }

# compare RUN_A RUN_B FIRST LAST TOL: the last logged loss of each step FIRST..LAST of two runs.
compare() {
    "$PY" - "$@" <<'EOF'
import json, sys
a, b, first, last, tol = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
def losses(run):
    out = {}
    for line in open(f"{run}/metrics.jsonl"):
        r = json.loads(line)
        if r["kind"] == "train":
            out[r["step"]] = r["loss"]  # a resumed run logs the replayed steps again: keep the last
    return out
la, lb = losses(a), losses(b)
steps = [s for s in range(first, last + 1) if s in la and s in lb]
if len(steps) != last - first + 1:
    print(f"steps {first}-{last}: only {len(steps)} logged in both runs"); sys.exit(1)
rel = max(abs(la[s] - lb[s]) / abs(lb[s]) for s in steps)
same = all(la[s] == lb[s] for s in steps)
print(f"steps {first}-{last}: {'bitwise equal' if same else f'max relative difference {rel:.2e}'} "
      f"(tolerance {tol:g}), loss {lb[first]:.4f} -> {lb[last]:.4f}")
sys.exit(0 if rel <= tol else 1)
EOF
}

DATA=$WORK/data
TINY=(--config configs/tiny.yaml --set "data.path=$DATA" --set train.log_interval=1 --set train.eval_interval=0 "${SMALL[@]}")
tiny_data() { # the corpus of checks a-c, prepared once per WORK
    [ -f "$DATA/manifest.json" ] && return 0
    mf prepare --synthetic 4000 --out "$DATA" --quiet && return 0
    result FAIL "$1: prepare --synthetic 4000 failed"
    return 1
}

# ---- a. kill -9 and resume, nccl on one GPU: both variants and their references side by side --------
a_sets() { # a_sets PRECISION ZERO: the variant's training settings, in A_SETS
    A_SETS=("${TINY[@]}" --set "parallel.backend=$BACKEND" --set "train.precision=$1" --set "train.zero_stage=$2"
        --set "train.max_steps=$STEPS" --set "train.save_interval=$SAVE")
}
check_a() {
    tiny_data a || return
    local -A ref resume killed precision_of zero_of
    local variant precision zero name pid
    local names=()
    for variant in "bf16 1" "fp16 2"; do
        read -r precision zero <<<"$variant"
        name="a-$precision-zero$zero"
        names+=("$name")
        precision_of[$name]=$precision zero_of[$name]=$zero
        a_sets "$precision" "$zero"
        fresh "$WORK/$name-ref" "$WORK/$name"
        "$PY" -m megaformer.cli train "${A_SETS[@]}" --run-dir "$WORK/$name-ref" --resume none \
            >"$WORK/$name-ref.log" 2>&1 3>&- 4>&- &
        ref[$name]=$!
        setsid "$PY" -m megaformer.cli train "${A_SETS[@]}" --run-dir "$WORK/$name" --resume none \
            >"$WORK/$name.log" 2>&1 3>&- 4>&- &
        SESSIONS[$name]=$!
    done
    while [ ${#SESSIONS[@]} -gt 0 ]; do
        for name in "${!SESSIONS[@]}"; do
            pid=${SESSIONS[$name]}
            if kill -0 "$pid" 2>/dev/null && [ "$(last_step "$WORK/$name")" -lt "$KILL_AT" ]; then continue; fi
            killed[$name]=$(last_step "$WORK/$name")
            kill -9 -- "-$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            unset "SESSIONS[$name]"
        done
        [ ${#SESSIONS[@]} -gt 0 ] && sleep 0.2
    done
    for name in "${names[@]}"; do
        a_sets "${precision_of[$name]}" "${zero_of[$name]}"
        "$PY" -m megaformer.cli train "${A_SETS[@]}" --run-dir "$WORK/$name" --resume auto \
            >>"$WORK/$name.log" 2>&1 3>&- 4>&- &
        resume[$name]=$!
    done
    local ref_code resumed line what
    for name in "${names[@]}"; do
        wait "${ref[$name]}"
        ref_code=$?
        wait "${resume[$name]}"
        resumed=$?
        what="a ${precision_of[$name]} ZeRO-${zero_of[$name]} $BACKEND: killed -9 at step ${killed[$name]}, resumed from $SAVE"
        if [ "${killed[$name]}" -lt "$KILL_AT" ] || [ "${killed[$name]}" -ge "$STEPS" ]; then
            result FAIL "a ${precision_of[$name]} ZeRO-${zero_of[$name]}: the run was at step ${killed[$name]} when killed, not between $KILL_AT and $STEPS"
        elif [ "$ref_code" != 0 ] || [ "$resumed" != 0 ]; then
            result FAIL "$what: train exited $ref_code (uninterrupted) / $resumed (resumed), see $WORK/$name*.log"
        elif line=$(compare "$WORK/$name" "$WORK/$name-ref" $((SAVE + 1)) "$STEPS" "$RESUME_TOL"); then
            result PASS "$what: $line"
        else
            result FAIL "$what: $line"
        fi
    done
}

# ---- b. two processes on the one GPU, gloo, TP=2 ------------------------------------------------
check_b() {
    tiny_data b || return
    local tp_sets=(--set parallel.backend=gloo) runner=cpu_mf out parity code trained
    local where="CPU tensors: this tree has no parallel.device, gloo runs on the CPU"
    if "$PY" -c "import sys; from megaformer.config import ParallelConfig as P; sys.exit('device' not in P.__dataclass_fields__)"; then
        tp_sets+=(--set "parallel.device=$DEVICE")
        where="$DEVICE tensors through gloo"
        runner=mf
    fi
    if out=$($runner parity --config configs/tiny.yaml --tp 2 "${tp_sets[@]}" 2>&1) && grep -q "^PASS" <<<"$out"; then
        parity="parity $(grep -o 'largest relative difference [^ ]*' <<<"$out")"
    else
        parity="parity FAILED"
        echo "$out" | tail -20
    fi
    fresh "$WORK/b-tp2"
    $runner train "${TINY[@]}" "${tp_sets[@]}" --set parallel.tp=2 --set "train.max_steps=$TP_STEPS" \
        --set train.save_interval=0 --run-dir "$WORK/b-tp2" --resume none --nproc 2 >"$WORK/b-tp2.log" 2>&1
    code=$?
    trained=$("$PY" -c "
import json, sys
r = [json.loads(l) for l in open(sys.argv[1] + '/metrics.jsonl') if '\"train\"' in l]
print(f'loss {r[0][\"loss\"]:.4f} -> {r[-1][\"loss\"]:.4f} in {r[-1][\"step\"]} steps' if r and r[-1]['loss'] < r[0]['loss'] else 'loss did not fall')
" "$WORK/b-tp2" 2>/dev/null || echo "no metrics")
    if [ "$code" = 0 ] && [[ "$parity" != *FAILED* ]] && [[ "$trained" == "loss "*" -> "* ]]; then
        result PASS "b TP=2, 2 processes on one device, gloo ($where): $parity; $trained"
    else
        result FAIL "b TP=2 gloo ($where): $parity; train exited $code, $trained (see $WORK/b-tp2.log)"
    fi
}

# ---- c. a CPU checkpoint resumed on the GPU; translate and evaluate on the GPU ------------------
check_c() {
    tiny_data c || return
    local line="" code_cpu code_gpu step_dir src=$DATA/test.xx ref=$DATA/test.yy t e e_cpu bleu_dev bleu_cpu cpu_eval
    local csets=("${TINY[@]}" --set "train.max_steps=$CPU_STEPS" --set "train.save_interval=$CPU_SAVE")
    fresh "$WORK/c-cpu" "$WORK/c-gpu"
    cpu_mf train "${csets[@]}" --set parallel.backend=gloo --run-dir "$WORK/c-cpu" --resume none >"$WORK/c-cpu.log" 2>&1
    code_cpu=$?
    step_dir=$(printf '%s/c-cpu/checkpoints/step-%08d' "$WORK" "$CPU_SAVE")
    mf train "${csets[@]}" --set "parallel.backend=$BACKEND" --run-dir "$WORK/c-gpu" --resume "$step_dir" \
        >"$WORK/c-gpu.log" 2>&1
    code_gpu=$?
    if [ "$code_cpu" = 0 ] && [ "$code_gpu" = 0 ] &&
        line=$(compare "$WORK/c-gpu" "$WORK/c-cpu" $((CPU_SAVE + 1)) "$CPU_STEPS" "$CROSS_TOL"); then
        result PASS "c CPU checkpoint (step $CPU_SAVE) resumed on $DEVICE: $line"
    else
        result FAIL "c CPU checkpoint resumed on $DEVICE: train exited $code_cpu (CPU) / $code_gpu ($DEVICE) ${line:-}"
    fi
    head -n "$TEST_LINES" "$DATA/test.xx" >"$WORK/test.xx" && head -n "$TEST_LINES" "$DATA/test.yy" >"$WORK/test.yy"
    src=$WORK/test.xx ref=$WORK/test.yy
    # the CPU's evaluation beside the device's translate and evaluate
    cpu_mf evaluate --ckpt "$WORK/c-gpu" --input "$src" --ref "$ref" --output "$WORK/c-evaluate.cpu" --json --quiet \
        >"$WORK/c-bleu.cpu" &
    cpu_eval=$!
    mf translate --ckpt "$WORK/c-gpu" --input "$src" --output "$WORK/c-translate.$DEVICE" --quiet
    t=$?
    bleu_dev=$(mf evaluate --ckpt "$WORK/c-gpu" --input "$src" --ref "$ref" --output "$WORK/c-evaluate.$DEVICE" --json --quiet)
    e=$?
    wait "$cpu_eval"
    e_cpu=$?
    bleu_cpu=$(cat "$WORK/c-bleu.cpu")
    if [ "$t$e$e_cpu" = 000 ] && line=$("$PY" - "$WORK" "$DEVICE" "$bleu_dev" "$bleu_cpu" <<'EOF'
import json, sys
work, dev = sys.argv[1], sys.argv[2]
bleu_dev, bleu_cpu = json.loads(sys.argv[3])["bleu"], json.loads(sys.argv[4])["bleu"]
translated = open(f"{work}/c-translate.{dev}").read().splitlines()
on_dev = open(f"{work}/c-evaluate.{dev}").read().splitlines()
on_cpu = open(f"{work}/c-evaluate.cpu").read().splitlines()
same = sum(a == b for a, b in zip(on_dev, on_cpu)) / max(len(on_cpu), 1)
ok = translated == on_dev and same >= 0.95 and abs(bleu_dev - bleu_cpu) <= 1.0
print(f"translate == evaluate on {dev}: {translated == on_dev}; {100 * same:.1f} % of {len(on_cpu)} hypotheses "
      f"as on the CPU; BLEU {bleu_dev:.2f} ({dev}) vs {bleu_cpu:.2f} (CPU)")
sys.exit(0 if ok else 1)
EOF
    ); then
        result PASS "c translate/evaluate on $DEVICE: $line"
    else
        result FAIL "c translate/evaluate on $DEVICE: exit $t/$e/$e_cpu ${line:-}"
    fi
}

# ---- d. big and base on a WMT'14-shaped corpus: the Trainer, its prediction, the model alone, a profile;
#         then the host's work in a steady step --------------------------------------------------------
WMT=$WORK/wmt14
PROFILE_STEPS=3
gpu_kind() { # gpu_sim.py's --gpu for this GPU: h100 where its name says H100, else h200 (also on a CPU)
    local name=""
    if [ "$DEVICE" = cuda ]; then
        name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
        [ -n "$name" ] || name=$("$PY" -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null)
    fi
    case "$name" in *H100*) echo h100 ;; *) echo h200 ;; esac
}
predict() { # predict GPU CONFIG ARGS...: gpu_sim.py's JSON for the config, or nothing where it is missing or fails
    local gpu=$1 config=$2
    shift 2
    [ -f benchmarks/gpu_sim.py ] || return 0
    timeout -k 5 "$SIM_LIMIT" "$PY" benchmarks/gpu_sim.py --config "$config" --gpu "$gpu" "$@" --json \
        2>>"$WORK/d-sim.log" 3>&- 4>&- || true
}
model_check() { # model_check base|big GPU
    local model=$1 gpu=$2 run=$WORK/d-$1 min_mfu code layout micro alone sim line
    [ "$model" = big ] && min_mfu=$MIN_MFU_BIG || min_mfu=$MIN_MFU_BASE
    local sets=(--set "data.path=$WMT" --set parallel.tp=1
        --set "parallel.backend=$BACKEND" --set train.precision=bf16 --set train.zero_stage=1
        --set "train.max_steps=$BIG_STEPS" --set train.save_interval=0 --set train.save_minutes=0
        --set train.eval_interval=0 --set "train.compile=$COMPILE" --set "train.profile_from=$PROFILE_FROM"
        --set "train.profile_steps=$PROFILE_STEPS" "${BIG_SIZE[@]}")
    local -n narrow=NARROW_$model
    sets+=("${narrow[@]}")
    fresh "$run"
    mf train --config "configs/transformer_$model.yaml" "${sets[@]}" --run-dir "$run" --resume none >"$run.log" 2>&1
    code=$?
    # "1 micro-batch of <= N tokens" or "K micro-batches of <= N tokens"
    layout=$(grep -oE 'train: [0-9.]*M parameters, tp=[^,]*, [0-9]* micro-batch(es)? of <= [0-9]* tokens' "$run.log" | head -1)
    micro=$(grep -oE 'micro-batch(es)? of <= [0-9]* tokens' <<<"$layout" | grep -oE '[0-9]+')
    local compiled=()
    [ "$COMPILE" = true ] && compiled=(--compile)
    alone=$("$PY" benchmarks/gpu_throughput.py --config "configs/transformer_$model.yaml" --device "$DEVICE" \
        --tokens "${micro:-25000}" --len 27 --vocab-size "$WMT_VOCAB" "${narrow[@]}" "${ALONE[@]}" "${compiled[@]}" \
        --json 2>>"$run.log" | tail -1)
    sim=$(predict "$gpu" "configs/transformer_$model.yaml" "${sets[@]}" --set "data.vocab_size=$WMT_VOCAB" --feed-data "$WMT")
    if [ "$code" = 0 ] && line=$("$PY" - "$run" "$((PROFILE_FROM + PROFILE_STEPS - 1))" "$alone" "$min_mfu" "$sim" "$gpu" <<'EOF'
import json, math, sys
run, profiled, alone, min_mfu, sim, gpu = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
records = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"train"' in l]
# A record's rate covers the steps since the record before it: only windows that begin after the
# profile's last step (which also synchronizes and writes the trace), so after compiling too.
steady = [r for before, r in zip(records, records[1:]) if before["step"] >= profiled] or records[-1:]
rate = sum(r["tokens_per_s"] for r in steady) / len(steady)
mfus = [r["mfu"] for r in steady if r["mfu"] is not None]  # None: beyond the peak (a wrong train.peak_tflops)
mfu = sum(mfus) / len(mfus) if mfus else float("nan")
out = f"Trainer {rate:,.0f} target tokens/s, MFU {100 * mfu:.1f} % (steps {steady[0]['step']}-{steady[-1]['step']}"
low = bool(min_mfu) and not mfu >= float(min_mfu)  # NaN fails a threshold
out += f"; threshold {100 * float(min_mfu):.0f} %{': BELOW' if low else ''})" if min_mfu else "; no threshold)"
try:
    text = sim.strip()
    try:
        p = json.loads(text)
    except ValueError:
        p = json.loads(text.splitlines()[-1])
    out += (f"; predicted ({gpu}) {p['target_tokens_per_s']:,.0f} tokens/s, MFU {100 * p['predicted_mfu']:.1f} %, "
            f"step {p['step_ms']:.1f} ms, {p['kernels_per_step']:,} kernels, {p['gb_per_step']:.1f} GB, "
            f"host reads {p['host_reads_per_step']}")
except (ValueError, KeyError, TypeError, IndexError):
    out += "; predicted n/a"
try:
    a = json.loads(alone)
    out += f"; model alone {a['tokens_per_s']:,.0f} ({rate / a['tokens_per_s']:.2f}x)"
    if a["compiled"]:
        out += f" with {a['graphs_from_cache']} graphs from the cache, {a['graphs_compiled']} compiled"
except ValueError:
    out += "; model alone: no result"
try:
    p = json.load(open(f"{run}/profile/summary-rank0.json"))
    busy = "n/a on a CPU" if p["busy"] is None else f"{100 * p['busy']:.1f} %"
    top = ", ".join(f"{name[:40]} {ms:.1f}" for name, ms in p["top"])
    out += f"; busy {busy} of {p['wall_ms']:.0f} ms a step; top (ms a step): {top}"
except (OSError, ValueError):
    out += "; no profile"
print(out)
sys.exit(1 if low else 0)
EOF
    ); then
        result PASS "d $model bf16 on $DEVICE (${layout#train: }): $line"
    else
        result FAIL "d $model bf16: train exited $code (see $run.log) ${line:-}"
    fi
    keep_logs
}
host_check() { # the host's reads, synchronisations and time in a steady step (host_overhead.py)
    local host line
    host=$("$PY" benchmarks/host_overhead.py --device "$DEVICE" --precision bf16 --zero 1 "${HOST[@]}" --json \
        2>"$WORK/d-host.log" 3>&- 4>&-)
    if line=$("$PY" - "$host" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
reads, syncs, target = r["megaformer_device_reads_per_step"], r["megaformer_cuda_syncs_per_step"], r["device_reads_target"]
print(f"{r['engine']} {r['precision']}, d_model {r['d_model']}: {reads} reads of the device, "
      f"{'n/a' if syncs is None else syncs} CUDA synchronisations in a steady step (target {target} each; "
      f"the plain loop {r['reference_device_reads_per_step']}); host time {r['host_time_ratio']}x the plain loop's "
      f"({r['megaformer_step_ms']:.1f} ms a step against {r['reference_step_ms']:.1f})")
sys.exit(0 if reads <= target and (syncs is None or syncs <= target) else 1)
EOF
    ); then
        result PASS "d host work on $DEVICE: $line"
    else
        result FAIL "d host work on $DEVICE: ${line:-no result} (see $WORK/d-host.log)"
    fi
}
check_d() {
    if [ ! -f "$WMT/manifest.json" ] &&
        ! mf prepare --synthetic "$WMT_PAIRS" --synthetic-shape wmt14 --vocab-size "$WMT_VOCAB" --out "$WMT" --quiet; then
        result FAIL "d: prepare --synthetic $WMT_PAIRS --synthetic-shape wmt14 failed"
        return
    fi
    local gpu model
    gpu=$(gpu_kind)
    for model in big base; do model_check "$model" "$gpu"; done
    host_check
}

# ---- a child: one check -------------------------------------------------------------------------
if [ -n "$ONLY" ]; then
    "check_$ONLY"
    finish "$FAILED"
fi

# ---- the parent: each check in a child under its budget ------------------------------------------
echo "megaformer GPU acceptance: device=$DEVICE backend=$BACKEND dry=$DRY work=$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA GPU visible: run DEVICE=cpu benchmarks/gpu.sh --dry to check the script on a CPU" >&2
    exit 2
fi
CHILD_ARGS=()
[ "$DRY" = 1 ] && CHILD_ARGS=(--dry)
for ((i = 0; i < ${#CHECKS}; i++)); do
    CURRENT=${CHECKS:i:1}
    started=$SECONDS
    echo "-- check $CURRENT (budget ${BUDGET[$CURRENT]} s): ${WHAT[$CURRENT]}"
    : >"$WORK/.results-$CURRENT"
    GPU_SH_CHECK=$CURRENT GPU_SH_RESULTS="$WORK/.results-$CURRENT" \
        timeout -k 20 "${BUDGET[$CURRENT]}" bash "$SELF" "${CHILD_ARGS[@]}" 3>&- 4>&- &
    child=$!
    wait "$child"
    code=$?
    child=""
    collect "$CURRENT" "$code" exit
    TIMES+=("$CURRENT $((SECONDS - started)) s (${BUDGET[$CURRENT]}),")
done
TIMES[-1]=${TIMES[-1]%,}
finish "$FAILED"
