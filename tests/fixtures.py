"""Objects more than one test module builds: a tiny model, a checkpoint's state and manager, a stand-in MoE model with
load buffers to fill, a bit flipper, a guard for process-wide settings, and a counter of the bytes alive at once.
Test modules import these from here, never from each other (tests/helpers.py holds the subprocess side: the CLI and
what a run wrote)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.checkpoint import CheckpointManager, LoaderState, ModelState, TrainState
from scaletrain.config import CheckpointConfig, OptimizerConfig
from scaletrain.models import ModelArgs, Transformer, build_meta_model
from scaletrain.models.moe import MoE
from scaletrain.optim.optimizers import Optimizers, build_optimizer
from scaletrain.resilience.faults import FaultInjector

# ------------------------------------------------------------------------------------------------ dense model


def tiny(**kw) -> Transformer:
    """A 2-layer, 32-wide Transformer (vocab 64, 16 positions unless `kw` says otherwise) on the CPU, initialised
    with seed 0; `kw` are ModelArgs fields."""
    shape = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=16)
    model = build_meta_model(ModelArgs(**{**shape, **kw}))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


# DeepSeek-V3's features at test size, one definition for its unit and distributed tests: MLA with a query latent
# (the rotary part narrower than the rest), 8 routed experts in 4 groups under sigmoid routing (top 2 from the best 2
# groups) with the routed scale, one shared expert, block 0 dense. Each test adds its sizes.
TINY_DEEPSEEK_V3 = dict(
    family="deepseek_v3",
    n_heads=4,
    n_kv_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    n_experts=8,
    top_k=2,
    shared_experts=1,
    first_dense=1,
    router="sigmoid",
    n_group=4,
    topk_group=2,
    route_scale=2.5,
)


# ------------------------------------------------------------------------------------------------ checkpoints


class FakeLoader:
    """A data loader's resumable state and nothing else: the next sample and the global batch."""

    def __init__(self):
        self.next_sample = 0

    def state_dict(self):
        return {"next_sample": self.next_sample, "global_batch": 8}

    def load_state_dict(self, sd):
        self.next_sample = sd["next_sample"]


def make_state(seed=0, total_steps=100):
    """A tiny model (weights drawn with `seed`) after one AdamW step, in the dict of Statefuls the trainer hands
    the checkpoint manager; returns (state, model, optimizer, scheduler, loader, train state)."""
    model = tiny()
    torch.manual_seed(seed)
    for p in model.parameters():
        p.data.normal_()
    optimizers = Optimizers(
        [model],
        lambda m: build_optimizer(m, OptimizerConfig()),
        OptimizerConfig(warmup_steps=5),
        total_steps,
    )
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizers.step()
    opt, sched = optimizers.optimizers[0], optimizers.schedulers[0]
    train = TrainState()
    loader = FakeLoader()
    state = {
        "model": ModelState([model]),
        "optimizer": optimizers,
        "data": LoaderState(loader),
        "train": train,
    }
    return state, model, opt, sched, loader, train


def checkpoint_manager(tmp_path, state, events, *faults, **cfg):
    """A one-process CheckpointManager saving `state` under tmp_path/ck, its events appended to `events` as
    (kind, fields), with `faults` (FaultConfig) attached as the trainer attaches them."""
    mgr = CheckpointManager(
        CheckpointConfig(**cfg),
        str(tmp_path / "ck"),
        state,
        rank=0,
        world_size=1,
        event=lambda kind, **kw: events.append((kind, kw)),
    )
    if faults:
        FaultInjector(list(faults), 0, tmp_path, event=lambda *a, **k: None).attach(None, [], mgr)
    return mgr


def flip_bit(path: Path, at: float = 0.5) -> int:
    """Flip one bit of a file in place, behind the tier's back (a stray write, a bit flipped in memory)."""
    pos = int(path.stat().st_size * at)
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))
    return pos


# ------------------------------------------------------------------------------------------------ MoE stand-in

MOE_EXPERTS = 4


class _Block(nn.Module):
    def __init__(self, ff: nn.Module):
        super().__init__()
        self.feed_forward = ff


def moe_model(
    moe_ids: tuple[int, ...] = (1, 3), n_layers: int = 4, n_experts: int = MOE_EXPERTS
) -> nn.Module:
    """A stand-in model: `layers.N.feed_forward` is an MoE on `moe_ids`, a Linear elsewhere (as llama.py names it)."""
    args = ModelArgs(dim=8, n_experts=n_experts, top_k=2, moe_hidden=8)
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleDict(
        {str(i): _Block(MoE(args) if i in moe_ids else nn.Linear(8, 8)) for i in range(n_layers)}
    )
    for i in moe_ids:
        model.layers[str(i)].feed_forward.init_weights(0.02, 0.02)
    return model


def moe_layer(model: nn.Module, i: int) -> MoE:
    """Layer `i`'s MoE of a `moe_model`."""
    return model.layers[str(i)].feed_forward


def fill_load(m: MoE, counts, dropped=0.0, aux=0.0, z=0.0, forwards=1.0) -> None:
    """Set an MoE's load buffers as if its forwards had routed `counts` tokens to each expert."""
    m.tokens_per_expert.copy_(torch.tensor(counts, dtype=torch.float32))
    m.routed_tokens.fill_(float(sum(counts)))
    m.dropped_tokens.fill_(dropped)
    m.aux_loss_sum.fill_(aux)
    m.z_loss_sum.fill_(z)
    m.forwards.fill_(forwards)


# ------------------------------------------------------------------------------------------------ process settings


@contextlib.contextmanager
def kept_process_settings() -> Iterator[None]:
    """setup_process changes process-wide settings (root logging, threads, TF32, deterministic kernels): restore
    them afterwards (tests/unit/test_device_branches.py and tests/gpu/test_cuda.py use it)."""
    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.use_deterministic_algorithms(deterministic)


# ------------------------------------------------------------------------------------------------ live memory


class LiveBytes(TorchDispatchMode):
    """The most bytes alive at once among the tensors the ops under it create (new storages, not views of their
    inputs), each counted until its storage is freed: what a computation holds at its peak, not its largest single
    allocation (issue 35: QK-clip's max_logits held 4,663 live bytes against the 2,048 of one chunk, the previous
    chunk still held)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int]] = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()] if torch.is_tensor(a)
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:  # new memory, not a view
                self.made.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        self.peak = max(self.peak, sum(n for ref, n in self.made if not ref.expired()))
        return out
