"""Expert parallel's single-process pieces: the regrouping of received rows by local expert, and the grouping of
parameters by mesh that the norm and AdamW need (the multi-process equivalence is in
tests/distributed/test_expert_parallel.py)."""

from __future__ import annotations

import torch

from scaletrain.config import OptimizerConfig
from scaletrain.optim.optimizers import build_optimizer
from scaletrain.parallel.expert_parallel import _by_local_expert, group_by_mesh, meshes_mixed
from tests.distributed.reference import full_model, tiny_args


def test_received_rows_are_regrouped_by_local_expert_then_source_rank():
    # 2 sources x 2 local experts: source 0 sends 1 row for expert 0 and 2 for expert 1; source 1 sends 2 and 0.
    received = torch.tensor([[1, 2], [2, 0]])
    # Arrival order: s0e0 | s0e1 s0e1 | s1e0 s1e0 ; wanted: expert 0 (s0, then s1), then expert 1.
    assert _by_local_expert(received).tolist() == [0, 3, 4, 1, 2]
    assert _by_local_expert(torch.zeros(2, 3, dtype=torch.long)).numel() == 0


def test_one_mesh_keeps_the_optimizer_groups_as_they_were():
    model = full_model(tiny_args(n_experts=4, top_k=2, moe_hidden=32))
    params = list(model.parameters())
    assert not meshes_mixed(params) and group_by_mesh(params) == [params]
    opt = build_optimizer(model, OptimizerConfig())
    assert [g["weight_decay"] for g in opt.param_groups] == [OptimizerConfig().weight_decay, 0.0]
