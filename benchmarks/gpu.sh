#!/usr/bin/env bash
# The GPU acceptance run: the real `megaformer prepare/train/parity/translate/evaluate`
# commands on one CUDA GPU (budget 8 minutes on an H200; not yet timed on one), one summary line per check.
#
#   benchmarks/gpu.sh                      on a machine with a CUDA GPU (nccl, torch with CUDA)
#   DEVICE=cpu benchmarks/gpu.sh --dry     every step for a few steps on the CPU (gloo), to check the script
#
# a. nccl on 1 GPU, bf16 ZeRO-1 and fp16 ZeRO-2: tiny for 200 steps, a checkpoint at 100,
#    kill -9 at step ~120, `--resume auto` to 200; steps 101-200 against an uninterrupted run.
#    Tolerance: bitwise where the GPU kernels are deterministic; the embedding backward
#    (index_add with atomics) and attention backward are not, so two uninterrupted bf16/fp16
#    runs already differ in the last bits of a 7-bit (bf16) / 10-bit (fp16) mantissa: a resume
#    that restores every state exactly stays within RESUME_TOL (1 %) per step, while a wrong
#    restore (warm-up, Adam step, loss scale, data position, dropout masks) moves the loss
#    by more (the first step after a restart from a fresh optimizer moves it by > 10 %).
# b. two processes on the one GPU, gloo, TP=2: `megaformer parity` and 50 training steps
#    (CUDA tensors through gloo where the tree has `parallel.device`; said on the line).
# c. a CPU-written checkpoint resumed on CUDA (losses of steps 31-60 against the CPU's own
#    continuation, CROSS_TOL 2 %: TF32 vs fp32 matmuls), and translate/evaluate on CUDA
#    against the CPU (the same hypotheses for >= 95 % of the sentences, BLEU within 1).
# d. the Trainer's waits for the device in a steady step (benchmarks/host_overhead.py: one read,
#    one CUDA synchronisation), then transformer_base and transformer_big (bf16, ZeRO-1, compiled layers; COMPILE=false for
#    eager) on a WMT'14-shaped corpus (200,000 pairs, ~27 pieces a side, 37,000 pieces) through
#    the Trainer on one GPU, one line each: the layout, steady target tokens/s and MFU against
#    the dense bf16 peak (H200: 989 TFLOP/s) as the Trainer logs them, the model alone
#    (benchmarks/gpu_throughput.py: the same micro-batch, bf16 weights with fp32 copies as
#    DeepSpeed keeps them, so its compiled layers come from the Trainer's Inductor cache) and the
#    Trainer's share of it, and from a 3-step profile (train.profile_from) the GPU's busy share
#    and the top 10 kernels. --dry runs d eagerly unless COMPILE=true.
#
# Exit status: 0 when every check passes, 124 when stopped by TERM or INT (the summary so far is
# printed). WORK=DIR keeps the runs (default: a temporary folder; a second call with the same
# WORK keeps its prepared data and replaces its runs); CHECKS=ad runs only those checks (default
# abcd: a-c and d may then go in separate calls of a time-limited session); LOGS=DIR receives
# every run's log, metrics and profile summary as each check ends.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE=${DEVICE:-cuda}
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
CHECKS=${CHECKS:-abcd}
LOGS=${LOGS:-}
if [[ ! "$CHECKS" =~ ^[abcd]+$ ]]; then
    echo "gpu.sh: CHECKS=$CHECKS: name the checks to run with the letters a, b, c and d (e.g. CHECKS=ad)" >&2
    exit 2
fi
if [ -n "$LOGS" ] && ! mkdir -p "$LOGS" 2>/dev/null; then
    echo "gpu.sh: LOGS=$LOGS: cannot make that folder (a file there, or no write permission)" >&2
    exit 2
fi
WORK=${WORK:-$(mktemp -d /tmp/megaformer-gpu.XXXXXX)}
mkdir -p "$WORK"
RESUME_TOL=${RESUME_TOL:-0.01}
CROSS_TOL=${CROSS_TOL:-0.02}
BEGAN=$SECONDS
SUMMARY=()
FAILED=0
pid=""  # check a's trainer, in its own session while it runs

