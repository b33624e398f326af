"""Packing, the weighted mixture, resumable loading and data-parallel slicing of global batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.config import DataConfig, SourceConfig
from scaletrain.data.loader import DataLoader, Mixture, TokenShards, build_loader, split_windows
from scaletrain.data.prepare import prepare_data
from scaletrain.data.tokenizer import ByteTokenizer
from scaletrain.errors import UserError


def _shards(tmp_path: Path, name: str, docs: list[str]) -> TokenShards:
    """Prepare a jsonl source of `docs` with the byte tokenizer and open it."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = DataConfig(sources=[SourceConfig(path=str(path))], cache_dir=str(tmp_path / "cache"), workers=1)
    [(d, _)] = prepare_data(cfg, ByteTokenizer(), log=lambda s: None)
    return TokenShards(d)


def _numbered(tmp_path: Path, name: str, n_docs: int) -> TokenShards:
    return _shards(tmp_path, name, [f"{name}{i:04d}" for i in range(n_docs)])


def test_packing_windows_eod_and_shifted_targets(tmp_path: Path):
    shards = _shards(tmp_path, "s", ["abc", "defg"])  # stream: a b c <eod> d e f g <eod>
    eod = 256
    mix = Mixture([(shards, 1.0)], seq_len=3, val_fraction=0.0, seed=0)
    assert mix.num_train_windows == (9 - 1) // 3 == 2 and mix.epoch_len == 2
    windows = sorted(mix.sample(g).tolist() for g in range(2))
    assert windows == sorted([[97, 98, 99, eod], [eod, 100, 101, 102]])
    x, y = DataLoader(mix, global_batch=2, dp_rank=0, dp_size=1).next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 3)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert sorted(torch.cat([x, y[:, -1:]], dim=1).tolist()) == windows


def test_validation_windows_are_the_last_ones(tmp_path: Path):
    shards = _numbered(tmp_path, "s", 20)  # 20 docs of 6 bytes + eod: 140 tokens
    assert split_windows(140, 10, 0.2) == (10, 3)  # 13 windows, round(2.6) = 3 held out
    mix = Mixture([(shards, 1.0)], seq_len=10, val_fraction=0.2, seed=0)
    n_train, n_val = split_windows(shards.num_tokens, 10, 0.2)
    assert (mix.num_train_windows, mix.num_val_windows) == (n_train, n_val)
    for j in range(n_val):
        assert np.array_equal(mix.val_sample(j), shards.window((n_train + j) * 10, 11))
    train = {tuple(mix.sample(g)) for g in range(mix.epoch_len)}
    assert train == {
        tuple(shards.window(w * 10, 11)) for w in range(n_train)
    }  # one epoch = every window once


def test_split_windows_counts():
    assert split_windows(1001, 100, 0.0) == (10, 0)
    assert split_windows(1001, 100, 0.01) == (9, 1)  # at least one validation window
    assert split_windows(1001, 100, 0.3) == (7, 3)
    assert split_windows(100, 100, 0.5) == (0, 0)


def test_mixture_follows_weights(tmp_path: Path):
    a = _shards(tmp_path, "a", ["a" * 99] * 10)  # 1000 tokens: 99 windows of 10
    b = _shards(tmp_path, "b", ["b" * 19] * 10)  # 200 tokens: 19 windows of 10
    mix = Mixture([(a, 1.0), (b, 3.0)], seq_len=10, val_fraction=0.0, seed=1)
    assert mix.epoch_len == 99 + 19
    from_b = [bool((mix.sample(g) == ord("b")).any()) for g in range(2 * mix.epoch_len)]
    assert abs(np.mean(from_b) - 0.75) < 0.01
    # b is oversampled (repeated), a subsampled: counts per epoch are the rounded shares.
    assert sum(from_b[: mix.epoch_len]) == round(0.75 * 118)


