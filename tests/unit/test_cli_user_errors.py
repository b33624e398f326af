"""Issue 21 (12, 14): what used to end in a traceback, in silence or with the wrong figure. An unwritable cache or
--tokenizer-out is one `error:` line; bench and parity check every variant's whole config before the first run;
thread and worker counts follow the CPUs the process may use, not the machine's; `--version`; progress lines
while data is prepared and evaluated; an HF export whose files others can read and whose tokenizer transformers
loads with its special tokens."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import fsspec
import pytest
import tomli_w
import torch
import torch.distributed.checkpoint as dcp

from scaletrain.checkpoint.convert import to_hf
from scaletrain.checkpoint.hf.core import export_hf
from scaletrain.checkpoint.integrity import write_commit
from scaletrain.checkpoint.state import ModelState
from scaletrain.cli import main
from scaletrain.compare import bench, parity
from scaletrain.config import Config, DataConfig, SourceConfig
from scaletrain.config.io import to_dict
from scaletrain.data import TokenShards, load_tokenizer, prepare
from scaletrain.data.tokenizer import ByteTokenizer, train_bpe
from scaletrain.errors import ConfigError
from scaletrain.hardware import usable_cpus
from scaletrain.inference import mean_loss
from scaletrain.models import build_model, resolve_model_args
from tests.helpers import DEBUG, QUICK


def _one_error_line(capsys: pytest.CaptureFixture, code: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, (code, err)
    assert "Traceback" not in err and all(n in err for n in needles), err
    return err


def test_version_names_the_package_and_torch(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scaletrain 0.1.0 (") and f"torch {torch.__version__}" in out


def test_an_unwritable_cache_or_tokenizer_out_is_one_line(tmp_path, monkeypatch, capsys):
    """A cache or --tokenizer-out under a regular file was a NotADirectoryError / FileExistsError traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SCALETRAIN_CACHE", str(blocker / "cache"))
    code = main(["prepare-data", "--config", DEBUG])
    _one_error_line(
        capsys, code, f"{blocker} is a file, not a directory", "SCALETRAIN_CACHE", "data.cache_dir"
    )
    out = blocker / "tok.json"
    code = main(["prepare-data", "--config", DEBUG, "--train-tokenizer", "--vocab-size", "300", "--tokenizer-out", str(out)])  # fmt: skip
    _one_error_line(capsys, code, f"cannot write the tokenizer to '{out}'", "is a file, not a directory")


def test_bench_and_parity_check_every_variant_before_the_first_run(monkeypatch):
    """The docs say variants are checked before anything runs; a bad value in the last variant surfaced only
    after the plain (bench) or reference (parity) run, minutes later."""
    ran = []
    runner = lambda *a: ran.append(a) or []  # noqa: E731
    with pytest.raises(ConfigError) as e:
        bench.run_bench(DEBUG, ["optimizer.lr=1e-3", "precision.compute=fp7"], QUICK, steps=3, runner=runner)
    assert ran == [] and len(e.value.problems) == 1
    assert e.value.problems[0].startswith("precision.compute=fp7: 'precision.compute' = 'fp7' is not one of")
    monkeypatch.setattr(parity, "run_train", runner)
    with pytest.raises(ConfigError) as e:
        parity.run_parity(DEBUG, ["dp_shard=2", "tp=3"], 2, QUICK, 1e-5, 2e-5)
    assert ran == [] and e.value.problems and all(p.startswith("layout 'tp=3': ") for p in e.value.problems)
    assert any("parallel.tp = 3 does not divide model.n_heads" in p for p in e.value.problems)


def test_usable_cpus_is_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5
    assert usable_cpus(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # cgroup v1, one CPU
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == 1


def _corpus(root: Path, files: int = 3) -> Path:
    root.mkdir()
    for i in range(files):
        (root / f"f{i}.txt").write_text(f"file {i} " * 2000)
    return root


def test_preparing_and_evaluating_print_progress(tmp_path, monkeypatch, capsys):
    """A 65 MB jsonl took 19 s without a line; progress comes at most every PROGRESS_INTERVAL_S (0 here)."""
    monkeypatch.setattr(prepare, "PROGRESS_INTERVAL_S", 0.0)
    data = _corpus(tmp_path / "data")
    lines: list[str] = []
    cfg = DataConfig(sources=[SourceConfig(path=str(data))], cache_dir=str(tmp_path / "cache"), workers=2)
    [(prepared, _)] = prepare.prepare_data(cfg, ByteTokenizer(), log=lambda s: None, progress=lines.append)
    size = sum(p.stat().st_size for p in data.iterdir())
    mb = f"{size / 1e6:.1f}/{size / 1e6:.1f} MB"
    assert lines[-1] == f"data: data.sources[0]: 3/3 files, {mb}, {size + 3:,} tokens, 0s"  # + 3 eod
    assert lines[0].startswith("data: data.sources[0]: 1/3 files, ")
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=32)
    model = build_model(resolve_model_args(cfg.model, 257, 32), seed=0, device="cpu")
    capsys.readouterr()
    mean_loss(model, TokenShards(prepared), seq_len=32, batch=512, max_windows=1200)
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == ["eval: 0/1,200 windows (0 tokens), 0s", "eval: 512/1,200 windows (16,384 tokens), 0s",
                       "eval: 1,024/1,200 windows (32,768 tokens), 0s"]  # fmt: skip


def _run_with_tokenizer(root: Path) -> tuple[Path, Path]:
    """A run directory (as `scaletrain train` leaves it) of a tiny Llama trained with a BPE tokenizer.json, and
    that tokenizer."""
    tok_file = root / "tok.json"
    tok = train_bpe(["def f(x):\n    return x + 1\n" * 20, "hello world " * 10], 300, tok_file)
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    cfg.data.seq_len, cfg.data.tokenizer = 32, str(tok_file)
    run = root / "run"
    run.mkdir()
    (run / "config.toml").write_text(tomli_w.dumps(to_dict(cfg)))
    model = build_model(resolve_model_args(cfg.model, tok.vocab_size, 32), seed=0, device="cpu")
    ckpt = run / "checkpoints" / "step-00000001"
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(ckpt), no_dist=True)
    write_commit(fsspec.filesystem("file"), str(ckpt), {"step": 1})
    return run, tok_file


def test_hf_export_is_readable_by_others_and_autotokenizer_gets_its_special_tokens(tmp_path):
    """model.safetensors was written 0600, and without tokenizer_config.json AutoTokenizer's eos_token was None."""
    transformers = pytest.importorskip("transformers", reason="the export is checked with transformers")
    run, tok_file = _run_with_tokenizer(tmp_path)
    previous = os.umask(0o022)
    try:
        assert "logits match" in to_hf(run, tmp_path / "hf")
        other = tmp_path / "hf027"
        os.umask(0o027)  # the umask, not a fixed mode, decides
        export_hf(build_model(resolve_model_args(Config().model, 257, 32), 0, "cpu"), other, tok_file, 0, "<|endoftext|>")  # fmt: skip
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert modes == dict.fromkeys(names, 0o644)
    assert {p.stat().st_mode & 0o777 for p in other.iterdir()} == {0o640}
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert tok.eos_token_id == transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).eos_token_id
    text = "def f(x):\n    return x + 1\n"  # and encodes as training did: no special token added
    assert tok(text, add_special_tokens=True)["input_ids"] == load_tokenizer(str(tok_file)).encode(text)
