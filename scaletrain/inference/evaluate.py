"""Mean loss per token and perplexity of a model over text, packed as training packs it: the data package reads and
tokenises the files into cached shards (each document followed by the end-of-document token), cut into windows of
seq_len + 1 tokens (inputs, and targets shifted by one), and the loss is the training cross-entropy."""

from __future__ import annotations

import glob
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data import TokenShards, list_files, resolve_cache_dir, split_windows
from scaletrain.data.prepare import Progress, prepare_source, to_stderr
from scaletrain.errors import UserError
from scaletrain.inference.loader import LoadedModel
from scaletrain.models import Transformer
from scaletrain.models.attention import document_ids


@dataclass
class EvalResult:
    loss: float
    """Mean cross-entropy per predicted token (nats)."""
    perplexity: float
    tokens: int
    """Predicted tokens: windows x seq_len."""
    windows: int
    seq_len: int

    def render(self, as_json: bool) -> str:
        if as_json:
            return json.dumps(asdict(self))
        return (
            f"loss {self.loss:.6f} per token, perplexity {self.perplexity:.4f} ({self.tokens:,} tokens in "
            f"{self.windows} window(s) of {self.seq_len})"
        )


def token_stream(data: str, tokenizer: object, field: str = "text") -> TokenShards:
    """The tokens of a file, directory or glob (text, jsonl or parquet by suffix), prepared as `prepare-data`
    does (and cached alike: the same files are tokenised once)."""
    if not Path(data).expanduser().exists() and not glob.glob(str(Path(data).expanduser()), recursive=True):
        raise UserError(
            f"--data {data!r} matches no files; give a text, jsonl or parquet file, a directory or a glob"
        )
    src = SourceConfig(path=data, format="auto", field=field)
    try:
        files = list_files(src, 0)
        prepared, _, _ = prepare_source(
            files, src.format, src.field, tokenizer, resolve_cache_dir(DataConfig()), workers=1, index=0,
            progress=lambda line: to_stderr(_flags(line)),
        )  # fmt: skip
    except UserError as e:
        raise UserError(_flags(str(e))) from None
    return TokenShards(prepared)


def _flags(text: str) -> str:
    """The data package names its source as it is configured for training (data.sources[0].field); here it is
    the command's flags."""
    text = text.replace("data.sources[0].field", "--field").replace("data.sources[0].path", "--data")
    return text.replace("data.sources[0]", "--data")


@torch.no_grad()
def mean_loss(
    model: Transformer,
    stream: TokenShards,
    seq_len: int,
    batch: int = 8,
    max_windows: int = 0,
    eod_id: int | None = None,
) -> EvalResult:
    """The loss over every window of `stream` (the first `max_windows` when > 0). eod_id: mask attention at
    document boundaries, for a model trained with data.document_mask."""
    n, _ = split_windows(stream.num_tokens, seq_len, 0.0)
    if max_windows > 0:
        n = min(n, max_windows)
    if n == 0:
        raise UserError(
            f"the data has {stream.num_tokens:,} tokens, too few for one window of --seq-len {seq_len} (that needs "
            f"{seq_len + 1}); give more text or a smaller --seq-len"
        )
    device = next(model.parameters()).device
    total, count = 0.0, 0
    progress = Progress(to_stderr)
    for first in range(0, n, batch):
        if progress.due():
            done = f"{first:,}/{n:,} windows ({first * seq_len:,} tokens)"
            progress.emit(f"eval: {done}, {progress.elapsed():.0f}s")
        rows = [stream.window(i * seq_len, seq_len + 1) for i in range(first, min(first + batch, n))]
        x = torch.from_numpy(np.stack(rows)).to(device)
        inputs, targets = x[:, :-1], x[:, 1:]
        docs = document_ids(inputs, eod_id) if eod_id is not None else None
        total += float(model(inputs, document_ids=docs, targets=targets).double())
        count += targets.numel()
    loss = total / count
    return EvalResult(loss, math.exp(min(loss, 50.0)), count, n, seq_len)


def evaluate_text(
    loaded: LoadedModel,
    data: str,
    seq_len: int = 0,
    batch: int = 8,
    max_windows: int = 0,
    field: str = "text",
) -> EvalResult:
    """`scaletrain eval`: the loaded model's loss over `data` in windows of `seq_len` (0: the model's context)."""
    context = loaded.args.max_seq_len
    seq_len = seq_len or context
    if not 0 < seq_len <= context:
        raise UserError(f"--seq-len {seq_len} must be in 1..{context} (the model's context)")
    if batch < 1:
        raise UserError(f"--batch {batch} must be >= 1")
    stream = token_stream(data, loaded.tokenizer, field)
    eod = loaded.tokenizer.eod_id if loaded.document_mask else None
    return mean_loss(loaded.model, stream, seq_len, batch, max_windows, eod)
