"""The GPU check: one command for a lent GPU machine's image as it is (its python3 and torch, PYTHONPATH=., no
network; benchmarks/gpu_check.sh starts it). Each phase runs under a time cap of its own, so one hang cannot eat
the budget, and is recorded as passed, failed or skipped with the reason; a failed phase does not stop the next.
Written under $OUT: gpu_check.log (all output), gpu_check.json (every phase, rewritten after each), planner.txt;
a one-screen table is printed at the end. Run dirs and checkpoints go to a scratch folder outside $OUT.

  env          python, torch, the CUDA device (name, capability, memory), the torch range check, missing packages
  pytest_gpu   python -m pytest -m gpu tests/gpu (one GPU: MULTI_GPU_UNRUN lists what stays unrun)
  throughput   PRESET in bf16 at SEQ: scaletrain's train() beside a bare PyTorch loop on the same model and
               batches (benchmarks/throughput.py, each side in its own process): tokens/s, MFU, peak memory
  compiled     the same with training.compile (torch.compile per block), if the budget leaves room
  checkpoint   async checkpoints on the device; SIGKILL after the first committed save; the same command again
               must resume from that step (events.jsonl through RunDir)
  planner      benchmarks/planner_validate.py --gpu: calibrate, then predicted beside measured for 125M and 1B
               with two recompute policies, if PLANNER_MIN_S of the budget remain
  fp8          fp8 beside bf16 (speed, loss after 50 steps) where torchao imports and the GPU has fp8 units

Environment: DEVICE (cuda), PRESET (1B), SEQ (2048), BATCH (8), BUDGET (seconds for every phase: 390), PHASES
(comma list), COMPILE (1/0; default on a GPU only), PY (the interpreter of the sub-runs: this one). On a CPU:
DEVICE=cpu PRESET=debug bash benchmarks/gpu_check.sh (tiny sizes; the dry run of the plumbing).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["env", "pytest_gpu", "throughput", "compiled", "checkpoint", "planner", "fp8"]
# Run order: the figures that matter most first, so that a short budget drops the optional ones.
RUN_ORDER = ["env", "pytest_gpu", "throughput", "checkpoint", "compiled", "planner", "fp8"]
MULTI_GPU_UNRUN = [
    "NCCL collectives between ranks (NCCL refuses two ranks on one GPU): DDP and its comm hooks (bf16, PowerSGD)",
    "FSDP2 / ZeRO-2 / ZeRO-3 / HSDP sharding across GPUs, and resharded resume across GPU counts",
    "tensor and sequence parallel, context parallel (ring attention) and expert all-to-all over NCCL",
    "pipeline stages on separate GPUs (send/recv over NCCL)",
    "--nproc N with one GPU per worker (torchrun's elastic agent), elastic restarts, straggler detection",
]
NEEDED = [
    "numpy",
    "tokenizers",
    "safetensors",
    "pyarrow",
    "rich",
    "tomli_w",
    "tensorboard",
    "matplotlib",
    "fsspec",
]
PLANNER_MIN_S = 150
# Seconds of budget a phase needs to be worth starting (compiled, planner and fp8 check their own, after the reasons
# that skip them anyway): below it the phase is skipped for the budget instead of being killed half-way.
MIN_LEFT = {"pytest_gpu": 30, "throughput": 40, "checkpoint": 40}


@dataclass
class Sizes:
    preset: str
    seq: int
    batch: int
    precision: str
    threads: int
    ckpt_preset: str
    ckpt_seq: int
    ckpt_interval: int
    ckpt_steps: int
    caps: dict[str, float] = field(default_factory=dict)


def sizes(device: str) -> Sizes:
    env = os.environ.get
    if device == "cuda":  # one H200, about 7 minutes in all (docs/performance.md, GPU check)
        s = Sizes(
            preset=env("PRESET", "1B"), seq=int(env("SEQ", "2048")), batch=int(env("BATCH", "8")),
            precision="bf16", threads=8, ckpt_preset="125M", ckpt_seq=512, ckpt_interval=20, ckpt_steps=120,
        )  # fmt: skip
        s.caps = {"pytest_gpu": 180, "side": 100, "compiled_side": 150, "ckpt_run": 75, "fp8_side": 90}
    else:  # the dry run of the plumbing: seconds
        s = Sizes(
            preset=env("PRESET", "debug"), seq=int(env("SEQ", "64")), batch=int(env("BATCH", "8")),
            precision="fp32", threads=1, ckpt_preset="debug", ckpt_seq=64, ckpt_interval=5, ckpt_steps=40,
        )  # fmt: skip
        s.caps = {"pytest_gpu": 120, "side": 60, "compiled_side": 200, "ckpt_run": 60, "fp8_side": 60}
    return s


class Check:
    def __init__(self, out: Path, device: str, budget: float):
        self.out, self.device, self.budget = out, device, budget
        self.t0 = time.monotonic()
        self.py = os.environ.get("PY") or sys.executable
        self.sizes = sizes(device)
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.env.setdefault("SCALETRAIN_CACHE", str(self.scratch / "cache"))
        self.lock = threading.Lock()
        self.log = (out / "gpu_check.log").open("w")
        self.result: dict = {
            "device": device,
            "budget_s": budget,
            "phases": {},
            "multi_gpu_unrun": MULTI_GPU_UNRUN,
        }

    # -- output
    def say(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
            self.log.write(text if text.endswith("\n") else text + "\n")
            self.log.flush()

    def record(self, name: str, status: str, seconds: float, reason: str = "", **figures) -> dict:
        entry = {"status": status, "seconds": round(seconds, 1), "reason": reason, **figures}
        self.result["phases"][name] = entry
        self.result["wall_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1, default=str))
        self.say(f"== {name}: {status} in {seconds:.0f} s{': ' + reason if reason else ''}")
        return entry

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def cap(self, wanted: float) -> float:
        return max(0.0, min(wanted, self.left()))

    # -- sub-processes
    def run(self, argv: list[str], cap: float, *, echo: bool = True) -> tuple[int | None, list[str]]:
        """Run argv from the repo root in a session of its own, its output into the log; killed (the whole group)
        after `cap` seconds. Returns (exit status or None when killed, its output lines)."""
        self.say(f"$ {' '.join(argv)}   (cap {cap:.0f} s)")
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=self._pump, args=(proc, lines, echo), daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            rc = None
        reader.join(timeout=10)
        return rc, lines

    def _pump(self, proc: subprocess.Popen, lines: list[str], echo: bool) -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                self.say(line)
            else:
                with self.lock:
                    self.log.write(line)

    def kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def train_argv(self, *overrides: str) -> list[str]:
        return [self.py, "-m", "scaletrain", "train", "--config", "configs/debug.toml", *overrides]


def config_key(*candidates: str) -> str:
    """The first dotted key the config tree has (a key that moved between sections is found under either name)."""
    import dataclasses

    from scaletrain.config import Config

    for dotted in candidates:
        node: object = Config()
        for part in dotted.split("."):
            if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
                break
            node = getattr(node, part)
        else:
            return dotted
    raise KeyError(f"none of {candidates} is a config key")


def flag(*candidates: str) -> str:
    return "--" + config_key(*candidates)


# ---------------------------------------------------------------------------------------------------- phases


def phase_env(c: Check) -> None:
    t0 = time.monotonic()
    import torch

    info: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "missing": [m for m in NEEDED if importlib.util.find_spec(m) is None],
        "torchao": importlib.util.find_spec("torchao") is not None,
    }
    problems = []
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count, gpus=torch.cuda.device_count(),
        )  # fmt: skip
    elif c.device == "cuda":
        problems.append("DEVICE=cuda but torch sees no CUDA device")
    try:
        import scaletrain
        from scaletrain.hardware import gpu_peak_flops

        info["torch_in_range"] = scaletrain.torch_version_problem(torch.__version__) is None
        if "gpu" in info:
            info["bf16_peak_tflops"] = (gpu_peak_flops(info["gpu"], "bf16") or 0) / 1e12
    except ImportError as e:
        problems.append(f"import scaletrain: {e}")
    if info["missing"]:
        problems.append(f"missing packages {info['missing']} (bring their wheels in .gpu_wheels/)")
    c.say(json.dumps(info))
    c.record("env", "failed" if problems else "passed", time.monotonic() - t0, "; ".join(problems), **info)


def phase_pytest_gpu(c: Check) -> None:
    t0 = time.monotonic()
    cap = c.cap(c.sizes.caps["pytest_gpu"])
    argv = [c.py, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider", "tests/gpu"]
    rc, lines = c.run(argv, cap)
    # One line per test (-v), so a run killed at its cap still says which tests finished and how.
    results = dict(
        re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", "\n".join(lines), re.M)
    )
    counts: dict[str, int] = {}
    for outcome in results.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    failed = [t for t, outcome in results.items() if outcome in ("FAILED", "ERROR")]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "")
    extra = {"counts": counts, "summary": summary.strip("= "), "failed_tests": failed}
    seconds = time.monotonic() - t0
    if rc is None:
        done = ", ".join(f"{n} {k}" for k, n in counts.items()) or "none finished"
        c.record("pytest_gpu", "failed", seconds, f"timed out after {cap:.0f} s ({done})", **extra)
    elif rc == 0 and counts.get("passed", 0) == 0:
        c.record("pytest_gpu", "skipped", seconds, "no CUDA device: every GPU test skipped", **extra)
    elif rc == 5:
        c.record("pytest_gpu", "skipped", seconds, "pytest collected no GPU test", **extra)
    elif rc == 0:
        c.record("pytest_gpu", "passed", seconds, "one GPU: the multi-GPU paths stay unrun", **extra)
    else:
        why = f"pytest exit {rc}: {', '.join(failed) or summary}"
        c.record("pytest_gpu", "failed", seconds, why, **extra)


def _side(c: Check, side: str, compiled: bool, cap: float) -> tuple[dict | None, str]:
    s = c.sizes
    out = c.scratch / f"{side}-{'compiled' if compiled else 'eager'}.json"
    argv = [
        c.py,
        "benchmarks/throughput.py",
        "--side",
        side,
        "--device",
        c.device,
        "--precision",
        s.precision,
    ]
    argv += ["--preset", s.preset, "--seq-len", str(s.seq), "--batch", str(s.batch), "--steps", "15"]
    argv += ["--warmup", "5", "--log-interval", "5", "--threads", str(s.threads), "--json", str(out)]
    rc, lines = c.run(argv + (["--compile"] if compiled else []), cap, echo=False)
    if rc is None:
        return None, f"{side}: timed out after {cap:.0f} s"
    if rc != 0 or not out.is_file():
        tail = " | ".join(lines[-3:])
        c.say("\n".join(lines[-30:]))
        return None, f"{side}: exit {rc}: {tail[-300:]}"
    return json.loads(out.read_text()), ""


def _compare(ours: dict, bare: dict) -> dict:
    """The figures of one pair; the bare loop's MFU against the same peak as ours (off the GPU table: the peak
    scaletrain's own MFU was computed with)."""
    mfu_bare = bare["mfu"]
    if mfu_bare is None and ours.get("mfu_reported"):
        mfu_bare = ours["mfu_reported"] * bare["tokens_per_s"] / ours["tokens_per_s"]
    return {
        "tokens_per_s": {"scaletrain": round(ours["tokens_per_s"]), "bare": round(bare["tokens_per_s"])},
        "ratio": round(ours["tokens_per_s"] / bare["tokens_per_s"], 3),
        "mfu": {"scaletrain": ours["mfu"] or ours.get("mfu_reported"), "bare": mfu_bare},
        "mfu_reported": ours.get("mfu_reported"),
        "peak_mem_mib": {"scaletrain": ours["peak_mem_mib"], "bare": bare["peak_mem_mib"]},
        "mean_step_s": {"scaletrain": ours["mean_step_s"], "bare": bare["mean_step_s"]},
        "final_loss": {"scaletrain": ours["final_loss"], "bare": bare["final_loss"]},
        "setup": f"{ours['preset']} {ours['precision']} seq {ours['seq_len']} batch {ours['batch']}, "
        f"{ours['timed_steps']} timed steps after 5, on {ours['device']}",
    }


