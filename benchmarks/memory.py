"""Model-state memory per rank of DDP, ZeRO-1, ZeRO-2 and FSDP at N = 1, 2, 4 processes, beside the ZeRO formulas.

Rajbhandari et al. 2020 (ZeRO), for fp32 AdamW and Ψ parameters: params 4Ψ bytes, grads 4Ψ, Adam m and v 8Ψ.
    ddp    16Ψ               everything replicated
    zero1  8Ψ + 8Ψ/N         optimizer state sharded
    zero2  4Ψ + 12Ψ/N        + gradients sharded (parameters whole while computing)
    fsdp   16Ψ/N             + parameters sharded (ZeRO-3; the one unit gathered at a time is a transient)

How each term is counted (bytes of tensor storages, each storage once, so views such as DDP's gradient buckets
or FSDP's padded shards count as what they really hold):
    params    this rank's parameter storage at rest: whole tensors for ddp/zero1, the local shard of each FSDP
              DTensor (padding included) for zero2/fsdp;
    grads     p.grad storages (DDP's bucket views = the buckets; FSDP's reduce-scattered local shards);
    optim     every tensor in this rank's AdamW state (ZeroRedundancyOptimizer: its local shard's AdamW);
    gathered  FSDP's all-gather outputs that are materialised at that moment (the unsharded parameters).
They are sampled before and after every block's forward, when backward reaches each block, after backward and
after the optimizer step of the SECOND step (AdamW state exists only after a first step), with one micro-batch.
    resident  params + grads + optim after backward, before zero_grad: all three live;
    peak      the largest params + gathered + grads + optim over the samples.
The formulas are compared with `peak` for ddp, zero1 and zero2 — ZeRO-2's 4Ψ is exactly the whole parameters it
keeps gathered from forward to backward (reshard_after_forward=False) — and with `resident` for fsdp, whose
gathered units are the transient buffers the ZeRO paper counts apart; they are shown in `gathered`.
Activations are not counted there (the model's matrices dwarf a 2 x 16-token batch anyway).

--activations measures them instead, on one process: the bytes a forward leaves for its backward under each
memory.recompute policy (scaletrain.metrics.memory: every storage an op made during forward that is still alive
after it), beside the formula derived in docs/memory.md, the forward+backward time relative to no recompute in
the same run, and the process's peak RSS; for the debug and a ~30M model at seq 256 and 1024.

    python benchmarks/memory.py [--layers 8 --dim 256 --ffn 768 --vocab 256]
    python benchmarks/memory.py --activations [--seqs 256 1024 --repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.config import OptimizerConfig  # noqa: E402
from scaletrain.hardware import cpu_features  # noqa: E402
from scaletrain.metrics.memory import saved_activation_bytes  # noqa: E402
from scaletrain.models import ModelArgs, build_meta_model, build_model  # noqa: E402
from scaletrain.models.loss import cross_entropy  # noqa: E402
from scaletrain.optim.optimizers import build_optimizer, build_zero1_optimizer  # noqa: E402
from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp  # noqa: E402
from scaletrain.parallel.recompute import apply_recompute  # noqa: E402
from scaletrain.parallel.step import StepRunner  # noqa: E402
from tests.distributed.spawn import spawn  # noqa: E402

MODES = ("ddp", "zero1", "zero2", "fsdp")
FORMULA = {  # bytes per parameter
    "ddp": lambda n: 16.0,
    "zero1": lambda n: 8 + 8 / n,
    "zero2": lambda n: 4 + 12 / n,
    "fsdp": lambda n: 16 / n,
}
FORMULA_TEXT = {"ddp": "16Ψ", "zero1": "8Ψ+8Ψ/N", "zero2": "4Ψ+12Ψ/N", "fsdp": "16Ψ/N"}
COMPARED = {"ddp": "peak", "zero1": "peak", "zero2": "peak", "fsdp": "resident"}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    held: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if st.nbytes():
            held[st.data_ptr()] = st.nbytes()
    return sum(held.values())


def state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    fsdp_params = [
        fp
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params
    ]
    if fsdp_params:
        # While a unit is gathered, module.parameters() are the unsharded tensors: read FSDP's own records.
        params = storage_bytes(fp.sharded_param for fp in fsdp_params)
        gathered = storage_bytes(t for fp in fsdp_params for t in fp.all_gather_outputs)
        grads = storage_bytes(fp.sharded_param.grad for fp in fsdp_params)
    else:
        params, gathered = storage_bytes(model.parameters()), 0
        grads = storage_bytes(p.grad for p in model.parameters())
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's AdamW
    optim = storage_bytes(v for s in local.state.values() for v in s.values() if torch.is_tensor(v))
    return {"params": params, "gathered": gathered, "grads": grads, "optim": optim}


def measure(mode: str, args: ModelArgs, n: int) -> dict:
    model = build_meta_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    psi = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    opt_cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    if mode in ("ddp", "zero1"):
        model = apply_ddp(model, mesh, 25)
        opt = (
            build_zero1_optimizer(model, opt_cfg, mesh)
            if mode == "zero1"
            else build_optimizer(model, opt_cfg)
        )
    else:
        apply_fsdp(model, mesh, reshard_after_forward=mode == "fsdp")
        opt = build_optimizer(model, opt_cfg)
    runner = StepRunner([model], micro_batch=2, autocast=contextlib.nullcontext(), grad_clip=1.0)
    samples: list[dict[str, int]] = []
    armed = [False]

    def sample(*_):
        if armed[0]:
            samples.append(state_bytes(model, opt))

    def on_output(mod, inputs, out):
        sample()
        if out.requires_grad:
            out.register_hook(lambda g: sample())  # backward has reached this block

    inner = model.module if hasattr(model, "module") else model
    for m in [*inner.layers.values(), inner]:
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(on_output)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab_size, (2, args.max_seq_len + 1), generator=g)
    resident = {}
    for step in range(2):
        armed[0] = step == 1
        runner.forward_backward(x[:, :-1], x[:, 1:])
        if armed[0]:
            resident = state_bytes(model, opt)
            samples.append(resident)
        runner.clip()
        opt.step()
        sample()
        opt.zero_grad(set_to_none=True)
    peak = max(samples, key=lambda s: s["params"] + s["gathered"] + s["grads"] + s["optim"])
    return {
        "psi": psi,
        **{k: v for k, v in resident.items() if k != "gathered"},
        "gathered": max(s["gathered"] for s in samples),
        "resident": resident["params"] + resident["grads"] + resident["optim"],
        "peak": sum(peak.values()),
    }


def worker(rank: int, world_size: int, margs: dict, out: str) -> None:
    args = ModelArgs(**margs)
    rows = {}
    for mode in MODES:
        got = measure(mode, args, world_size)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, got)
        rows[mode] = per_rank
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


# -- Activations per recompute policy --------------------------------------------------------------------------

POLICIES = ("none", "every_k", "selective", "full")
ACT_MODELS = {  # debug: the preset with the byte tokenizer's 320 rows; 30M: 29.8M parameters
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=352, vocab_size=320),
    "30M": dict(dim=512, n_layers=10, n_heads=8, n_kv_heads=4, ffn_hidden=1408, vocab_size=320),
}


def activation_formula(a: ModelArgs, b: int, s: int, policy: str, every: int = 2) -> int:
    """Bytes (fp32) the forward saves for backward, derived in docs/memory.md. Per block, in units of sb:
    none 8h + 2h_kv + 4f + a (+ 2 for the norms' rsqrt), selective 5h + 2h_kv + 2f + a, full h (its input);
    plus the head: the last block's output, the final norm's two outputs and the log-softmax, 3h + V."""
    h, f, hkv, heads = a.dim, a.ffn_hidden, a.n_kv_heads * a.head_dim, a.n_heads
    per_block = {
        "none": 8 * h + 2 * hkv + 4 * f + heads + 2,
        "selective": 5 * h + 2 * hkv + 2 * f + heads,
        "full": h,
    }
    if policy == "every_k":
        k = a.n_layers // every
        blocks = k * per_block["full"] + (a.n_layers - k) * per_block["none"]
    else:
        blocks = a.n_layers * per_block[policy]
    return 4 * b * s * (blocks + 3 * h + a.vocab_size)


def measure_activations(margs: dict, seq: int, repeats: int) -> dict[str, dict]:
    """Measured saved bytes of each policy at batch 1, and its fastest forward+backward over `repeats` rounds
    that take the policies in turn (so a busy machine slows them alike; the minimum is the least disturbed)."""
    args = ModelArgs(**margs, max_seq_len=seq)
    base = build_model(args, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab_size, (1, seq + 1), generator=g)
    models = {policy: apply_recompute(copy.deepcopy(base), policy, 2) for policy in POLICIES}
    rows = {}
    for policy, model in models.items():
        saved, loss = saved_activation_bytes(lambda m=model: cross_entropy(m(x[:, :-1]), x[:, 1:]))
        loss.backward()
        rows[policy] = {"saved": saved, "formula": activation_formula(args, 1, seq, policy), "time_s": 1e9}
    for _ in range(repeats):
        for policy, model in models.items():
            t0 = time.perf_counter()
            cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
            rows[policy]["time_s"] = min(rows[policy]["time_s"], time.perf_counter() - t0)
    return rows


def activations_main(seqs: list[int], repeats: int) -> int:
    torch.manual_seed(0)
    print(
        f"CPU: {cpu_features()}; torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, batch 1"
    )
    print(f"{'model':<6}{'seq':>6}  {'policy':<10}{'saved MiB':>10}{'formula':>9}{'meas/form':>10}"
          f"{'vs none':>8}{'time s':>8}{'t/none':>7}")  # fmt: skip
    ok = True
    for name, margs in ACT_MODELS.items():
        for seq in seqs:
            rows = measure_activations(margs, seq, repeats)
            none = rows["none"]
            for policy, r in rows.items():
                ratio = r["saved"] / r["formula"]
                ok &= abs(ratio - 1) <= 0.15
                print(
                    f"{name:<6}{seq:>6}  {policy:<10}{r['saved'] / 2**20:>10.2f}{r['formula'] / 2**20:>9.2f}"
                    f"{ratio:>10.3f}{r['saved'] / none['saved']:>8.1%}{r['time_s']:>8.3f}"
                    f"{r['time_s'] / none['time_s']:>7.2f}"
                )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"peak RSS of the process: {rss:.0f} MiB; every measured/formula within 15%: {'yes' if ok else 'NO'}"
    )
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--activations", action="store_true", help="activation memory per recompute policy instead"
    )
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    if a.activations:
        return activations_main(a.seqs, a.repeats)
    margs = dict(
        dim=a.dim,
        n_layers=a.layers,
        n_heads=4,
        n_kv_heads=4,
        ffn_hidden=a.ffn,
        vocab_size=a.vocab,
        max_seq_len=16,
    )
    header = (
        f"{'mode':<6}{'N':>3}{'params':>8}{'grads':>8}{'optim':>8}{'resident':>10}{'gathered':>10}"
        f"{'peak':>8}  {'formula':<10}{'=':>6}  {'ratio':>6}  vs"
    )
    lines, ok, psi = [header], True, 0
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sizes:
            out = Path(tmp) / f"mem{n}.json"
            spawn(worker, n, margs, str(out))
            for mode, per_rank in json.loads(out.read_text()).items():
                r = max(per_rank, key=lambda x: x[COMPARED[mode]])  # the fullest rank
                psi, f = r["psi"], FORMULA[mode](n)
                ratio = r[COMPARED[mode]] / psi / f
                ok &= abs(ratio - 1) <= 0.10
                cols = (
                    ("params", 8),
                    ("grads", 8),
                    ("optim", 8),
                    ("resident", 10),
                    ("gathered", 10),
                    ("peak", 8),
                )
                lines.append(
                    f"{mode:<6}{n:>3}"
                    + "".join(f"{r[k] / psi:>{w}.2f}" for k, w in cols)
                    + f"  {FORMULA_TEXT[mode]:<10}{f:>6.2f}  {ratio:>6.3f}  {COMPARED[mode]}"
                )
    print(
        f"Bytes per parameter on the fullest rank; Ψ = {psi:,} parameters, fp32 AdamW; ratio = measured / formula"
    )
    print("\n".join(lines))
    print(f"every ratio within 10%: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