def test_repeated_and_subsampled_sources(tmp_path: Path):
    a = _numbered(tmp_path, "a", 40)  # 240 tokens: 23 windows of 10
    b = _numbered(tmp_path, "b", 10)  # 60 tokens: 5 windows of 10
    mix = Mixture([(a, 1.0), (b, 1.0)], seq_len=10, val_fraction=0.0, seed=3)
    assert mix.n_per_epoch.tolist() == [14, 14]
    epochs = [[tuple(mix.sample(g)) for g in range(e * 28, (e + 1) * 28)] for e in range(2)]
    from_a = [{s for s in ep if ord("a") in s} for ep in epochs]
    from_b = [s for s in epochs[0] if ord("b") in s]
    # b is repeated evenly: each of its 5 windows 2 or 3 times in 14 draws.
    assert len(set(from_b)) == 5 and {from_b.count(w) for w in set(from_b)} <= {2, 3}
    # a is subsampled without repeats, and afresh each epoch.
    assert len(from_a[0]) == len(from_a[1]) == 14 and from_a[0] != from_a[1]


def test_sample_is_a_pure_function_of_seed_and_index(tmp_path: Path):
    a, b = _numbered(tmp_path, "a", 30), _numbered(tmp_path, "b", 12)
    m1 = Mixture([(a, 2.0), (b, 1.0)], seq_len=8, val_fraction=0.1, seed=7)
    m2 = Mixture([(a, 2.0), (b, 1.0)], seq_len=8, val_fraction=0.1, seed=7)
    n = 3 * m1.epoch_len + 5  # crosses epoch boundaries
    sequential = [m1.sample(g) for g in range(n)]
    rng = np.random.default_rng(0)
    for g in rng.permutation(n):  # random access, jumping between epochs
        assert np.array_equal(m2.sample(int(g)), sequential[g])
    e0 = np.stack(sequential[: m1.epoch_len])
    e1 = np.stack(sequential[m1.epoch_len : 2 * m1.epoch_len])
    assert not np.array_equal(e0, e1)  # each epoch has its own order
    m3 = Mixture([(a, 2.0), (b, 1.0)], seq_len=8, val_fraction=0.1, seed=8)
    assert not np.array_equal(np.stack([m3.sample(g) for g in range(m1.epoch_len)]), e0)