def throughput(c: Check, name: str, compiled: bool) -> None:
    t0 = time.monotonic()
    cap_key = "compiled_side" if compiled else "side"
    if compiled and os.environ.get("COMPILE", "1" if c.device == "cuda" else "0") != "1":
        c.record(
            name,
            "skipped",
            0,
            "compile is off on a CPU dry run (minutes of C++ builds on 2 cores); COMPILE=1 runs it",
        )
        return
    if c.left() < 0.6 * c.sizes.caps[cap_key]:
        c.record(name, "skipped", 0, f"time budget: {c.left():.0f} s left of {c.budget:.0f}")
        return
    results, errors = {}, []
    for side in ("scaletrain", "bare"):
        results[side], err = _side(c, side, compiled, c.cap(c.sizes.caps[cap_key]))
        errors += [err] if err else []
    seconds = time.monotonic() - t0
    if errors:
        c.record(name, "failed", seconds, "; ".join(errors), **{k: v for k, v in results.items() if v})
        return
    figures = _compare(results["scaletrain"], results["bare"])
    c.record(name, "passed", seconds, "", **figures)


def phase_checkpoint(c: Check) -> None:
    """Async saves, a SIGKILL as soon as one is committed, then the same command: it must resume from there."""
    from scaletrain.run.directory import RunDir

    t0 = time.monotonic()
    s, run_dir = c.sizes, c.scratch / "ckpt-run"
    argv = c.train_argv(
        "--model.preset", s.ckpt_preset, "--training.device", c.device,
        flag("precision.compute", "training.precision"), s.precision, "--data.seq_len", str(s.ckpt_seq),
        "--training.global_batch", "8", "--training.micro_batch", "8", "--training.steps", str(s.ckpt_steps),
        "--training.eval_interval", "0", "--checkpoint.interval", str(s.ckpt_interval),
        "--checkpoint.async_save", "true", "--metrics.log_interval", str(s.ckpt_interval),
        "--metrics.progress", "false", "--metrics.tensorboard", "false", "--run.dir", str(run_dir),
    )  # fmt: skip
    run = RunDir.at(run_dir)
    cap = c.cap(c.sizes.caps["ckpt_run"])
    c.say(f"$ {' '.join(argv)}   (killed after its first committed save; cap {cap:.0f} s)")
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=c.env, stdout=c.log, stderr=subprocess.STDOUT, start_new_session=True
    )
    saved_at = None
    while time.monotonic() - t0 < cap and proc.poll() is None:
        if any(e.get("kind") == "checkpoint_saved" for e in run.read_events()):
            saved_at = time.monotonic() - t0
            break
        time.sleep(0.05)
    c.kill(proc)
    saved = [e["step"] for e in run.read_events() if e.get("kind") == "checkpoint_saved"]
    figures: dict = {"saved_steps": saved, "first_save_s": saved_at, "steps": s.ckpt_steps}
    if saved_at is None or not saved:
        why = f"exit {proc.returncode}" if proc.returncode not in (None, -9) else f"{cap:.0f} s"
        c.record(
            "checkpoint",
            "failed",
            time.monotonic() - t0,
            f"no committed save before the run ended ({why})",
            **figures,
        )
        return
    t1 = time.monotonic()
    rc, _ = c.run(argv, c.cap(c.sizes.caps["ckpt_run"]), echo=False)
    figures["resume_run_s"] = round(time.monotonic() - t1, 1)
    events = run.read_events()
    loaded = [(e["step"], e.get("source")) for e in events if e.get("kind") == "checkpoint_loaded"]
    starts = [(e.get("step"), e.get("resumed")) for e in events if e.get("kind") == "start"]
    last = max((m["step"] for m in run.read_metrics()), default=None)
    figures.update(killed_after_step=max(saved), loaded=loaded, starts=starts, last_step=last)
    figures["resumed_from"] = loaded[-1][0] if loaded else None
    problems = []
    if rc != 0:
        problems.append(f"the second run exited {rc}")
    if not loaded or loaded[-1][0] != max(saved):
        problems.append(f"expected a load of step {max(saved)} (the last committed save), got {loaded}")
    if not starts or starts[-1][1] is not True:
        problems.append(f"the second start is not a resume: starts {starts}")
    if last != s.ckpt_steps:
        problems.append(f"the resumed run ended at step {last}, not {s.ckpt_steps}")
    status = "failed" if problems else "passed"
    c.record("checkpoint", status, time.monotonic() - t0, "; ".join(problems), **figures)


