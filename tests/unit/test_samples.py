"""The samples `scaletrain train` ends with (metrics.sample_prompt; issue 39): seeded so that they repeat, greedy at
temperature 0, with `scaletrain generate`'s defaults, and shown on the report page."""

import html

import pytest
import torch

from scaletrain.cli import build_parser
from scaletrain.config import MetricsConfig
from scaletrain.data import ByteTokenizer
from scaletrain.errors import ConfigError
from scaletrain.inference.generate import SAMPLE_TOKENS, Sample, generate_text, take_samples, write_samples
from scaletrain.inference.loader import LoadedModel
from scaletrain.report import write_report
from scaletrain.run.directory import RunDir
from scaletrain.validate import load_config
from tests import fixtures

PROMPT = "def "


def loaded() -> LoadedModel:
    """The tiny random model with the byte tokenizer's ids and room for the prompt and a whole sample."""
    model = fixtures.tiny(vocab_size=320, max_seq_len=80).eval()
    return LoadedModel(model, ByteTokenizer(), model.args, "/runs/a/checkpoints/step-00000005")


def metrics(**kw) -> MetricsConfig:
    return MetricsConfig(sample_prompt=PROMPT, **kw)


def test_seeded_samples_repeat_and_each_seed_gives_its_own():
    model = loaded()
    first, again = take_samples(model, metrics()), take_samples(model, metrics())
    assert [s.seed for s in first] == [0, 1, 2]
    assert [s.text for s in first] == [s.text for s in again]
    # A random model's distribution is nearly flat: 64 tokens drawn twice alike would be a broken seed.
    assert len({s.text for s in first}) == 3
    assert all(s.checkpoint == "step-00000005" and s.prompt == PROMPT for s in first)


@torch.no_grad()
def test_temperature_zero_is_one_greedy_sample_equal_to_the_argmax():
    model = loaded()
    samples = take_samples(model, metrics(sample_temperature=0.0, sample_count=3))
    assert len(samples) == 1  # every seed would give the same text
    seq = ByteTokenizer().encode(PROMPT)
    for _ in range(SAMPLE_TOKENS):  # the whole sequence through the model each step, no cache
        seq.append(int(model.model(torch.tensor([seq]))[0, -1, :257].argmax()))
    assert samples[0].text == ByteTokenizer().decode(seq[len(PROMPT) :])
    assert samples[0].line() == f"sample (greedy): {PROMPT!r} → {samples[0].text!r}"


def test_a_sample_line_names_the_seed_and_settings_that_repeat_it():
    sample = Sample(
        "step-00000300", PROMPT, "x = 1", seed=2, temperature=0.8, top_k=40, stop="max_new_tokens"
    )
    assert sample.line() == "sample (seed 2, temperature 0.8, top-k 40): 'def ' → 'x = 1'"


def test_generate_samples_by_default_as_the_train_samples_do():
    args = build_parser().parse_args(["generate", "runs/a", "--prompt", PROMPT])
    default = MetricsConfig()
    assert default.sample_temperature > 0 and default.sample_top_k > 0  # greedy repeats one token (issue 39)
    assert (args.temperature, args.top_k, args.seed) == (default.sample_temperature, default.sample_top_k, 0)
    assert args.max_new_tokens == SAMPLE_TOKENS
    # From Python too: generate_text's defaults give the train samples' text, seed by seed.
    model = loaded()
    for sample in take_samples(model, metrics()):
        assert generate_text(model, PROMPT, seed=sample.seed)[2] == sample.text


def test_bad_sampling_settings_are_refused_each_with_its_fix():
    overrides = [
        "--metrics.sample_temperature",
        "-1",
        "--metrics.sample_top_k",
        "-2",
        "--metrics.sample_count",
        "0",
    ]
    with pytest.raises(ConfigError) as e:
        load_config("configs/debug.toml", overrides, check_run_dir=False)
    assert "metrics.sample_temperature -1.0 must be >= 0 (0: greedy)" in e.value.problems
    assert "metrics.sample_top_k -2 must be >= 0 (0: the whole vocabulary)" in e.value.problems
    assert 'metrics.sample_count 0 must be >= 1 (no samples: metrics.sample_prompt "")' in e.value.problems


def test_the_report_page_shows_the_samples(tmp_path):
    run = RunDir(tmp_path)
    samples = take_samples(loaded(), metrics())
    write_samples(run, samples)
    (tmp_path / "config.toml").write_text('[metrics]\nsample_prompt = "def "\n')
    page = write_report([tmp_path]).read_bytes().decode()  # not read_text: it would turn a sampled \r into \n
    samples_part = page[page.index("<h2>Samples</h2>") : page.index("<h2>Events</h2>")]
    for s in samples:
        assert f"<b>{html.escape(PROMPT)}</b>{html.escape(s.text)}</td>" in samples_part
    assert samples_part.count("step-00000005") == 3
