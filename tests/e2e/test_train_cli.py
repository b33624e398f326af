"""The real CLI end to end: a run directory that follows the contract, data-parallel equivalence, bad input."""

import math
import subprocess
import sys

import pytest

from scaletrain.validate import load_config
from tests.helpers import DEBUG, ROOT, events, per_step, read_jsonl, run_cli, train_args, train_cli

# Ten steps, each logged, no evaluation: the runs the data-parallel and torchrun tests compare.
TEN_STEPS = dict(steps=10, metrics__log_interval=1, training__eval_interval=0)
REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "mem_peak_mib", "step_time_s"}


def test_single_process_run_writes_the_run_directory_contract(tmp_path):
    run = tmp_path / "run"
    # metrics.peak_tflops 0 after QUICK's fixed figure: the default, a CPU peak measured (or read from its cache)
    proc = train_cli(run, metrics__tensorboard=True, metrics__peak_tflops=0)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]
    assert all(REQUIRED <= m.keys() for m in metrics)
    assert all(math.isfinite(m["loss"]) and m["tokens_per_s"] > 0 and m["mfu"] > 0 for m in metrics)
    # An MFU is under 100%, or marked: a CPU peak measured while CI's other worker ran can be too low (a CI run
    # saw it), and the run then says so in its records and an event (StepMeter._check_peak), as it promises.
    suspect = [m for m in metrics if m["mfu"] >= 1 or m.get("mfu_peak_suspect")]
    assert all(m.get("mfu_peak_suspect") for m in suspect) and (not suspect or events(run, "mfu_over_peak"))
    assert metrics[-1]["tokens"] == 20 * 8 * 64
    kinds = [e["kind"] for e in read_jsonl(run / "events.jsonl")]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("eval") == 3
    evals = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "eval"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert any((run / "tensorboard").iterdir())
    # The resolved config reloads to the same values.
    again = load_config(str(run / "config.toml"), ["--run.dir", str(tmp_path / "other")])
    assert again.training.steps == 20 and again.data.seq_len == 64
    assert "MFU peak:" in proc.stderr and "precision fp32" in proc.stderr
    assert str(run) in proc.stdout


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    train_cli(run, **TEN_STEPS)
    return per_step(run, "loss"), per_step(run, "grad_norm")


def test_nproc_2_matches_single_process(reference_run, tmp_path):
    """Same global batches, gradients averaged by DDP: fp32 losses equal the single-process run (rtol 1e-5)."""
    run = tmp_path / "dp2"
    train_cli(run, nproc=2, **TEN_STEPS)
    loss, gnorm = per_step(run, "loss"), per_step(run, "grad_norm")
    ref_loss, ref_gnorm = reference_run
    assert len(loss) == 10
    assert loss == pytest.approx(ref_loss, rel=1e-5) and gnorm == pytest.approx(ref_gnorm, rel=1e-5)
    assert [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "start"][0]["world_size"] == 2


def test_torchrun_module_entry_point(reference_run, tmp_path):
    run = tmp_path / "torchrun"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "scaletrain",
        *train_args(run, **TEN_STEPS, training__micro_batch=2),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert per_step(run, "loss") == pytest.approx(reference_run[0], rel=1e-5)


def test_data_smaller_than_one_global_batch(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 400)  # 6 windows of 64 tokens: 1 for validation, 5 < 8 to train
    proc = train_cli(
        tmp_path / "run",
        f"--data.sources=[{{path='{tmp_path}/tiny.txt'}}]",
        data__cache_dir=tmp_path / "c",
        check=False,
    )
    assert proc.returncode == 1
    assert "fewer than one global batch of 8" in proc.stderr and "training.global_batch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_existing_run_directory_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = train_cli(run, check=False)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_prepare_data_trains_a_bpe_tokenizer_then_training_uses_it(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(
            f'{{"body": "document {i}: the quick brown fox jumps over the lazy dog {i % 7}"}}\n'
            for i in range(400)
        )
    )
    tok = tmp_path / "tok.json"
    src = f"--data.sources=[{{path='{corpus}', field='body'}}]"
    cache = ["--data.cache_dir", str(tmp_path / "cache")]
    prepare = ["prepare-data", "--config", DEBUG, src, *cache, "--train-tokenizer", "--vocab-size", "400"]
    proc = run_cli(*prepare, "--tokenizer-out", str(tok))
    assert tok.exists() and "--data.tokenizer" in proc.stdout
    again = run_cli(*prepare, "--tokenizer-out", str(tok), check=False)
    assert again.returncode != 0 and "exists" in again.stderr  # never overwrites the tokenizer it made
    run = tmp_path / "run"
    train_cli(run, src, *cache, steps=4, data__tokenizer=tok, data__seq_len=16, training__eval_interval=0)
    # 400 tokens pad to 448 embedding rows: the model was sized by the trained tokenizer, not the byte one.
    start = read_jsonl(run / "events.jsonl")[0]
    assert start["parameters"] == 820352 + 2 * (448 - 320) * 128


def test_deterministic_runs_are_bit_identical(tmp_path):
    for name in ("a", "b"):
        train_cli(
            tmp_path / name,
            steps=5,
            metrics__log_interval=1,
            training__deterministic=True,
            training__eval_interval=0,
        )
    a, b = (read_jsonl(tmp_path / n / "metrics.jsonl") for n in ("a", "b"))
    assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b]


def test_launcher_refuses_a_bad_layout_before_starting_workers(tmp_path):
    proc = train_cli(tmp_path / "run", nproc=3, check=False)
    assert proc.returncode == 2 and "x 3 data-parallel ranks" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_flag_of_another_command_is_refused_with_the_config_key_meant(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(run, "--steps", "5", check=False)
    assert proc.returncode == 2 and "--training.steps 5" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()


def test_a_model_shape_attention_cannot_run_is_refused_before_launch(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(run, nproc=2, model__preset="125M", model__n_heads=8, check=False)
    assert proc.returncode == 2 and "model.n_kv_heads" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not run.exists()  # no worker started
