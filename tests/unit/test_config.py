from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.config import Config
from scaletrain.config.io import field_docs, help_text, to_dict, write_toml
from scaletrain.errors import ConfigError
from scaletrain.validate import load_config

ROOT = Path(__file__).resolve().parents[2]


def problems(*overrides: str, path: str | None = None, world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides), world_size=world_size)
    return e.value.problems


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(str(path), [])
    assert isinstance(cfg, Config) and cfg.run.name == path.stem


def test_both_override_spellings_and_types():
    cfg = load_config(
        None,
        [
            "--training.steps",
            "7",
            "--optimizer.lr=1e-4",
            "--training.deterministic",
            "true",
            "--optimizer.betas",
            "[0.8, 0.9]",
            "--model.n_layers",
            "2",
            "--run.name",
            "123",
        ],
    )
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 1e-4 and cfg.training.deterministic is True
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.model.n_layers == 2 and cfg.run.name == "123"


def test_toml_sections_and_data_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    toml = tmp_path / "c.toml"
    toml.write_text(f'[training]\nsteps = 3\n[[data.sources]]\npath = "{tmp_path}/*.txt"\nweight = 2\n')
    cfg = load_config(str(toml), ["--training.steps", "4"])
    assert (
        cfg.training.steps == 4 and cfg.data.sources[0].weight == 2.0 and cfg.data.sources[0].format == "auto"
    )


def test_unknown_keys_name_the_nearest_valid_key():
    got = problems("--training.step", "3", "--training.lr", "1e-3", "--modle.dim", "4")
    assert any("'training.step'" in p and "'training.steps'" in p for p in got)
    assert any("'training.lr'" in p and "'optimizer.lr'" in p for p in got)
    assert any("'modle'" in p or "'modle.dim'" in p for p in got)


def test_a_renamed_key_names_its_new_place(tmp_path):
    got = problems("--training.precision", "bf16", "--resilience.memory_interval", "2")
    assert got == [
        "unknown key 'training.precision': it was renamed 'precision.compute' (--precision.compute VALUE, or "
        "compute = ... under [precision])",
        "unknown key 'resilience.memory_interval': it was renamed 'checkpoint.snapshot_interval' "
        "(--checkpoint.snapshot_interval VALUE, or snapshot_interval = ... under [checkpoint])",
    ]
    old = tmp_path / "old.toml"
    old.write_text('[training]\nreduce_dtype = "bf16"\n')
    (msg,) = problems(path=str(old))
    assert "it was renamed 'precision.reduce_dtype'" in msg


def test_an_unknown_key_hides_no_other_problem():
    got = problems("--training.foo", "1", "--training.steps", "-3")
    assert any("'training.foo'" in p for p in got) and any("training.steps" in p for p in got), got


def test_every_problem_is_reported_at_once():
    got = problems(
        "--training.steps",
        "abc",
        "--precision.compute",
        "fp4",
        "--optimizer.lr",
        "-1",
        "--training.global_batch",
        "10",
        "--training.micro_batch",
        "4",
    )
    joined = "\n".join(got)
    assert "'training.steps' must be an integer" in joined
    assert "'precision.compute'" in joined and "fp32, bf16" in joined
    # Type errors stop before value checks: fix the types, then the values are checked together.
    got = problems(
        "--optimizer.lr",
        "-1",
        "--training.global_batch",
        "10",
        "--training.micro_batch",
        "4",
        "--model.n_kv_heads",
        "3",
    )
    joined = "\n".join(got)
    assert "optimizer.lr must be > 0" in joined
    assert "not divisible by training.micro_batch 4" in joined and "use training.global_batch 8" in joined
    assert "n_kv_heads 3" in joined
    assert len(got) == 3


def test_global_batch_must_divide_by_micro_batch_times_dp():
    load_config(None, ["--training.global_batch", "8", "--training.micro_batch", "4"], world_size=2)
    got = problems("--training.global_batch", "8", "--training.micro_batch", "4", world_size=4)
    assert "x 4 data-parallel ranks" in got[0]


def test_global_batch_in_tokens():
    cfg = load_config(
        None,
        ["--training.global_batch_tokens", "2048", "--data.seq_len", "256", "--training.micro_batch", "8"],
    )
    assert cfg.training.global_batch_tokens == 2048
    assert "multiple of data.seq_len" in problems("--training.global_batch_tokens", "1000")[0]


