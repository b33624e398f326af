"""checkpoint.last_save_in_hf: the job itself writes its final weights as a Hugging Face directory, beside its DCP
checkpoints (torchtitan's `last_save_in_hf`), so that `transformers` or another framework reads them with no
`convert` step.

Every rank takes part: each tensor in turn is gathered whole (`DTensor.full_tensor()`: FSDP, TP and EP shards;
replicated DDP/ZeRO-1/2 tensors are read as they are), cast and written by the job's first rank through the export's
own writer (core.write_hf: the family's adapter, sharded safetensors and their index, config.json, tokenizer), then
freed; a rank holds about one whole tensor at a time, never the model. The directory holds weights only: the
optimizer state and the data position stay in the DCP checkpoints, which are what a resume reads
(docs/checkpointing.md). Loading it into a run is `model.init_from = "hf:DIR"` (each rank reads its slices).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint.hf.core import write_hf
from scaletrain.checkpoint.hf.families import adapter
from scaletrain.checkpoint.state import ModelState
from scaletrain.config import CheckpointConfig
from scaletrain.models.llama import ModelArgs
from scaletrain.parallel.mesh import broadcast_object

log = logging.getLogger(__name__)


def hf_dir(run_dir: Path, step: int) -> Path:
    """Where the export of `step` goes: one directory per final step, so a run continued to a later end adds one and
    never overwrites the earlier."""
    return run_dir / f"hf-step-{step:08d}"


def pipeline_problem(last_save_in_hf: bool, pp: int) -> str | None:
    if last_save_in_hf and pp > 1:
        return (
            "checkpoint.last_save_in_hf with parallel.pp > 1 is refused: each pipeline stage holds other layers, "
            "and the export gathers each tensor over its own stage's ranks; export after the run with "
            "`scaletrain convert --to hf RUN_DIR OUT_DIR`, which reads the final checkpoint in any layout"
        )
    return None


def save_hf(
    parts: list[nn.Module],
    args: ModelArgs,
    out: Path,
    writes: bool,
    tokenizer_file: Path | None = None,
    eod_id: int | None = None,
    eod_token: str | None = None,
) -> str | None:
    """Collective: every rank holding `parts` calls it, and the rank that `writes` writes `out` (fp32, as trained).
    Returns why nothing was written (the same on every rank, decided before any write: an export the family's
    adapter refuses), else None. The other ranks make the same gathers in the same order as
    write_hf reads: the routing biases first (its checks), then every tensor."""
    state = ModelState(parts).state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    biases = [k for k in shapes if k.endswith("router.expert_bias")]

    def read(name: str) -> torch.Tensor:
        value = state[name]
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()

    family = adapter(args.family)
    problems = family.export_problems(args, {k: read(k) for k in biases})
    if problems:
        return f"not exported as {family.architecture(args)}: " + "; ".join(problems)
    if writes:
        write_hf(out, args, shapes, read, tokenizer_file, eod_id, eod_token)
        log.info("final weights written as a Hugging Face directory: %s", out)
    else:
        for name in biases + list(shapes):
            read(name)
    return None


@dataclass
class FinalExport:
    """What the job calls after its final save (train.Job.close), when checkpoint.last_save_in_hf is on."""

    parts: list[nn.Module]
    args: ModelArgs
    run_dir: Path
    writes: bool  # the job's first rank (with fault_tolerance: group 0's); the others gather with it
    agree: Callable[[object], object]  # rank 0's value on every rank (broadcast over the control group)
    event: Callable[..., None]
    tokenizer_file: Path | None
    eod_id: int | None
    eod_token: str | None

    @classmethod
    def for_job(
        cls,
        checkpoint: CheckpointConfig,
        tokenizer_path: str,
        tokenizer,
        parts: list[nn.Module],
        args: ModelArgs,
        run_dir: Path,
        writes: bool,
        control: dist.ProcessGroup | None,
        event: Callable[..., None],
    ) -> FinalExport | None:
        """The job's export when checkpoint.last_save_in_hf is on, else None; `tokenizer_path`: data.tokenizer."""
        if not checkpoint.last_save_in_hf:
            return None
        tok_file = Path(tokenizer_path) if tokenizer_path != "byte" else None
        agree = partial(broadcast_object, group=control)
        eod_token = getattr(tokenizer, "eod_token", None)
        return cls(parts, args, run_dir, writes, agree, event, tok_file, tokenizer.eod_id, eod_token)

    def __call__(self, step: int) -> None:
        out = hf_dir(self.run_dir, step)
        if self.agree(out.exists()):  # one decision: a rank that skipped would leave the others in a gather
            log.warning("%s exists already (an earlier end at step %d): kept, not written again", out, step)
            return
        why = save_hf(
            self.parts, self.args, out, self.writes, self.tokenizer_file, self.eod_id, self.eod_token
        )
        if why is not None:
            log.warning(
                "checkpoint.last_save_in_hf: %s (the DCP checkpoint of step %d has the weights)", why, step
            )
        self.event("hf_saved" if why is None else "hf_not_saved", step=step, path=str(out), reason=why)