def phase_planner(c: Check) -> None:
    t0 = time.monotonic()
    if c.device != "cuda":
        c.record(
            "planner",
            "skipped",
            0,
            "needs CUDA (planner_validate.py --gpu); on a CPU: benchmarks/planner_validate.py",
        )
        return
    if c.left() < PLANNER_MIN_S:
        c.record(
            "planner",
            "skipped",
            0,
            f"time budget: {c.left():.0f} s left, the planner needs {PLANNER_MIN_S}; PHASES=planner runs it alone",
        )
        return
    argv = [c.py, "benchmarks/planner_validate.py", "--gpu", "--repeats", "1", "--steps", "12"]
    rc, lines = c.run([*argv, "--cache", str(c.scratch / "planner")], c.cap(c.left()))
    (c.out / "planner.txt").write_text("\n".join(lines) + "\n")
    table = [ln for ln in lines if re.search(r"\b(125M|1B)\b", ln)][-8:]
    status = "passed" if rc == 0 else "failed"
    reason = "" if rc == 0 else ("timed out (budget)" if rc is None else f"exit {rc}")
    c.record("planner", status, time.monotonic() - t0, reason, rows=table)


def phase_fp8(c: Check) -> None:
    t0 = time.monotonic()
    import torch

    if importlib.util.find_spec("torchao") is None:
        c.record(
            "fp8",
            "skipped",
            0,
            "torchao is not installed here (the fp8 extra; no network on the machine): `make gpu-wheels FP8=1` puts torchao 0.18.0 (3.4 MB; it imports with torch 2.11) in .gpu_wheels/ to run it",
        )
        return
    if c.device != "cuda" or torch.cuda.get_device_capability(0) < (8, 9):
        c.record("fp8", "skipped", 0, "needs a CUDA GPU with compute capability >= 8.9 (fp8 units)")
        return
    if c.left() < 100:
        c.record("fp8", "skipped", 0, f"time budget: {c.left():.0f} s left")
        return
    from scaletrain.run.directory import RunDir

    figures, problems = {}, []
    for precision in ("bf16", "fp8"):
        run_dir = c.scratch / f"fp8-{precision}"
        argv = c.train_argv(
            "--model.preset", c.sizes.preset, "--training.device", "cuda",
            flag("precision.compute", "training.precision"), precision, "--data.seq_len", str(c.sizes.seq),
            "--training.global_batch", str(c.sizes.batch), "--training.micro_batch", str(c.sizes.batch),
            "--training.steps", "50", "--training.eval_interval", "0", "--checkpoint.enabled", "false",
            "--metrics.log_interval", "10", "--metrics.progress", "false", "--metrics.tensorboard", "false",
            "--run.dir", str(run_dir),
        )  # fmt: skip
        rc, _ = c.run(argv, c.cap(c.sizes.caps["fp8_side"]), echo=False)
        rows = RunDir.at(run_dir).read_metrics()
        if rc != 0 or not rows:
            problems.append(f"{precision}: exit {rc}")
            continue
        timed = rows[1:] or rows
        tps = sum(r["tokens_per_s"] for r in timed) / len(timed)
        figures[precision] = {"tokens_per_s": round(tps), "loss_50": rows[-1]["loss"]}
    if not problems:
        figures["speedup"] = round(figures["fp8"]["tokens_per_s"] / figures["bf16"]["tokens_per_s"], 3)
    c.record("fp8", "failed" if problems else "passed", time.monotonic() - t0, "; ".join(problems), **figures)


