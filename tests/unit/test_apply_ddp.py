"""apply_ddp takes the rank's device from its caller (resolved once), not from a model attribute: DDP's device_ids
name that device on CUDA and nothing on CPU, for any module (one without a RoPE table too)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaletrain.parallel.data_parallel as data_parallel


class _Mesh:
    def get_group(self) -> str:
        return "group"

    def size(self) -> int:
        return 2


@pytest.mark.parametrize(
    "device, device_ids", [(torch.device("cuda", 3), [3]), (torch.device("cpu"), None)], ids=["cuda", "cpu"]
)
def test_apply_ddp_names_the_device_it_is_given(monkeypatch, device, device_ids):
    seen: dict = {}

    def fake_ddp(module: nn.Module, **kwargs) -> nn.Module:
        seen.update(kwargs, module=module)
        return module

    monkeypatch.setattr(data_parallel, "DDP", fake_ddp)
    model = nn.Linear(2, 2)  # no `rope`: the device is not read from the model
    assert data_parallel.apply_ddp(model, _Mesh(), device=device, bucket_mb=7) is model
    assert seen["device_ids"] == device_ids
    assert (seen["process_group"], seen["bucket_cap_mb"]) == ("group", 7)
