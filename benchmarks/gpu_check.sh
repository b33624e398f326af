#!/usr/bin/env bash
# The GPU check of one CUDA machine, in four timed phases (never run: no GPU has been lent to this work yet):
#   1. the GPU tests: python -m pytest -q -m gpu tests/gpu
#   2. the 125M preset, bf16, 50 steps on the default config: tokens/s, MFU and peak memory from its metrics
#   3. 30 steps with checkpoints, then a resume to 50 steps (--run.accept_changes training.steps), checked in
#      events.jsonl (checkpoint_loaded from storage at step 30, a resumed start event) and against phase 2: with a
#      constant LR after warmup (both phases) the schedule does not depend on the run's length, so the resumed
#      run's final loss must match the uninterrupted one (to 5%: GPU kernels are not deterministic)
#   4. the planner: calibrate this GPU, then predicted beside measured memory and step time for the 125M and 1B
#      presets without and with selective recompute (benchmarks/planner_validate.py --gpu; PLANNER=0 skips it)
# Everything is also written to ${OUT:-/tmp}/gpu_check.log; the run directories go to ${OUT:-/tmp}/gpu_check.
# Checkpoints and tokenised data stay outside $OUT (GBs that need not travel back).
#
# Knobs (environment), for a dry run of the plumbing on a CPU and for other machines:
#   DEVICE=cuda|cpu   --training.device (default cuda; cpu proves the plumbing only: phase 1 is then all skipped)
#   PRESET=125M       --model.preset;  PRECISION=bf16   --training.precision
#   STEPS=50          the length of phases 2 and 3;  RESUME_AT=30   where phase 3 stops and resumes
#   PY=...            an interpreter with scaletrain installed (default .venv/bin/python; .venv is created, as
#                     the Makefile does, when missing: that needs the network)
#   EXTRA_ARGS="..."  more --section.key VALUE overrides for every training run
# A CPU dry run, e.g.: DEVICE=cpu PRESET=debug PRECISION=fp32 STEPS=10 RESUME_AT=6 bash benchmarks/gpu_check.sh
set -euo pipefail

cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-125M}
PRECISION=${PRECISION:-bf16}
STEPS=${STEPS:-50}
RESUME_AT=${RESUME_AT:-30}
EXTRA_ARGS=${EXTRA_ARGS:-}
BASE=${OUT:-/tmp}
WORK=$BASE/gpu_check
LOG=$BASE/gpu_check.log
SCRATCH=${TMPDIR:-/tmp}/gpu_check-scratch
export SCALETRAIN_CACHE=${SCALETRAIN_CACHE:-$SCRATCH/cache}
export TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK" "$SCRATCH"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1

declare -a RESULTS=()
FAILED=0

phase_done() { # name status seconds
    RESULTS+=("$(printf '%-28s %-8s %6ss' "$1" "$2" "$3")")
    echo "== $1: $2 in $3 s"
    [[ $2 == passed || $2 == skipped ]] || FAILED=1
}