def test_loader_resumes_with_exactly_the_next_batch(tmp_path: Path):
    mix = Mixture([(_numbered(tmp_path, "a", 30), 1.0)], seq_len=8, val_fraction=0.0, seed=0)
    first = DataLoader(mix, global_batch=4, dp_rank=0, dp_size=1)
    for _ in range(7):  # past the end of the first epoch (25 windows)
        first.next_batch()
    sd = first.state_dict()
    assert sd == {"next_sample": 28, "global_batch": 4}
    expected = first.next_batch()
    fresh_mix = Mixture([(_numbered(tmp_path, "a", 30), 1.0)], seq_len=8, val_fraction=0.0, seed=0)
    resumed = DataLoader(fresh_mix, global_batch=4, dp_rank=0, dp_size=1)
    resumed.load_state_dict(sd)
    got = resumed.next_batch()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_dp_ranks_concatenate_to_the_single_rank_batch(tmp_path: Path):
    mix = Mixture([(_numbered(tmp_path, "a", 30), 1.0)], seq_len=8, val_fraction=0.1, seed=5)
    single = DataLoader(mix, global_batch=6, dp_rank=0, dp_size=1)
    ranks = [DataLoader(mix, global_batch=6, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(6):
        x, y = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert parts[0][0].shape == (3, 8)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert not torch.equal(parts[0][0], parts[1][0])


def test_val_batches_split_by_rank(tmp_path: Path):
    mix = Mixture([(_numbered(tmp_path, "a", 60), 1.0)], seq_len=8, val_fraction=0.2, seed=0)
    assert mix.num_val_windows == 9  # 360 tokens: 44 windows of 8, round(8.8) held out
    single = list(DataLoader(mix, 4, 0, 1).val_batches(n_sequences=7, micro_batch=3))
    assert [x.shape[0] for x, _ in single] == [3, 3, 1]
    assert torch.equal(
        torch.cat([x for x, _ in single]),
        torch.stack([torch.from_numpy(mix.val_sample(j)[:-1]) for j in range(7)]),
    )
    # Two ranks: 7 rounds down to 6, three per rank, rank 0 first.
    shares = [list(DataLoader(mix, 4, r, 2).val_batches(n_sequences=7, micro_batch=2)) for r in range(2)]
    xs = torch.cat([x for share in shares for x, _ in share])
    assert torch.equal(xs, torch.cat([x for x, _ in single])[:6])
    many = list(DataLoader(mix, 4, 0, 1).val_batches(n_sequences=1000, micro_batch=4))
    assert sum(x.shape[0] for x, _ in many) == 9  # clipped to the validation windows


def test_no_training_windows_is_a_user_error(tmp_path: Path):
    shards = _shards(tmp_path, "s", ["tiny"])  # 5 tokens
    with pytest.raises(UserError) as e:
        Mixture([(shards, 1.0)], seq_len=8, val_fraction=0.0, seed=0)
    assert "5 tokens" in str(e.value) and "data.seq_len=8" in str(e.value)
    shards = _shards(tmp_path, "t", ["x" * 15])  # 16 tokens: one window, which goes to validation
    with pytest.raises(UserError, match="no training sequence"):
        Mixture([(shards, 1.0)], seq_len=8, val_fraction=0.1, seed=0)


def test_source_without_windows_names_the_source(tmp_path: Path):
    big, tiny = _numbered(tmp_path, "a", 30), _shards(tmp_path, "t", ["x"])
    with pytest.raises(UserError, match=r"data.sources\[1\]"):
        Mixture([(big, 1.0), (tiny, 1.0)], 8, 0.0, 0, names=["data.sources[0]", "data.sources[1]"])
    assert Mixture([(big, 1.0), (tiny, 0.0)], 8, 0.0, 0).num_train_windows > 0  # weight 0: not needed


def test_build_loader_too_little_data(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "y" * 30}) + "\n" for _ in range(4)))  # 124 tokens
    cfg = DataConfig(
        sources=[SourceConfig(path=str(path))],
        seq_len=8,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
        workers=1,
    )
    with pytest.raises(UserError) as e:
        build_loader(cfg, ByteTokenizer(), global_batch=32, dp_rank=0, dp_size=1, seed=0, log=lambda s: None)
    msg = str(e.value)
    assert "15 training sequences of 8 tokens" in msg and "training.global_batch" in msg
    loader = build_loader(
        cfg, ByteTokenizer(), global_batch=8, dp_rank=1, dp_size=2, seed=0, log=lambda s: None
    )
    assert loader.next_batch()[0].shape == (4, 8)


def test_global_batch_must_divide_by_dp(tmp_path: Path):
    mix = Mixture([(_numbered(tmp_path, "a", 30), 1.0)], seq_len=8, val_fraction=0.0, seed=0)
    with pytest.raises(UserError, match="multiple of the data-parallel size 4"):
        DataLoader(mix, global_batch=6, dp_rank=0, dp_size=4)


def test_fewer_validation_windows_than_ranks(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "z" * 160}) + "\n")  # 161 tokens: 20 windows of 8, one held out
    cfg = DataConfig(
        sources=[SourceConfig(path=str(path))], seq_len=8, val_fraction=0.01, cache_dir=str(tmp_path)
    )
    with pytest.raises(UserError, match="1 validation sequence.*2 data-parallel ranks"):
        build_loader(cfg, ByteTokenizer(), global_batch=4, dp_rank=0, dp_size=2, seed=0, log=lambda s: None)
    loader = build_loader(
        cfg, ByteTokenizer(), global_batch=4, dp_rank=0, dp_size=1, seed=0, log=lambda s: None
    )
    assert [x.shape for x, _ in loader.val_batches(64, 8)] == [(1, 8)]
    cfg.val_fraction = 0.0
    loader = build_loader(
        cfg, ByteTokenizer(), global_batch=4, dp_rank=0, dp_size=2, seed=0, log=lambda s: None
    )
    with pytest.raises(UserError, match="fewer than the 2 data-parallel ranks"):
        next(loader.val_batches(64, 8))
