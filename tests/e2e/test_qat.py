"""Quantization-aware training end to end: `scaletrain train --precision.qat int8_int4` learns, and `scaletrain
convert --quantize` writes the real int8/int4 model whose validation loss is the fake-quant model's."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.checkpoint.convert import load_quantized
from scaletrain.cli import main
from scaletrain.config import Config
from scaletrain.config.io import read_toml, to_dataclass
from scaletrain.data import build_loader, load_tokenizer
from scaletrain.errors import CONFIG_EXIT_CODE
from scaletrain.precision.qat import mean_loss
from tests.helpers import events, train_cli

pytest.importorskip("torchao", reason="QAT needs torchao: the fp8 extra")

# Measured (debug model, 20 steps): converted and fake-quant losses bit-equal; held to this relative gap.
CONVERTED_GAP = 1e-4


def test_qat_trains_and_converts_to_an_int_model_with_the_fake_quant_loss(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "quantized"
    train_cli(
        run, steps=20, precision__qat="int8_int4", training__eval_interval=10, checkpoint__async_save=False
    )
    val = [e["val_loss"] for e in events(run, "eval")]
    assert len(val) == 3 and val[0] > val[1] > val[2] and val[0] - val[2] > 2  # measured 6.6 -> 2.7

    assert main(["convert", "--quantize", "int8_int4", str(run), str(out)]) == 0
    assert "fake-quant" in capsys.readouterr().out
    report = json.loads((out / "quantization.json").read_text())
    loss = report["loss"]
    assert report["trained_with_qat"] == "int8_int4" and report["val_sequences"] == 16
    assert report["converted_vs_fake_quant_rel"] < CONVERTED_GAP
    # The same validation set as the run's own evaluation, and the run really trained fake-quantised: its last
    # evaluation is the fake-quant model's loss, not the float model's (which differs: measured by ~1e-3).
    assert abs(loss["fake_quant"] - val[-1]) < 1e-5 < abs(loss["float"] - val[-1])

    model = load_quantized(out)
    w = model.layers["0"].feed_forward.w1.weight
    assert type(w).__name__ == "IntxUnpackedToInt8Tensor" and w.qdata.dtype == torch.int8
    assert -8 <= w.qdata.min() and w.qdata.max() <= 7  # int4 values
    cfg, _ = to_dataclass(Config, read_toml(str(out / "config.toml")))
    assert cfg.precision.qat == "int8_int4"
    loader = build_loader(cfg.data, load_tokenizer(cfg.data.tokenizer), 8, 0, 1, cfg.training.seed)
    batches = loader.val_batches(cfg.training.eval_sequences, cfg.training.micro_batch)
    assert (
        abs(mean_loss(model, batches, None) - loss["converted"]) < 1e-6
    )  # what was written is what was measured

    # Bad input: nothing is overwritten, and a missing path gets the usage.
    assert main(["convert", "--quantize", "int8_int4", str(run), str(out)]) != 0
    assert "not empty" in capsys.readouterr().err
    assert main(["convert", "--quantize", "int8_int4", str(run)]) == CONFIG_EXIT_CODE
    assert "--quantize {int8_int4,int8_int8} RUN_OR_CHECKPOINT OUT_DIR" in capsys.readouterr().err