# -- Environment -----------------------------------------------------------------------------------------------
if [[ -z ${PY:-} ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        echo "== creating .venv (torch==2.13.0 from PyPI, then -e '.[test]'; needs the network)"
        python3 -m venv .venv
        .venv/bin/pip install --quiet --upgrade pip
        .venv/bin/pip install --quiet torch==2.13.0 # first and pinned, as the Makefile installs it
        .venv/bin/pip install --quiet -e '.[test]'
    fi
    PY=.venv/bin/python
fi
echo "== $(date -u +%FT%TZ) on $(hostname); device=$DEVICE preset=$PRESET precision=$PRECISION steps=$STEPS"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
DEVICE=$DEVICE "$PY" - <<'EOF'
import os, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
elif os.environ["DEVICE"] == "cuda":
    sys.exit("DEVICE=cuda but torch sees no CUDA device (a CPU build of torch, or no driver): nothing to check")
EOF

COMMON=(--config configs/default.toml --model.preset "$PRESET" --training.precision "$PRECISION"
    --training.device "$DEVICE" --metrics.log_interval 10 --metrics.progress false
    --metrics.tensorboard false --optimizer.schedule constant)
# shellcheck disable=SC2206 # EXTRA_ARGS is split on purpose: it holds several flags
COMMON+=($EXTRA_ARGS)

train() { "$PY" -m scaletrain train "${COMMON[@]}" "$@"; }

# -- 1. GPU tests ----------------------------------------------------------------------------------------------
t0=$SECONDS
rc=0
"$PY" -m pytest -q -m gpu tests/gpu || rc=$?
if [[ $DEVICE != cuda && ($rc == 0 || $rc == 5) ]]; then
    status=skipped # no CUDA device: every test skipped (0), or none collected (5)
elif [[ $rc == 0 ]]; then
    status=passed
elif [[ $rc == 5 ]]; then
    status=skipped
    echo "pytest collected no GPU test (exit 5)"
else
    status="failed($rc)"
fi
phase_done "1 pytest -m gpu" "$status" $((SECONDS - t0))

# -- 2. Throughput of the preset ---------------------------------------------------------------------------------
t0=$SECONDS
RUN2=$WORK/throughput
rm -rf "$RUN2"
rc=0
train --run.dir "$RUN2" --training.steps "$STEPS" --checkpoint.enabled false || rc=$?
if [[ $rc == 0 ]]; then
    "$PY" - "$RUN2" <<'EOF' && status=passed || status=failed
import json, math, sys
from pathlib import Path
run = Path(sys.argv[1])
metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines() if l.strip()]
end = [e for e in events if e["kind"] == "end"][-1]
print(f"{'step':>5} {'loss':>8} {'tokens/s':>11} {'MFU %':>7} {'peak MiB':>9} {'step s':>7}")
for m in metrics:
    loss = "null" if m["loss"] is None else f"{m['loss']:.4f}"
    print(f"{m['step']:>5} {loss:>8} "
          f"{m['tokens_per_s']:>11.0f} {100 * m['mfu']:>7.2f} {m['mem_peak_mib']:>9.0f} {m['step_time_s']:>7.3f}")
steady = metrics[1:] or metrics  # the first window pays for warm-up (kernel selection, allocator growth)
tps = sum(m["tokens_per_s"] for m in steady) / len(steady)
mfu = sum(m["mfu"] for m in steady) / len(steady)
print(f"RESULT tokens/s {tps:.0f} (mean after the first window; the end summary says {end['tokens_per_s']:.0f}), "
      f"MFU {100 * mfu:.2f}% (summary {100 * end['mfu']:.2f}%), "
      f"peak memory {max(m['mem_peak_mib'] for m in metrics):.0f} MiB, final loss {end['final_loss']:.4f}, "
      f"wall {end['wall_s']:.1f} s")
bad = [m["step"] for m in metrics if m["loss"] is None or not math.isfinite(m["loss"])]
sys.exit(f"non-finite loss at steps {bad}" if bad else 0)
EOF
else
    status="failed($rc)"
fi
phase_done "2 throughput $PRESET" "$status" $((SECONDS - t0))

# -- 3. Checkpoint, then resume to a longer run ----------------------------------------------------------------
t0=$SECONDS
RUN3=$WORK/resume
CKPT=$SCRATCH/checkpoints
rm -rf "$RUN3" "$CKPT"
rc=0
SAVE=(--run.dir "$RUN3" --checkpoint.storage "$CKPT" --checkpoint.interval $((RESUME_AT / 2)))
train "${SAVE[@]}" --training.steps "$RESUME_AT" || rc=$?
if [[ $rc == 0 ]]; then
    train "${SAVE[@]}" --training.steps "$STEPS" --run.accept_changes training.steps || rc=$?
fi
if [[ $rc == 0 ]]; then
    "$PY" - "$RUN3" "$RESUME_AT" "$STEPS" "$RUN2" <<'EOF' && status=passed || status=failed
import json, math, sys
from pathlib import Path
run, at, steps, uninterrupted = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines() if l.strip()]
loaded = [(e["step"], e.get("source")) for e in events if e["kind"] == "checkpoint_loaded"]
starts = [(e["step"], e["resumed"]) for e in events if e["kind"] == "start"]
saved = [e["step"] for e in events if e["kind"] == "checkpoint_saved"]
lines = (run / "metrics.jsonl").read_text().splitlines()
metrics = {m["step"]: m["loss"] for m in (json.loads(l) for l in lines if l.strip())}
print(f"checkpoints saved at {saved}; loaded {loaded}; starts (step, resumed) {starts}")
print(f"losses by step: {[(s, round(l, 4) if l is not None else None) for s, l in sorted(metrics.items())]}")
problems = []
if loaded != [(at, "storage")]:
    problems.append(f"expected one checkpoint_loaded of step {at} from storage, got {loaded}")
if starts != [(0, False), (at, True)]:
    problems.append(f"expected starts [(0, False), ({at}, True)], got {starts}")
if max(metrics) != steps or any(l is None or not math.isfinite(l) for l in metrics.values()):
    problems.append(f"expected finite losses up to step {steps}, got {metrics}")
reference = uninterrupted / "metrics.jsonl"
if reference.is_file() and not problems:
    lines = [l for l in reference.read_text().splitlines() if l.strip()]
    want = {m["step"]: m["loss"] for m in map(json.loads, lines)}.get(steps)
    if want is None or not math.isfinite(want):
        problems.append(f"phase 2 has no finite loss at step {steps} to compare with")
    else:
        rel = abs(metrics[steps] - want) / abs(want)
        print(f"final loss {metrics[steps]:.4f} resumed, {want:.4f} uninterrupted (phase 2): rel. diff {rel:.1e}")
        if rel > 5e-2:
            problems.append(f"the resumed run ends at loss {metrics[steps]}, the uninterrupted one at {want}")
print("RESULT resume:", "ok" if not problems else "; ".join(problems))
sys.exit(1 if problems else 0)
EOF
else
    status="failed($rc)"
fi
rm -rf "$CKPT"
phase_done "3 checkpoint + resume" "$status" $((SECONDS - t0))

# -- 4. The planner on this GPU: calibrate it, then predicted beside measured for 125M and 1B -------------------
# (planner_validate.py --gpu; skipped on a CPU, where benchmarks/planner_validate.py without --gpu is the check)
t0=$SECONDS
if [[ $DEVICE == cuda && ${PLANNER:-1} == 1 ]]; then
    "$PY" benchmarks/planner_validate.py --gpu --repeats 2 --steps 12 --cache "$SCRATCH/planner" &&
        status=passed || status="failed($?)"
else
    status=skipped
fi
phase_done "4 planner on the GPU" "$status" $((SECONDS - t0))

echo "== summary (log: $LOG, runs: $WORK)"
printf '%s\n' "${RESULTS[@]}"
exit "$FAILED"
