"""The resume rules on two resolved configs: refused, accepted with run.accept_changes, or free."""

from scaletrain.config import Config, SourceConfig
from scaletrain.config.io import to_dict, with_defaults
from scaletrain.run.resume import resume_problems


def _changed(**sections) -> dict:
    cfg = Config()
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return to_dict(cfg)


def test_the_same_config_and_a_new_layout_continue():
    saved = to_dict(Config())
    new = _changed(
        parallel={"data_parallel": "fsdp", "tp": 2}, checkpoint={"interval": 5}, training={"threads": 1}
    )
    assert resume_problems(saved, new, []) == []


def test_what_the_checkpoint_cannot_continue_with_is_refused_key_by_key():
    new = _changed(model={"n_layers": 2}, data={"seq_len": 32}, training={"seed": 7})
    problems = resume_problems(to_dict(Config()), new, ["model", "training"])  # accepting cannot help here
    assert [p.split(" was ")[0] for p in problems] == ["data.seq_len", "model.n_layers", "training.seed"]
    assert all("cannot continue" in p and "new --run.dir" in p for p in problems)
    assert "training.seed was 1234 in the saved run, now 7" in problems[2]


def test_a_new_learning_rate_or_length_needs_run_accept_changes():
    new = _changed(optimizer={"lr": 1e-3}, training={"steps": 400})
    problems = resume_problems(to_dict(Config()), new, [])
    assert len(problems) == 2 and all("--run.accept_changes" in p for p in problems)
    assert "--run.accept_changes optimizer.lr" in problems[0]
    assert resume_problems(to_dict(Config()), new, ["optimizer", "training.steps"]) == []


def test_a_run_saved_before_a_field_existed_resumes_with_its_default():
    cfg = Config()
    cfg.data.sources = [SourceConfig(path="a.txt")]
    new = to_dict(cfg)
    saved = to_dict(cfg)
    del saved["precision"], saved["data"]["sources"][0]["dtype"], saved["run"]["time_limit"]
    assert resume_problems(saved, new, [])  # compared raw, the missing keys differ
    assert resume_problems(with_defaults(saved), new, []) == []
    saved["data"]["sources"][0]["path"] = "b.txt"  # a real difference still shows
    assert [p.split(" was ")[0] for p in resume_problems(with_defaults(saved), new, [])] == ["data.sources"]


def test_a_run_saved_with_renamed_keys_resumes_with_them_under_their_new_names():
    new = _changed(precision={"compute": "bf16", "loss_scale_growth_interval": 500})
    old = to_dict(Config())
    old["training"].update(precision="bf16", loss_scale_growth_interval=500)  # before [precision] held them
    del old["precision"]["compute"], old["precision"]["loss_scale_growth_interval"]
    assert resume_problems(old, new, [])  # compared untranslated, both keys differ
    assert resume_problems(with_defaults(old), new, []) == []
    assert (
        resume_problems(to_dict(Config()), new, ["training.precision", "training.loss_scale_growth_interval"])
        == []
    )


def test_a_run_directory_saved_with_old_keys_resumes_as_the_same_run(tmp_path):
    """A run trained, then its config.toml rewritten as a release before the renames wrote it: the same command
    continues it from its checkpoint (the resume check sees the same run), and the run's config is the new form."""
    from scaletrain.config import RENAMED_KEYS
    from scaletrain.config.io import read_toml, write_toml
    from scaletrain.train import train
    from scaletrain.validate import load_config
    from tests.helpers import DEBUG, QUICK, events

    run = tmp_path / "run"
    args = ["--training.steps", "4", "--training.eval_interval", "0", "--precision.loss_scale_growth_interval",
            "500", "--checkpoint.snapshot_ttl_hours", "12", "--run.dir", str(run), *QUICK]  # fmt: skip
    train(load_config(DEBUG, ["--run.stop_at_step", "2", *args]))
    saved = read_toml(str(run / "config.toml"))
    for old, new in RENAMED_KEYS.items():  # every renamed key back under its old name
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        saved.setdefault(old_section, {})[old_key] = saved[new_section].pop(new_key)
    write_toml(saved, run / "config.toml")
    train(load_config(DEBUG, args))  # no resume problem: the same run
    starts = events(run, "start")
    assert [(e["step"], e["resumed"]) for e in starts] == [(0, False), (2, True)]
    assert read_toml(str(run / "config.toml"))["precision"]["loss_scale_growth_interval"] == 500
