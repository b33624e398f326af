"""`scaletrain generate` and `scaletrain eval` on a run saved under fsdp x tp and on its Hugging Face export: the same
tokens from both, a loss equal to transformers' own, the sample `train` ends with, and bad input refused in one line.

One run (4 processes) is trained for the module; the commands run in-process through `scaletrain.cli.main`."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import MetricsConfig
from scaletrain.data import ByteTokenizer
from scaletrain.run.directory import RunDir
from tests.helpers import train_cli

PROMPT = "def "
SEQ = 32  # eval windows; the run's context (data.seq_len of the debug config) is 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, HF export, `train`'s stdout, eval text files)."""
    root = tmp_path_factory.mktemp("gen")
    run = root / "run"
    proc = train_cli(
        run, nproc=4, steps=3, parallel__data_parallel="fsdp", parallel__tp=2, parallel__dp_shard=2,
        training__eval_interval=0, metrics__sample_prompt=PROMPT,
    )  # fmt: skip
    hf = root / "hf"
    assert main(["convert", "--to", "hf", str(run), str(hf)]) == 0
    texts = root / "texts"
    texts.mkdir()
    # Two documents from real Python source: packing joins them with the end-of-document token.
    source = Path(shutil.__file__).read_text()
    (texts / "a.txt").write_text(source[:2500])
    (texts / "b.txt").write_text(source[2500:4000])
    return run, hf, proc.stdout, texts


def _json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "sampling", [["--temperature", "0"], ["--temperature", "0.9", "--top-k", "40", "--seed", "3"]]
)
def test_run_and_its_hf_export_generate_the_same_tokens(run, capsys, sampling):
    run_dir, hf, _, _ = run
    args = ["--prompt", PROMPT, "--max-new-tokens", "40", "--json", *sampling]
    from_run = _json(capsys, ["generate", str(run_dir), *args])
    from_hf = _json(capsys, ["generate", str(hf), "--tokenizer", "byte", *args])
    assert from_run["prompt_tokens"] == list(PROMPT.encode())
    assert len(from_run["tokens"]) == 40 or from_run["stop"] == "eod"
    assert from_run["tokens"] == from_hf["tokens"] and from_run["text"] == from_hf["text"]
    if "--seed" in sampling:  # the same seed again gives the same tokens; another seed others
        assert _json(capsys, ["generate", str(run_dir), *args])["tokens"] == from_run["tokens"]
        other = _json(capsys, ["generate", str(run_dir), *args[:-1], "4"])
        assert other["tokens"] != from_run["tokens"]


def test_train_ends_with_samples_that_generate_repeats_by_default(run, capsys):
    """Issue 39: sampled (greedy decoding repeats one token), seeds 0, 1, 2, each repeated by `generate --seed`."""
    run_dir, _, stdout, _ = run
    m = MetricsConfig()
    settings = f"temperature {m.sample_temperature:g}, top-k {m.sample_top_k}"
    for seed in range(3):
        out = _json(capsys, ["generate", str(run_dir), "--prompt", PROMPT, "--seed", str(seed), "--json"])
        text = out["text"]
        assert f"sample (seed {seed}, {settings}): {PROMPT!r} → {text!r}" in stdout.splitlines()
    kept = RunDir(run_dir).read_samples()
    assert [(s["seed"], s["prompt"]) for s in kept] == [(0, PROMPT), (1, PROMPT), (2, PROMPT)]


def test_eval_of_the_hf_export_equals_transformers_loss_and_the_run_eval(run, capsys):
    transformers = pytest.importorskip("transformers")
    run_dir, hf, _, texts = run
    args = ["--data", str(texts / "*.txt"), "--seq-len", str(SEQ), "--json"]
    ours = _json(capsys, ["eval", str(hf), "--tokenizer", "byte", *args])
    # Packed here by hand as training packs: the documents in file order, each followed by eod, cut into
    # windows of SEQ + 1 tokens that overlap by one (inputs, then targets shifted by one).
    tok = ByteTokenizer()
    stream = [t for f in sorted(texts.glob("*.txt")) for t in [*tok.encode(f.read_text()), tok.eod_id]]
    n = (len(stream) - 1) // SEQ
    windows = torch.tensor([stream[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        # HF shifts the labels itself: the logits of positions 0..SEQ-1 against tokens 1..SEQ, the mean over them.
        losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(16)]
    sizes = [len(w) for w in windows.split(16)]
    theirs = sum(loss * k for loss, k in zip(losses, sizes)) / n
    assert ours["windows"] == n and ours["tokens"] == n * SEQ
    assert abs(ours["loss"] - theirs) <= 1e-4
    from_run = _json(capsys, ["eval", str(run_dir), *args])
    assert abs(from_run["loss"] - ours["loss"]) <= 1e-6


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "{tmp}", "--prompt", "x"], "neither a run directory"),
        (["generate", "{tmp}/nowhere", "--prompt", "x"], "does not exist"),
        (["generate", "{bare_run}", "--prompt", "x"], "no committed, intact checkpoint"),
        (["generate", "{hf}", "--prompt", "x"], "has no tokenizer.json; pass --tokenizer"),
        (["generate", "{run}", "--prompt", "x" * 64], "the model's context is 64"),
        (["generate", "{run}", "--prompt", "x", "--temperature", "-1"], "--temperature -1.0 must be >= 0"),
        (["eval", "{run}", "--data", "{tmp}/empty.txt"], "all empty"),
        (["eval", "{run}", "--data", "{tmp}/*.jsonl"], "matches no files"),
        (["eval", "{run}", "--data", "{tmp}/short.txt"], "too few for one window"),
        (["eval", "{run}", "--data", "{tmp}/short.txt", "--seq-len", "65"], "--seq-len 65 must be in 1..64"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(run, tmp_path, capsys, argv, message):
    run_dir, hf, _, _ = run
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("hi")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "config.toml", bare / "config.toml")  # a run that saved no checkpoint
    paths = {"tmp": tmp_path, "run": run_dir, "hf": hf, "bare_run": bare}
    capsys.readouterr()
    assert main([a.format(**paths) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