if [ "$DRY" = 1 ]; then
    STEPS=20 SAVE=10 KILL_AT=12 TP_STEPS=5 CPU_STEPS=12 CPU_SAVE=6 BIG_STEPS=8 TEST_LINES=20
    WMT_PAIRS=3000 WMT_VOCAB=4000 PROFILE_FROM=3 COMPILE=${COMPILE:-false}
    BIG_SIZE=(--set model.encoder_layers=1 --set model.decoder_layers=1 --set train.tokens_per_step=1024
        --set data.max_tokens=512 --set data.num_workers=1 --set train.log_interval=1)
    ALONE=(--set model.encoder_layers=1 --set model.decoder_layers=1 --steps 2 --warmup 1)
    SMALL=(--set train.tokens_per_step=256 --set data.max_tokens=256)  # tiny's steps, 8x smaller
else
    STEPS=200 SAVE=100 KILL_AT=120 TP_STEPS=50 CPU_STEPS=60 CPU_SAVE=30 BIG_STEPS=40 TEST_LINES=0
    WMT_PAIRS=200000 WMT_VOCAB=37000 PROFILE_FROM=20 COMPILE=${COMPILE:-true}
    BIG_SIZE=(--set train.log_interval=5)
    ALONE=(--steps 10 --warmup 5)
    SMALL=()
fi
if [ "$DEVICE" = cpu ]; then
    export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu
    BACKEND=gloo
else
    BACKEND=nccl
fi

mf() { "$PY" -m megaformer.cli "$@" 3>&- 4>&-; }  # fds 3 and 4: the script's own output (below)
fresh() { rm -rf -- "$@"; }  # a run folder from an earlier call with the same WORK: --resume none refuses it
keep_logs() {                # the small files only: checkpoints stay in $WORK
    [ -n "$LOGS" ] || return 0
    (cd "$WORK" && find . -maxdepth 3 \( -name '*.log' -o -name metrics.jsonl -o -name 'summary-rank*.json' \) \
        -exec cp --parents {} "$LOGS" \;)
}
finish() { # finish STATUS: the logs and the summary, also when a time limit's TERM ends the script
    trap - TERM INT
    [ -n "${pid:-}" ] && kill -9 -- "-$pid" 2>/dev/null  # check a's trainer runs in its own session
    keep_logs
    echo
    echo "summary ($((SECONDS - BEGAN)) s, runs in $WORK):"
    printf '%s\n' "${SUMMARY[@]}"
    exit "$1"
}
exec 3>&1 4>&2  # the script's own output: a trap runs inside the command it interrupted, with its redirections
trap 'exec 1>&3 2>&4; echo "gpu.sh: stopped by a signal"; finish 124' TERM INT
cpu_mf() { CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu "$PY" -m megaformer.cli "$@" 3>&- 4>&-; }
result() { # result PASS|FAIL text...
    local line
    line=$(printf '%-4s %s' "$1" "${*:2}")
    SUMMARY+=("$line")
    [ "$1" = PASS ] || FAILED=1
    echo "== $line"
}
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

echo "megaformer GPU acceptance: device=$DEVICE backend=$BACKEND dry=$DRY work=$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'GPU(s)')"
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA GPU visible: run DEVICE=cpu benchmarks/gpu.sh --dry to check the script on a CPU" >&2
    exit 2
fi
wanted() { [[ "$CHECKS" == *"$1"* ]]; }
DATA=$WORK/data
if wanted a || wanted b || wanted c; then
    [ -f "$DATA/manifest.json" ] || mf prepare --synthetic 4000 --out "$DATA" --quiet || exit 1
fi
TINY=(--config configs/tiny.yaml --set "data.path=$DATA" --set train.log_interval=1 --set train.eval_interval=0 "${SMALL[@]}")


