"""Why did a worker fail, and is another restart worth it? `classify` reads the exit status, the signal and the
last lines of the worker's log; `RestartPolicy` turns a run of diagnoses into restart-or-stop decisions."""

from __future__ import annotations

import json
import re
import signal as _signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.errors import CONFIG_EXIT_CODE
from scaletrain.resilience.watchdog import HANG_EXIT_CODE

KINDS = (
    "out_of_memory",
    "collective_timeout",
    "hang",
    "nan",
    "killed",
    "preempted",
    "config_error",
    "user_exception",
    "unknown",
)

_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory|can't allocate memory",
    re.IGNORECASE,
)
# What the kernel's OOM killer leaves behind (dmesg, a container runtime's or a scheduler's message).
_OOM_KILLER = re.compile(r"oom[-_ ]?kill|Out of memory: Killed process|OOMKilled|oom_reaper", re.IGNORECASE)
# gloo and NCCL give up on a collective (or a peer died under it); the c10d store timing out at rendezvous.
_COLLECTIVE = re.compile(
    r"Watchdog caught collective operation timeout"
    r"|Timed out waiting \d+ms for \w+ operation"  # gloo unbound_buffer / pair
    r"|Connection closed by peer|Connection reset"
    r"|NCCL communicator was aborted|NCCL (?:error|timeout)|ncclRemoteError|ncclSystemError"
    r"|ProcessGroupNCCL.*?(?:timeout|timed out)|ProcessGroupGloo.*?(?:timeout|timed out)"
    r"|Socket Timeout|DistNetworkError|DistStoreError",
    re.IGNORECASE,
)
_NAN = re.compile(r"non-finite loss|rollbacks? exhausted|\bNaN\b.*\broll(?:ed)? ?back", re.IGNORECASE)
_CONFIG = re.compile(r"problem\(s\) in the configuration")
# Our log line "step 12/100 | loss ..." (train._log_line) and phrases such as "... at step 12".
_STEP = re.compile(r"\bstep (\d+)/\d+|\bat step (\d+)", re.IGNORECASE)
# torchrun's --tee prefixes each worker's output line with "[default0]:" (or --log-line-prefix-template's).
_RANK_PREFIX = re.compile(r"^\[[^\]\s]*\]:? ?")
_USER_ERROR = re.compile(r"^error: ")  # scaletrain.errors.report_errors: a UserError is one "error: ..." line
_TRACEBACK = "Traceback (most recent call last):"
_HEX = re.compile(r"0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class Diagnosis:
    """One failure: `kind` (one of KINDS), whether a restart can cure it, a one-line detail, and the step the log
    last names (the last logged step or an "at step N" phrase; None when the log names none)."""

    kind: str
    curable: bool
    detail: str
    step: int | None = None


def classify(exitcode: int | None, signal: int | None, log_tail: str) -> Diagnosis:
    """Classify a failure from its exit status, the signal that ended it (if any) and the end of its log.

    `exitcode` may be negative (torch elastic reports death by signal N as -N) or 128+N (the shell's form).
    Messages in the log decide first where they are specific (OOM, collective timeout), then exit codes and
    signals; a Python traceback without a known cause is a `user_exception`.
    """
    sig = _signal_of(exitcode, signal)
    step = parse_step(log_tail)

    def make(kind: str, detail: str) -> Diagnosis:
        return Diagnosis(kind, curable=kind != "config_error", detail=detail, step=step)

    if exitcode == CONFIG_EXIT_CODE or _CONFIG.search(log_tail):
        return make(
            "config_error", _matching_line(_CONFIG, log_tail) or f"exit code {exitcode}: configuration error"
        )
    if exitcode == HANG_EXIT_CODE:
        return make("hang", f"the watchdog ended a hung worker (exit code {exitcode})")
    if line := _matching_line(_OOM, log_tail):
        return make("out_of_memory", line)
    if sig == _signal.SIGKILL and (line := _matching_line(_OOM_KILLER, log_tail)):
        return make("out_of_memory", f"SIGKILL by the OOM killer: {line}")
    if line := _matching_line(_COLLECTIVE, log_tail):
        return make("collective_timeout", line)
    if line := _matching_line(_NAN, log_tail):
        return make("nan", line)
    if sig == _signal.SIGKILL:
        return make("killed", "killed by SIGKILL (the OOM killer, a scheduler, or a user)")
    if sig == _signal.SIGTERM:
        return make("preempted", "ended by SIGTERM (preemption or a scheduler's stop)")
    if exc := last_exception(log_tail):
        return make("user_exception", exc)
    if sig is not None:
        return make("unknown", f"killed by {_signal_name(sig)}")
    if line := _matching_line(_USER_ERROR, log_tail):
        return make("unknown", line)
    return make("unknown", f"exit code {exitcode}" if exitcode is not None else "no exit status")


# What a rank reports when a PEER failed: it lost the connection in a collective, or crashed without a message.
_CONSEQUENCES = ("collective_timeout", "unknown")


def root_cause(diagnoses: list[tuple[float, int, Diagnosis]]) -> tuple[int, Diagnosis]:
    """Of every failed rank's (time, rank, diagnosis), the one that explains the failure: the earliest whose cause
    is its own (killed, hang, OOM, an exception ...) rather than a peer's loss (a collective error, an unexplained
    exit). The agent notices the deaths of one group at about the same moment, so time alone would often name a
    rank that only lost its connection to the one that died. Returns (rank, diagnosis)."""
    if not diagnoses:
        raise ValueError("no failure to diagnose")
    ordered = sorted(diagnoses, key=lambda d: (d[2].kind in _CONSEQUENCES, d[0], d[1]))
    return ordered[0][1], ordered[0][2]


def parse_step(text: str) -> int | None:
    """The step the text names last: "step 12/100 | ..." or "... at step 12"; None when it names none."""
    last = None
    for m in _STEP.finditer(text):
        last = m
    if last is None:
        return None
    return int(last.group(1) or last.group(2))


def last_exception(text: str) -> str | None:
    """The exception line of the last traceback in `text`, "Type: message" as Python printed it (first line of a
    multi-line message); None without a traceback. Of chained tracebacks ("During handling ...") the last one is
    the exception that ended the process."""
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if not starts:
        return None
    # Frames ("  File ...", source lines, "^^^^" markers) are indented; the exception line is the first that is not.
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line[0].isspace():
            return line.strip()[:300]
    return None


@dataclass
class RestartPolicy:
    """Restart or stop after a failure. Stops when the failure is not curable, when the same error recurs at the
    same step (a deterministic bug: every restart would replay it), or when `max_restarts` are used up."""

    max_restarts: int
    restarts: int = 0
    _seen: Counter = field(default_factory=Counter, repr=False)

    def decide(self, diag: Diagnosis) -> tuple[bool, str]:
        """Return (restart?, reason); a granted restart counts against `max_restarts`."""
        what = f"{diag.kind}: {diag.detail}" + (f" (step {diag.step})" if diag.step is not None else "")
        if not diag.curable:
            return False, f"not curable by a restart: {what}"
        # Only an error with a message can be told apart from chance: an exception, NaN, OOM. A collective timeout
        # or a SIGKILL that repeats at one step is as likely a flaky peer as a bug, and is bounded by max_restarts.
        if diag.step is not None and diag.kind in ("user_exception", "nan", "out_of_memory"):
            # Object addresses ("<Tensor at 0x7f3a...>") differ from run to run; they do not make another error.
            key = (diag.kind, _HEX.sub("0x?", diag.detail), diag.step)
            self._seen[key] += 1
            if self._seen[key] >= 2:
                return (
                    False,
                    f"the same failure happened twice at step {diag.step}, so it is deterministic: {what}",
                )
        if self.restarts >= self.max_restarts:
            return False, f"restarts used up ({self.restarts} of {self.max_restarts}): {what}"
        self.restarts += 1
        return True, f"restart {self.restarts} of {self.max_restarts} after {what}"


def read_error_file(path: str | Path) -> str:
    """The traceback (or message) in a torch elastic error file; "" when the file is missing or unreadable.

    A worker wrapped in `torch.distributed.elastic.multiprocessing.errors.record` writes
    `{"message": {"message": "Type: msg", "extraInfo": {"py_callstack": TRACEBACK, "timestamp": "..."}}}` to
    `$TORCHELASTIC_ERROR_FILE`; older writers and the agent may write `{"message": "text", "timestamp": N}`.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return ""
    message = data.get("message", "") if isinstance(data, dict) else ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        return str(stack or message.get("message", ""))
    return str(message)


def tail(path: str | Path, n: int) -> str:
    """The last `n` lines of a text file, read from its end (logs can be large); "" when it does not exist."""
    if n <= 0:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            pos, data = f.tell(), b""
            # n lines need n newlines before them, plus one if the file ends with a newline.
            while pos > 0 and data.count(b"\n") <= n:
                step = min(8192, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    return "".join(lines[-n:])


def _signal_of(exitcode: int | None, sig: int | None) -> int | None:
    if sig is not None:
        return sig
    if exitcode is not None and exitcode < 0:
        return -exitcode
    if exitcode is not None and 128 < exitcode <= 128 + 64:
        return exitcode - 128
    return None


def _signal_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _matching_line(pattern: re.Pattern, text: str) -> str | None:
    """The last log line matching `pattern`, trimmed (the last one is nearest to the failure)."""
    for line in reversed(text.splitlines()):
        line = _RANK_PREFIX.sub("", line, count=1)
        if pattern.search(line):
            return line.strip()[:300]
    return None
