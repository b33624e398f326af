"""Throughput over a window of steps, honest about what is excluded: checkpoint stalls and evaluation are not
training time (they are reported on their own, and goodput counts them), everything else the user waits for is."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from scaletrain.config import MetricsConfig
from scaletrain.metrics.memory import peak_memory_mib
from scaletrain.metrics.mfu import device_peak_flops, mfu, model_flops_per_token, over_peak_action
from scaletrain.models.llama import ModelArgs
from scaletrain.precision.policy import Precision

log = logging.getLogger("scaletrain")


class StepMeter:
    """Counts steps and their tokens since the last `read()`; `read()` turns the window into tokens/s, MFU, step
    time and peak memory, then starts the next window. Logging itself costs in the next window: tokens/s stays
    wall-clock honest. A step's tokens are its own (`step_done(tokens)`: a batch ramp's early steps are smaller),
    `tokens_per_step` otherwise."""

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops_total: float,
        device: torch.device,
        warmup_steps: int = 0,
        on_over_peak: Callable[[float], None] | None = None,
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops_total = peak_flops_total
        self.device = device
        self.warmup_left = warmup_steps
        self.compile_s: float | None = None
        self.on_over_peak = on_over_peak
        # Once an MFU went above 100%, the peak every later MFU divides by is suspect.
        self.peak_suspect = False
        self.reset()

    @classmethod
    def for_job(
        cls,
        metrics: MetricsConfig,
        precision: Precision,
        args: ModelArgs,
        active_params: int,
        seq_len: int,
        tokens_per_step: int,
        world_size: int,
        device: torch.device,
        compile: bool,
        cache_dir: Path,
        event: Callable[..., None],
        first: Callable[[Callable[[], tuple[float, str]]], tuple[float, str]],
    ) -> tuple[StepMeter, str]:
        """A job's meter, and where its MFU peak came from: the peak is measured once per machine (`first`: rank 0
        first, the others then read its cache)."""
        peak, source = first(
            lambda: device_peak_flops(device, precision.mfu_peak, metrics.peak_tflops, cache_dir)
        )
        flops_tok = model_flops_per_token(active_params, args, seq_len)
        over_peak = over_peak_action(event, device, precision.mfu_peak, metrics.peak_tflops, cache_dir)
        return cls(tokens_per_step, flops_tok, peak * world_size, device, compile, over_peak), source

    def reset(self) -> None:
        """Start a new window now (also after a rollback: the steps replayed are not throughput)."""
        self.t0 = time.perf_counter()
        self.steps = self.tokens = 0
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Time inside the window that is not training (a checkpoint stall, an evaluation)."""
        self.excluded += seconds

    def step_done(self, tokens: int | None = None) -> None:
        self.steps += 1
        self.tokens += self.tokens_per_step if tokens is None else tokens
        if self.warmup_left:
            # torch.compile compiles during the first step: its time is reported as compile_s, not throughput.
            self.warmup_left -= 1
            now = time.perf_counter()
            self.compile_s = now - self.t0 - self.excluded
            log.info("torch.compile: the first step took %.1f s, not counted in tokens/s", self.compile_s)
            self.compile_tokens = self.tokens
            self.t0, self.steps, self.tokens, self.excluded = now, 0, 0, 0.0

    def _check_peak(self, value: float) -> None:
        """An MFU above 100% means the peak it divides by is too low: say so once, with what to do, and hand the
        figure to on_over_peak (an `mfu_over_peak` event; the cached CPU peak dropped). From then on every record
        carries `mfu_peak_suspect`, so no reader takes those MFUs for true."""
        if value <= 1 or self.peak_suspect:
            return
        self.peak_suspect = True
        log.warning(
            "MFU %.0f%% is above 100%%: the peak FLOP/s it divides by is too low, and this run's MFU figures are "
            "marked mfu_peak_suspect. On a CPU the peak is measured and cached (cpu_peak.json in the data cache), "
            "perhaps while the machine was busy: the next run measures it again; or set metrics.peak_tflops",
            100 * value,
        )
        if self.on_over_peak is not None:
            self.on_over_peak(value)

    def read(self) -> dict[str, float]:
        if self.device.type == "cuda":
            # The window ends when the queued kernels have run, not when they were launched.
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed = max(now - self.t0 - self.excluded, 1e-9)
        steps = max(self.steps, 1)
        tps = self.tokens / elapsed
        extra = {} if self.compile_s is None else {"compile_s": self.compile_s}
        if self.steps == 0 and self.compile_s is not None:
            # A window of the compile step alone: its own figures, marked by compile_s.
            elapsed, tps = self.compile_s, self.compile_tokens / self.compile_s
        self.compile_s = None
        utilisation = mfu(tps, self.flops_per_token, self.peak_flops_total)
        self._check_peak(utilisation)
        if self.peak_suspect:
            extra["mfu_peak_suspect"] = True
        out = {
            "tokens_per_s": tps,
            "mfu": utilisation,
            "mem_peak_mib": peak_memory_mib(self.device),
            "step_time_s": elapsed / steps,
            **extra,
        }
        self.t0, self.steps, self.tokens, self.excluded = now, 0, 0, 0.0
        return out