# ---- a. kill -9 and resume, nccl on one GPU -----------------------------------------------------
wanted a && for variant in "bf16 1" "fp16 2"; do
    read -r precision zero <<<"$variant"
    name="a-$precision-zero$zero"
    sets=("${TINY[@]}" --set "parallel.backend=$BACKEND" --set "train.precision=$precision"
        --set "train.zero_stage=$zero" --set "train.max_steps=$STEPS" --set "train.save_interval=$SAVE")
    fresh "$WORK/$name-ref" "$WORK/$name"
    mf train "${sets[@]}" --run-dir "$WORK/$name-ref" --resume none >"$WORK/$name-ref.log" 2>&1
    ref=$?
    setsid "$PY" -m megaformer.cli train "${sets[@]}" --run-dir "$WORK/$name" --resume none >"$WORK/$name.log" 2>&1 3>&- 4>&- &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ "$(last_step "$WORK/$name")" -lt "$KILL_AT" ]; do sleep 0.2; done
    killed_at=$(last_step "$WORK/$name")
    kill -9 -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    pid=""
    mf train "${sets[@]}" --run-dir "$WORK/$name" --resume auto >>"$WORK/$name.log" 2>&1
    resumed=$?
    if [ "$killed_at" -lt "$KILL_AT" ] || [ "$killed_at" -ge "$STEPS" ]; then
        result FAIL "a $precision ZeRO-$zero: the run was at step $killed_at when killed, not between $KILL_AT and $STEPS"
    elif [ "$ref" != 0 ] || [ "$resumed" != 0 ]; then
        result FAIL "a $precision ZeRO-$zero: train exited $ref (uninterrupted) / $resumed (resumed), see $WORK/$name*.log"
    elif line=$(compare "$WORK/$name" "$WORK/$name-ref" $((SAVE + 1)) "$STEPS" "$RESUME_TOL"); then
        result PASS "a $precision ZeRO-$zero $BACKEND: killed -9 at step $killed_at, resumed from $SAVE: $line"
    else
        result FAIL "a $precision ZeRO-$zero $BACKEND: killed -9 at step $killed_at, resumed from $SAVE: $line"
    fi
    keep_logs
done

# ---- b. two processes on the one GPU, gloo, TP=2 ------------------------------------------------
if wanted b; then
tp_sets=(--set parallel.backend=gloo)
where="CPU tensors: this tree has no parallel.device, gloo runs on the CPU"
runner=cpu_mf
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
$runner train "${TINY[@]}" "${tp_sets[@]}" --set parallel.tp=2 --set "train.max_steps=$TP_STEPS" --set train.save_interval=0 \
    --run-dir "$WORK/b-tp2" --resume none --nproc 2 >"$WORK/b-tp2.log" 2>&1
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
keep_logs
fi

# ---- c. a CPU checkpoint resumed on the GPU; translate and evaluate on the GPU ------------------
if wanted c; then
line=""
csets=("${TINY[@]}" --set "train.max_steps=$CPU_STEPS" --set "train.save_interval=$CPU_SAVE")
fresh "$WORK/c-cpu" "$WORK/c-gpu"
cpu_mf train "${csets[@]}" --set parallel.backend=gloo --run-dir "$WORK/c-cpu" --resume none >"$WORK/c-cpu.log" 2>&1
code_cpu=$?
step_dir=$(printf '%s/c-cpu/checkpoints/step-%08d' "$WORK" "$CPU_SAVE")
mf train "${csets[@]}" --set "parallel.backend=$BACKEND" --run-dir "$WORK/c-gpu" --resume "$step_dir" >"$WORK/c-gpu.log" 2>&1
code_gpu=$?
if [ "$code_cpu" = 0 ] && [ "$code_gpu" = 0 ] &&
    line=$(compare "$WORK/c-gpu" "$WORK/c-cpu" $((CPU_SAVE + 1)) "$CPU_STEPS" "$CROSS_TOL"); then
    result PASS "c CPU checkpoint (step $CPU_SAVE) resumed on $DEVICE: $line"
else
    result FAIL "c CPU checkpoint resumed on $DEVICE: train exited $code_cpu (CPU) / $code_gpu ($DEVICE) ${line:-}"
fi
src=$DATA/test.xx ref=$DATA/test.yy
if [ "$TEST_LINES" -gt 0 ]; then
    head -n "$TEST_LINES" "$DATA/test.xx" >"$WORK/test.xx" && head -n "$TEST_LINES" "$DATA/test.yy" >"$WORK/test.yy"
    src=$WORK/test.xx ref=$WORK/test.yy
fi
mf translate --ckpt "$WORK/c-gpu" --input "$src" --output "$WORK/c-translate.$DEVICE" --quiet
t=$?
bleu_dev=$(mf evaluate --ckpt "$WORK/c-gpu" --input "$src" --ref "$ref" --output "$WORK/c-evaluate.$DEVICE" --json --quiet)
e=$?
bleu_cpu=$(cpu_mf evaluate --ckpt "$WORK/c-gpu" --input "$src" --ref "$ref" --output "$WORK/c-evaluate.cpu" --json --quiet)
e_cpu=$?
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
keep_logs
fi

