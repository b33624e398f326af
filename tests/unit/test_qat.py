"""Quantization-aware training: torchao's fake quantisation really changes the blocks' Linear outputs, the convert
step reproduces it with int-stored weights, checkpoints keep the plain weight names, and bad settings are refused
with the fix."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scaletrain.checkpoint.state import ModelState
from scaletrain.config import PrecisionConfig
from scaletrain.errors import ConfigError
from scaletrain.models import ModelArgs, build_model
from scaletrain.precision.qat import (
    apply_qat,
    convert_qat,
    fake_quantized_linears,
    load_quantized_state,
    qat_problems,
    save_quantized,
)
from scaletrain.run.resume import resume_problems
from scaletrain.validate import load_config

pytest.importorskip("torchao", reason="QAT needs torchao: the fp8 extra")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128, max_seq_len=32)
INT4 = PrecisionConfig(qat="int8_int4", qat_group_size=16)


def _model() -> torch.nn.Module:
    return build_model(ARGS, 0, torch.device("cpu"))


def _tokens() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_fake_quant_changes_the_output_and_convert_reproduces_it_with_int_weights():
    plain, qat = _model(), apply_qat(_model(), INT4)
    assert fake_quantized_linears(qat) == 7 * ARGS.n_layers  # wq wk wv wo w1 w2 w3; not the output head
    assert type(qat.output) is torch.nn.Linear
    x = _tokens()
    ref, fake = plain(x), qat(x)
    # Same weights, different function: int4 weights and int8 activations move the logits visibly.
    assert (fake - ref).abs().max() > 1e-2
    fq_weight = qat.layers["0"].attention.wq.weight_fake_quantizer(qat.layers["0"].attention.wq.weight)
    converted = convert_qat(qat, INT4)
    assert fake_quantized_linears(converted) == 0
    w = converted.layers["0"].attention.wq.weight
    assert type(w).__name__ == "IntxUnpackedToInt8Tensor" and w.qdata.dtype == torch.int8
    assert w.qdata.min() >= -8 and w.qdata.max() <= 7  # int4 values, one per int8
    assert w.scale.shape == (ARGS.dim, ARGS.dim // INT4.qat_group_size)  # a scale per group of 16 inputs
    # The real model computes what training simulated: dequantised weights equal the fake-quantised ones, and the
    # logits match (measured: bit-equal; 1e-5 leaves room for another kernel's summation order).
    torch.testing.assert_close(w.dequantize(), fq_weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(converted(x), fake, rtol=0, atol=1e-5)


def test_int8_weights_use_the_int8_range():
    m = convert_qat(_model(), PrecisionConfig(qat="int8_int8", qat_group_size=32))  # plain: PTQ
    q = m.layers["1"].feed_forward.w2.weight.qdata
    assert q.dtype == torch.int8 and q.abs().max() > 8  # more than int4's levels


def test_a_qat_checkpoint_has_the_plain_names_and_loads_into_a_plain_model(tmp_path):
    qat = apply_qat(_model(), INT4)
    with torch.no_grad():
        for p in qat.parameters():
            p.add_(0.01)  # weights the fresh plain model does not have
    assert qat.state_dict().keys() == _model().state_dict().keys()  # the fake quantisers keep no state
    dcp.save({"model": ModelState([qat])}, checkpoint_id=str(tmp_path), no_dist=True)
    plain = _model()
    dcp.load({"model": ModelState([plain])}, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in qat.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


def test_the_quantised_model_round_trips_through_safetensors(tmp_path):
    m = convert_qat(copy.deepcopy(_model()), INT4)
    path = save_quantized(m, tmp_path, {"scheme": "int8_int4", "group_size": 16})
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, not a pickle
    state, meta = load_quantized_state(path)
    assert meta == {"scheme": "int8_int4", "group_size": 16} and state.keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        got = state[k]
        assert type(got) is type(v), k
        if hasattr(v, "qdata"):
            assert torch.equal(got.qdata, v.qdata) and torch.equal(got.scale, v.scale), k
        else:
            assert torch.equal(got, v), k


def test_qat_problems_name_the_fix():
    assert qat_problems(PrecisionConfig(), ARGS, tp=2) == []  # off: nothing to check
    assert qat_problems(INT4, ARGS, tp=1) == []
    (bad,) = qat_problems(PrecisionConfig(qat="int8_int4", qat_group_size=48), ARGS, tp=1)
    assert (
        "qat_group_size 48 does not divide" in bad and "feed_forward.w2 (128)" in bad and "use one of" in bad
    )
    assert "[64, 32, 16, 8]" in bad
    (tp,) = qat_problems(INT4, ARGS, tp=2)
    assert "parallel.tp > 1" in tp and "precision.qat = none" in tp
    (fp8,) = qat_problems(PrecisionConfig(qat="int8_int4", qat_group_size=16, compute="fp8"), ARGS, tp=1)
    assert "precision.compute fp8" in fp8 and "fp32, bf16 or fp16" in fp8
    assert qat_problems(PrecisionConfig(qat="int8_int4", qat_group_size=16, compute="bf16"), ARGS, tp=1) == []
    assert "must be >= 1" in qat_problems(PrecisionConfig(qat="int8_int8", qat_group_size=0), ARGS, tp=1)[0]


def test_bad_qat_settings_are_refused_before_launch():
    with pytest.raises(ConfigError) as e:
        load_config("configs/debug.toml", ["--precision.qat", "int4"], check_run_dir=False)
    assert "precision.qat" in str(e.value) and "int8_int4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(
            "configs/debug.toml",
            ["--precision.qat", "int8_int4", "--precision.qat_group_size", "48", "--parallel.tp", "2"],
            world_size=2,
            check_run_dir=False,
        )
    # Both problems at once: the debug model's dim 128 is no multiple of 48, and tp is refused.
    assert "qat_group_size 48" in str(e.value) and "parallel.tp > 1" in str(e.value)


def test_qat_cannot_change_on_resume():
    saved, new = {"precision": {"qat": "none"}}, {"precision": {"qat": "int8_int4"}}
    (p,) = resume_problems(saved, new, accepted=["precision"])
    assert "precision.qat" in p and "cannot continue" in p
