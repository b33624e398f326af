"""The live console view (scaletrain.metrics.progress): what the bar shows beside step/total."""

import io
import re
import time

from rich.console import Console

from scaletrain.metrics import MetricsWriter, Progress
from scaletrain.metrics.progress import stats_text


def test_stats_show_loss_throughput_mfu_lr_and_the_last_event():
    text = stats_text(2.34567, 12345.0, 3e-4, mfu=0.4104, event="checkpoint_saved (step 100)")
    assert text == "loss 2.3457  12.3k tok/s  mfu 41.0%  lr 3.00e-04  | checkpoint_saved (step 100)"
    # Before the first MFU reading and event: neither is shown (not "mfu 0.0%").
    assert stats_text(2.0, 100.0, 1e-3) == "loss 2.0000  100 tok/s  lr 1.00e-03"


def test_bar_on_a_terminal_shows_step_eta_mfu_and_event():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)  # no colour codes
    with Progress(total_steps=100, start_step=0, enabled=True, console=console) as progress:
        for step in range(1, 6):
            time.sleep(0.01)  # the ETA comes from the rate of recent updates
            progress.update(
                step, loss=3.0, tokens_per_s=5000.0, lr=1e-3, mfu=0.25, event=f"eval (step {step})"
            )
    last = out.getvalue().rsplit("\r", 1)[-1]  # the final frame
    assert "5/100" in last and "loss 3.0000" in last and "5k tok/s" in last and "mfu 25.0%" in last
    assert "| eval (step 5)" in last
    eta = re.search(r"eta (\S+)", last)
    assert eta and re.fullmatch(r"\d+:\d\d:\d\d", eta.group(1)), last  # a time, not rich's "-:--:--"


def test_writer_remembers_the_last_event_for_the_bar(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as writer:
        assert writer.last_event == ""
        writer.event("checkpoint_saved", step=10, path="x")
        assert writer.last_event == "checkpoint_saved (step 10)"
        writer.event("job_start")
        assert writer.last_event == "job_start"