PHASES = {
    "env": phase_env,
    "pytest_gpu": phase_pytest_gpu,
    "throughput": lambda c: throughput(c, "throughput", compiled=False),
    "compiled": lambda c: throughput(c, "compiled", compiled=True),
    "checkpoint": phase_checkpoint,
    "planner": phase_planner,
    "fp8": phase_fp8,
}


# ----------------------------------------------------------------------------------------------------- table


def _brief(name: str, p: dict) -> str:
    if p["status"] != "passed" or name in ("pytest_gpu", "planner"):
        text = p.get("summary") or p.get("reason") or ""
        return text if name != "pytest_gpu" or p["status"] != "passed" else f"{p['summary']} (one GPU)"
    if name == "env":
        gpu = f"{p['gpu']} cc {p['capability']}, {p['memory_gib']} GiB" if p.get("gpu") else "no GPU"
        return f"torch {p['torch']}, python {p['python']}, {gpu}"
    if name in ("throughput", "compiled"):
        tps, mfu, mem = p["tokens_per_s"], p["mfu"], p["peak_mem_mib"]

        def one(side: str) -> str:
            m = f"{100 * mfu[side]:.1f}%" if mfu[side] is not None else "-"
            gib = f"{mem[side] / 1024:.1f} GiB" if mem[side] is not None else "-"
            return f"{tps[side]:,} tok/s, MFU {m}, {gib}"

        return f"ours {one('scaletrain')} | bare {one('bare')} | ratio {p['ratio']:.3f}"
    if name == "checkpoint":
        return (
            f"saved {p['saved_steps']}, killed, resumed from step {p['resumed_from']} to {p['last_step']}; "
            f"first save {p['first_save_s']:.0f} s, resumed run {p['resume_run_s']:.0f} s"
        )
    if name == "fp8":
        return f"bf16 {p['bf16']}, fp8 {p['fp8']}, speed-up {p['speedup']}"
    return ""


