"""The job's Layout: the batch arithmetic and mesh sizes resolved once from (config, world size)."""

from __future__ import annotations

import pytest

from scaletrain.config import Config
from scaletrain.errors import ConfigError
from scaletrain.parallel.layout import Layout


def config(**sections) -> Config:
    cfg = Config()
    for section, fields in sections.items():
        for key, value in fields.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


@pytest.mark.parametrize(
    "world, parallel, training, expect",
    [
        # dp_shard resolved from the world: 8 ranks, tp 2 -> 4 data-parallel ranks of 32 / 4 = 8 sequences.
        (8, {"tp": 2, "data_parallel": "fsdp"}, {"global_batch": 32, "micro_batch": 2},
         {"dp_shard": 4, "dp_size": 4, "local_batch": 8, "microbatches": 4, "fsdp": True}),
        # hsdp: replicate x shard are both data-parallel; pp 2 with 0 micro-batches -> one per micro_batch.
        (8, {"dp_replicate": 2, "pp": 2, "data_parallel": "hsdp"}, {"global_batch": 16, "micro_batch": 1},
         {"dp_shard": 2, "dp_size": 4, "local_batch": 4, "microbatches": 4, "fsdp": True}),
        # ddp on 2 ranks: no FSDP; the batch given in tokens.
        (2, {"data_parallel": "ddp"}, {"global_batch_tokens": 8 * 64, "micro_batch": 2},
         {"dp_shard": 2, "dp_size": 2, "local_batch": 4, "microbatches": 2, "fsdp": False}),
        # fsdp on one rank shards nothing.
        (1, {"data_parallel": "fsdp"}, {"global_batch": 4, "micro_batch": 4},
         {"dp_shard": 1, "dp_size": 1, "local_batch": 4, "microbatches": 1, "fsdp": False}),
    ],
)  # fmt: skip
def test_the_batch_and_mesh_sizes_of_a_layout(world, parallel, training, expect):
    layout = Layout.of(config(parallel=parallel, training=training, data={"seq_len": 64}), world)
    got = {k: getattr(layout, k) for k in expect}
    assert got == expect and layout.tiles
    assert layout.tokens_per_step == layout.global_batch * 64
    assert layout.dims().world_size == world


def test_sizes_that_do_not_tile_are_reported_not_raised_until_a_mesh_is_asked_for():
    layout = Layout.of(config(parallel={"tp": 3}, training={"global_batch": 8, "micro_batch": 1}), 4)
    assert not layout.tiles and layout.size_problems
    # The batch then splits over the whole world so the other checks still run, and it counts as FSDP (quiet).
    assert layout.dp_size == 4 and layout.local_batch == 2 and layout.fsdp
    with pytest.raises(ConfigError):
        layout.dims()