# ---- d. base and big on a WMT'14-shaped corpus: the Trainer against the model alone, and a profile --
WMT=$WORK/wmt14
PROFILE_STEPS=3
if wanted d; then
[ -f "$WMT/manifest.json" ] ||
    mf prepare --synthetic "$WMT_PAIRS" --synthetic-shape wmt14 --vocab-size "$WMT_VOCAB" --out "$WMT" --quiet || exit 1
# The host's waits in a steady step (host_overhead.py: reads of tensor values, CUDA synchronisations): one
host=$("$PY" benchmarks/host_overhead.py --device "$DEVICE" --steps 3 --warmup 2 --json 2>"$WORK/d-host.log" 3>&- 4>&-)
if line=$("$PY" - "$host" <<'EOF'
import json, sys
r = json.loads(sys.argv[1])
reads, syncs = r["megaformer_device_reads_per_step"], r["megaformer_cuda_syncs_per_step"]
print(f"{reads} reads of the device, {'n/a' if syncs is None else syncs} CUDA synchronisations in a steady step "
      f"(target 1 each); host time {r['host_time_ratio']}x a plain loop's ({r['megaformer_step_ms']:.1f} ms a step)")
sys.exit(0 if reads <= 1 and (syncs is None or syncs <= 1) else 1)
EOF
); then
    result PASS "d host work on $DEVICE: $line"
else
    result FAIL "d host work on $DEVICE: ${line:-no result} (see $WORK/d-host.log)"
fi
for model in base big; do
    run=$WORK/d-$model
    fresh "$run"
    mf train --config "configs/transformer_$model.yaml" --set "data.path=$WMT" --set parallel.tp=1 \
        --set "parallel.backend=$BACKEND" --set train.precision=bf16 --set train.zero_stage=1 \
        --set "train.max_steps=$BIG_STEPS" --set train.save_interval=0 --set train.save_minutes=0 \
        --set train.eval_interval=0 --set "train.compile=$COMPILE" --set "train.profile_from=$PROFILE_FROM" \
        --set "train.profile_steps=$PROFILE_STEPS" "${BIG_SIZE[@]}" --run-dir "$run" --resume none >"$run.log" 2>&1
    code=$?
    # "1 micro-batch of <= N tokens" or "K micro-batches of <= N tokens"
    layout=$(grep -oE 'train: [0-9.]*M parameters, tp=[^,]*, [0-9]* micro-batch(es)? of <= [0-9]* tokens' "$run.log" | head -1)
    micro=$(grep -oE 'micro-batch(es)? of <= [0-9]* tokens' <<<"$layout" | grep -oE '[0-9]+')
    compiled=()
    [ "$COMPILE" = true ] && compiled=(--compile)
    alone=$("$PY" benchmarks/gpu_throughput.py --config "configs/transformer_$model.yaml" --device "$DEVICE" \
        --tokens "${micro:-25000}" --len 27 --vocab-size "$WMT_VOCAB" "${ALONE[@]}" "${compiled[@]}" --json 2>>"$run.log" | tail -1)
    if [ "$code" = 0 ] && line=$("$PY" - "$run" "$((PROFILE_FROM + PROFILE_STEPS - 1))" "$alone" <<'EOF'
import json, sys
run, profiled, alone = sys.argv[1], int(sys.argv[2]), sys.argv[3]
records = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"train"' in l]
# A record's rate covers the steps since the record before it: only windows that begin after the
# profile's last step (which also synchronizes and writes the trace), so after compiling too.
steady = [r for before, r in zip(records, records[1:]) if before["step"] >= profiled] or records[-1:]
rate = sum(r["tokens_per_s"] for r in steady) / len(steady)
mfus = [r["mfu"] for r in steady if r["mfu"] is not None]  # None: beyond the peak (a wrong train.peak_tflops)
mfu = sum(mfus) / len(mfus) if mfus else float("nan")
out = f"Trainer {rate:,.0f} target tokens/s, MFU {100 * mfu:.1f} % (steps {steady[0]['step']}-{steady[-1]['step']})"
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
EOF
    ); then
        result PASS "d $model bf16 on $DEVICE (${layout#train: }): $line"
    else
        result FAIL "d $model bf16: train exited $code (see $run.log) ${line:-}"
    fi
    keep_logs
done
fi

finish "$FAILED"