def table(c: Check) -> None:
    width = shutil.get_terminal_size((120, 20)).columns
    c.say(f"\n{'phase':<11} {'status':<8} {'secs':>5}  figures / reason")
    for name in ORDER:
        p = c.result["phases"].get(name)
        if p is not None:
            line = f"{name:<11} {p['status']:<8} {p['seconds']:>5.0f}  {_brief(name, p)}"
            c.say(line if len(line) <= max(width, 120) else line[: max(width, 120) - 1] + "…")
    c.say(f"wall {c.result['wall_s']:.0f} s; log and JSON in {c.out}")


def main() -> int:
    out = Path(os.environ.get("OUT") or "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = os.environ.get("DEVICE", "cuda")
    c = Check(out, device, float(os.environ.get("BUDGET", "390" if device == "cuda" else "240")))
    wanted = [p.strip() for p in os.environ.get("PHASES", ",".join(ORDER)).split(",") if p.strip()]
    c.say(f"== gpu check: DEVICE={device}, sizes {c.sizes}, budget {c.budget:.0f} s, phases {wanted}")
    try:
        for name in RUN_ORDER:
            if name not in wanted:
                c.record(name, "skipped", 0, "not in PHASES")
                continue
            if c.left() < MIN_LEFT.get(name, 0):
                c.record(name, "skipped", 0, f"time budget: {c.left():.0f} s left of {c.budget:.0f}")
                continue
            try:
                PHASES[name](c)
            except Exception as e:  # one phase's bug must not stop the others
                c.record(name, "failed", 0, f"{type(e).__name__}: {e}")
        table(c)
    finally:
        if os.environ.get("KEEP") != "1":
            shutil.rmtree(c.scratch, ignore_errors=True)
    return 1 if any(p["status"] == "failed" for p in c.result["phases"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
