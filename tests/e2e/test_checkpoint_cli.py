"""Checkpoints end to end: kill -9 and resume bit for bit, SIGTERM saves and exits, Hugging Face round trip."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from scaletrain.checkpoint.hf.files import INDEX_FILE, hf_tensor_files
from scaletrain.checkpoint.run_model import load_run_model
from scaletrain.errors import ConfigError
from scaletrain.validate import load_config
from tests.helpers import ROOT, per_step, read_jsonl, run_cli, train_args, train_cli

DET = dict(
    training__deterministic=True, training__eval_interval=0, metrics__log_interval=1, checkpoint__interval=3
)


def _start(run, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *train_args(run, **{**DET, **kw})],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def _wait_for(predicate, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def _steps(run):
    return len(read_jsonl(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0


def test_sigkill_at_a_random_step_then_resume_is_bitwise_identical(tmp_path):
    ref = tmp_path / "ref"
    train_cli(ref, steps=12, **DET)
    killed = tmp_path / "killed"
    k = random.Random().randint(4, 10)
    proc = _start(killed, steps=12)
    _wait_for(lambda: _steps(killed) >= k and any((killed / "checkpoints").glob("step-*/commit.json")))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    resumed = train_cli(killed, steps=12, **DET)
    assert "resumed from" in resumed.stderr, f"killed at step {k}"
    got, want = (per_step(r, ("loss", "grad_norm")) for r in (killed, ref))
    assert got == want, f"killed at step {k}"
    a, b = load_run_model(ref)[0].state_dict(), load_run_model(killed)[0].state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a), f"killed at step {k}"
    loaded = [e for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0]["step"] % 3 == 0


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, steps=100000, checkpoint__interval=0)
    _wait_for(lambda: _steps(run) >= 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    events = read_jsonl(run / "events.jsonl")
    pre = [e for e in events if e["kind"] == "preempted"]
    assert len(pre) == 1
    commits = sorted((run / "checkpoints").glob("step-*/commit.json"))
    assert json.loads(commits[-1].read_text())["step"] == pre[0]["step"]
    # The next start resumes from it.
    train_cli(run, steps=pre[0]["step"] + 2, **DET, run__accept_changes="training.steps")
    start = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "start"][-1]
    assert start["resumed"] and start["step"] == pre[0]["step"]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A 3-step run that each export below reads (and none writes to): trained once for the file."""
    run = tmp_path_factory.mktemp("three_steps") / "run"
    train_cli(run, steps=3, training__eval_interval=0)
    return run


@pytest.mark.parametrize(
    ("dtype", "max_shard_size"),
    [("fp32", None), ("bf16", "100KB")],
    ids=["fp32-one-file", "bf16-sharded"],
)
def test_hugging_face_export_and_import_give_the_same_logits(tmp_path, three_steps, dtype, max_shard_size):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    run = three_steps
    out = tmp_path / "hf"
    flags = ["--dtype", dtype] + (["--max-shard-size", max_shard_size] if max_shard_size else [])
    proc = run_cli("convert", "--to", "hf", str(run), str(out), *flags)
    assert "logits match" in proc.stdout
    files = sorted(out.glob("*.safetensors"))
    if (
        max_shard_size is None
    ):  # the default 5 GB: one file, no index, as save_pretrained writes a small model
        assert [f.name for f in files] == ["model.safetensors"] and not (out / INDEX_FILE).exists()
    else:
        # Files of at most 100 KB (a tensor larger than the cap would have one of its own; none is here) and the
        # index naming, for every tensor, the file that holds it.
        assert len(files) > 5 and all(f.stat().st_size <= 100_000 + 4096 for f in files)
        assert {n: f.name for n, f in hf_tensor_files(out).items()} == json.loads(
            (out / INDEX_FILE).read_text()
        )["weight_map"]
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            assert {st.get_slice(n).get_dtype() for n in st.keys()} == {"F32" if dtype == "fp32" else "BF16"}  # noqa: SIM118
    model = load_run_model(run)[0].eval()
    if dtype == "bf16":  # what the export holds: our weights rounded to bf16
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    x = torch.randint(0, model.args.vocab_size, (2, 32))
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() <= 1e-5
    # Import: a config that starts training from those weights (read through the index); step-0 weights equal
    # the export.
    cfg = tmp_path / "from_hf.toml"
    run_cli("convert", "--from", "hf", str(out), "--out", str(cfg))
    run2 = tmp_path / "run2"
    train_cli(
        run2,
        config=str(cfg),
        steps=1,
        optimizer__lr="1e-12",
        training__eval_interval=0,
        data__seq_len=64,
        training__global_batch=8,
        training__micro_batch=4,
    )
    imported = load_run_model(run2)[0].eval()
    with torch.no_grad():
        assert (hf(x).logits - imported(x)).abs().max() <= 1e-5


def test_hf_import_refuses_pickle_weights(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    torch.save({"x": torch.zeros(1)}, hf / "pytorch_model.bin")
    proc = run_cli("convert", "--from", "hf", str(hf), "--out", str(tmp_path / "c.toml"), check=False)
    assert proc.returncode == 1 and "pickle files, which are never loaded" in proc.stderr


def test_last_save_in_hf_writes_the_final_weights_from_the_sharded_job_as_convert_does(tmp_path):
    """checkpoint.last_save_in_hf on 2 fsdp ranks: every tensor is gathered from its shards and written by the job
    itself, bit for bit what `convert --to hf` makes from the final checkpoint afterwards (which checks the logits
    against transformers); pp is refused with the way to export instead."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    fsdp = ["--parallel.data_parallel", "fsdp"]
    train_cli(run, *fsdp, nproc=2, steps=3, training__eval_interval=0, checkpoint__last_save_in_hf="true")
    (saved,) = [e for e in read_jsonl(run / "events.jsonl") if e["kind"].startswith("hf_")]
    assert (saved["kind"], saved["step"], saved["reason"]) == ("hf_saved", 3, None)
    out, converted = run / "hf-step-00000003", tmp_path / "converted"
    assert "logits match" in run_cli("convert", "--to", "hf", str(run), str(converted)).stdout
    got, want = load_file(out / "model.safetensors"), load_file(converted / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (converted / "config.json").read_text()
    )
    with pytest.raises(ConfigError, match="scaletrain convert --to hf"):
        load_config(None, ["--parallel.pp", "2", "--checkpoint.last_save_in_hf", "true"], world_size=2)