def test_missing_and_empty_data_paths(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    got = problems(f"--data.sources=[{{path='{tmp_path}/nothing*.txt'}}, {{path='{tmp_path}/empty.txt'}}]")
    assert len(got) == 2
    assert "matches no files" in got[0] and "data.sources[0]" in got[0]
    assert "empty" in got[1] and "data.sources[1]" in got[1]


def test_tokenizer_file_that_does_not_load(tmp_path):
    bad = tmp_path / "tok.json"
    bad.write_text("{not json")
    assert "tok.json" in problems("--data.tokenizer", str(bad))[0]
    assert "does not exist" in problems("--data.tokenizer", str(tmp_path / "missing.json"))[0]


def test_unwritable_and_existing_run_dirs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "cannot be created" in problems("--run.dir", str(blocker / "run"))[0]
    assert "not writable" in problems("--run.dir", "/proc/scaletrain-run")[0]
    old = tmp_path / "old"
    old.mkdir()
    start = '{"time": 1, "kind": "start", "step": 0}\n'
    (old / "events.jsonl").write_text(start)
    msg = problems("--run.dir", str(old))[0]
    assert "has no committed checkpoint" in msg and "never overwritten" in msg and "--run.start_over" in msg
    assert (old / "events.jsonl").read_text() == start


def test_unknown_preset_and_models_too_big_for_the_machine():
    assert "did you mean '8B'" in problems("--model.preset", "8b")[0]
    assert "GiB per process" in problems("--model.preset", "405B")[0]


def test_bad_toml_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[training\nsteps = 3")
    assert "not valid TOML" in problems(path=str(p))[0]
    assert "does not exist" in problems(path=str(tmp_path / "none.toml"))[0]


def test_help_text_comes_from_field_docstrings(capsys):
    assert field_docs(Config.__dataclass_fields__["training"].default_factory().__class__)["steps"]
    text = help_text(Config)
    assert "--training.steps INT (default: 200)" in text and "Optimizer steps to run." in text
    assert main(["train", "--help"]) == 0
    assert "--optimizer.schedule {cosine,linear,wsd,constant}" in capsys.readouterr().out


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["train", "--training.stepz", "3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'training.steps'" in err and "Traceback" not in err


def test_the_model_is_checked_as_resolved_from_its_preset():
    # 125M has 12 key/value heads; 8 query heads cannot share them, which the attention would only find out at its
    # first call. The message names the field to change and where the other value came from.
    (msg,) = problems("--model.preset", "125M", "--model.n_heads", "8")
    assert "model.n_heads 8 is not divisible by model.n_kv_heads 12 (from model.preset '125M')" in msg
    assert "set model.n_kv_heads to one of 2, 4, 8" in msg
    (msg,) = problems("--model.n_heads", "6")
    assert "model.dim 128 (from model.preset 'debug') is not divisible by model.n_heads 6" in msg
    assert "set model.n_heads to one of" in msg
    (msg,) = problems("--model.n_heads", "128", "--model.n_kv_heads", "128")  # head size 1
    assert "head size" in msg and "is odd" in msg and "model.n_heads" in msg
    (msg,) = problems("--model.vocab_size", "200")  # the byte tokenizer has 257 tokens
    assert "model.vocab_size 200 is smaller than the tokenizer's 257 tokens" in msg
    assert "model.n_heads must be >= 1, got 0" in problems("--model.n_heads", "0")[0]
    # What the preset leaves consistent stays accepted.
    cfg = load_config(None, ["--model.preset", "125M", "--model.n_heads", "8", "--model.n_kv_heads", "4"])
    assert (cfg.model.n_heads, cfg.model.n_kv_heads) == (8, 4)


def test_the_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--training.steps", "7", "--run.name", "exp"])
    toml = tmp_path / "config.toml"
    write_toml(to_dict(cfg), toml)
    assert load_config(str(toml), []) == cfg


def test_cli_refuses_a_flag_that_is_not_its_command_s(capsys):
    # --steps is parity's flag: train refuses it and names the config key it probably meant.
    assert main(["train", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "'scaletrain train' has no option --steps; did you mean --training.steps 5?" in err
    assert "--config, --dry-run, --max-restarts, --nproc" in err and "Traceback" not in err
    # No prefix matching: --conf is not --config.
    assert main(["train", "--conf", "x.toml"]) == 2
    assert "did you mean --config?" in capsys.readouterr().err
    assert main(["parity", "--nproc", "2", "--layouts", "tp=2"]) == 2
    assert "'scaletrain parity' has no option --nproc" in capsys.readouterr().err
    assert main(["convert", "--to", "hf", "a", "b", "--model.dim", "4"]) == 2
    assert "takes no argument '--model.dim'" in capsys.readouterr().err
    assert main(["trian"]) == 2  # argparse's own refusal: exit 2, its message
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_help_of_every_command(capsys):
    assert main([]) == 0 and main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "scaletrain prepare-data --config FILE" in out and "--training.steps INT" in out
    for command in ("prepare-data", "parity"):
        assert main([command, "--help"]) == 0
        assert f"usage: scaletrain {command}" in (out := capsys.readouterr().out) and "--data.seq_len" in out
    assert main(["convert", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--from {hf}" in out and "--data.seq_len" not in out  # convert takes no overrides
