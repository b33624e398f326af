"""The CUDA side of what the CPU suite checks: the default process group that pairs NCCL (CUDA tensors) with
gloo (CPU tensors), the control plane on its gloo group, FSDP2 and a sharded DCP checkpoint of CUDA tensors, fused
AdamW, TF32 off, pinned asynchronous staging, CUDA peak memory, and the CLI on a GPU.

None of these stands in for a CPU test: each docstring names the CPU test of the same logic. Every process group
here has one rank (NCCL refuses two ranks on one device), so the file runs on any single GPU; it is sized for well
under three minutes on an H200.
"""

from __future__ import annotations

import json
import math
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint import CheckpointManager, ModelState, TrainState
from scaletrain.config import (
    CheckpointConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
)
from scaletrain.metrics.memory import peak_memory_mib
from scaletrain.models import ModelArgs, build_meta_model, build_model
from scaletrain.models.moe import _GROUPED_OK, grouped_mm_usable
from scaletrain.optim.optimizers import Optimizers, build_optimizer, optimizer_builder
from scaletrain.parallel.data_parallel import apply_fsdp, full_state_dict
from scaletrain.parallel.expert_parallel import apply_ep
from scaletrain.parallel.materialize import materialize
from scaletrain.parallel.mesh import (
    DistEnv,
    ParallelDims,
    all_reduce_mean,
    any_rank,
    broadcast_object,
    main_first,
    setup_process,
)
from scaletrain.parallel.parallelize import ParallelModel, parallelize
from scaletrain.parallel.step import build_step_runner
from scaletrain.precision import apply_fp8, resolve_precision
from scaletrain.resilience.preemption import Preemption
from tests.distributed.reference import OPT, STEPS, full_model, global_batches, reference_run, tiny_args
from tests.distributed.spawn import spawn
from tests.helpers import DEBUG, QUICK, events, free_port, read_jsonl, run_cli
from tests.unit.test_device_branches import kept_process_settings
from tests.unit.test_moe import DIM, make_moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
# The collectives the control plane issues (mesh.py, checkpoint/state.py, resilience/preemption.py).
CONTROL_OPS = (
    "all_reduce",
    "all_gather",
    "broadcast",
    "broadcast_object_list",
    "all_gather_object",
    "barrier",
)


# -- One spawned rank with the process group the code makes on GPUs ------------------------------------------------
#
# The worker records facts (JSON) section by section; the tests assert on them, so one failing section does not hide
# the others (the pattern of tests/distributed/reference.run_layouts).


def _join_as_the_code_does(device: torch.device) -> None:
    """The default group init_distributed joins on GPUs (it joins none at world size 1, so the call is repeated
    here): NCCL for CUDA tensors beside gloo for CPU ones, bound to the device; then setup_process. It replaces
    spawn's gloo-only group, on a fresh port so that the new store never meets the old one's keys."""
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(free_port())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="cuda:nccl,cpu:gloo" if cuda else "gloo", device_id=device if cuda else None
    )
    setup_process(DistEnv(0, 1, 0, 1, device), threads=1, deterministic=False)


def _group_worker(rank: int, world_size: int, device_name: str, out: str) -> None:
    device = torch.device(device_name)
    _join_as_the_code_does(device)
    facts = {}
    for name, section in (
        ("process_group", _process_group_facts),
        ("control_plane", _control_plane_facts),
        ("fsdp", _fsdp_facts),
        ("moe", _moe_facts),
        ("sharded_init", _sharded_init_facts),
    ):
        facts[name] = _guarded(section, device, Path(out).parent / name)
    Path(out).write_text(json.dumps(facts))


def _guarded(section, *args) -> dict:
    try:
        return section(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _process_group_facts(device: torch.device, tmp: Path) -> dict:
    on_device, on_host = torch.ones(4, device=device), torch.ones(4)
    dist.all_reduce(on_device)  # the default group's NCCL
    dist.all_reduce(on_host)  # the default group's gloo
    control = dist.new_group(backend="gloo")  # what ParallelDims.build_mesh makes for the control plane
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_cp",))
    mean = all_reduce_mean(torch.full((3,), 2.0, device=device), mesh)
    return {
        "default": dist.get_backend_config(),
        "control": str(dist.get_backend(control)),
        "mesh": dist.get_backend_config(mesh.get_group()),
        "sums": [[t.device.type, t.tolist()] for t in (on_device, on_host)],
        "mean": [mean.device.type, mean.tolist()],
    }


def _recording(fn, name: str, calls: list[dict]):
    def wrapped(*args, **kwargs):
        group = kwargs.get("group")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
        call = {
            "op": name,
            "backend": "default group" if group is None else str(dist.get_backend(group)),
            "devices": sorted({t.device.type for t in tensors}),
        }
        if name.endswith("_object_list") or name.endswith("_object"):
            # The device torch stages pickled objects on for this group (private, pinned torch 2.13).
            call["object_device"] = dist.distributed_c10d._get_object_coll_device(group)
        calls.append(call)
        return fn(*args, **kwargs)

    return wrapped


def _control_plane_facts(device: torch.device, tmp: Path) -> dict:
    """Every collective of the control plane (flags, objects, RNG rows, preemption), with its group's backend and
    its tensors' devices, while the default group holds NCCL for the device."""
    control = dist.new_group(backend="gloo")
    calls: list[dict] = []
    saved = {name: getattr(dist, name) for name in CONTROL_OPS}
    for name, fn in saved.items():
        setattr(dist, name, _recording(fn, name, calls))
    try:
        preemption = Preemption(control)
        results = {
            "any_false": any_rank(False, control),
            "any_true": any_rank(True, control),
            "broadcast": broadcast_object({"step": 3, "path": "ck"}, control),
            "main_first": main_first(True, control, lambda: 7),
            "rng_rows": list(TrainState(control).state_dict()["rng"].shape),
            "preempted": preemption.requested(),
        }
        preemption.close()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return {"results": results, "calls": calls}


def _train(pm: ParallelModel, pcfg: ParallelConfig, batches: list, device: torch.device):
    """What tests/distributed/reference.train_steps does on one process (that helper is CPU-only), on `device`:
    the StepRunner, Optimizers and optimizer builder of train.py. Returns (losses, final weights, optimizers)."""
    build = optimizer_builder(OPT, pcfg.data_parallel, None)
    optimizers = Optimizers(pm.parts, build, OPT, len(batches))
    runner = build_step_runner(pm, ParallelDims(), pcfg, TrainingConfig(micro_batch=4, grad_clip=1.0), device)
    losses = []
    for x, y in batches:
        loss = runner.forward_backward(x.to(device), y.to(device))
        runner.clip()
        optimizers.step()
        losses.append(loss.item())
    return losses, full_state_dict(pm.parts[0]), optimizers


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _reference_and_device_runs(args, device: torch.device):
    """The batches, the CPU reference run, and the same CPU-initialised model trained unsharded on the device (what
    parallelize does on one GPU): its losses and final state."""
    batches = global_batches(args)
    ref = reference_run(full_model(args), batches)
    plain = parallelize(
        full_model(args).to(device), ParallelDims(), ParallelConfig(), device=device, n_microbatches=1
    )
    plain_losses, plain_state, _ = _train(plain, ParallelConfig(), batches, device)
    return batches, ref, plain_losses, plain_state


def _fsdp_facts(device: torch.device, tmp: Path) -> dict:
    """The tiny model three ways from the same CPU-initialised weights: the CPU reference, unsharded on the device
    (what parallelize does on one GPU), and FSDP2 over a one-rank device mesh."""
    args = tiny_args()
    batches, ref, plain_losses, plain_state = _reference_and_device_runs(args, device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard_cp",))
    sharded = ParallelModel([apply_fsdp(full_model(args).to(device), mesh, reshard_after_forward=True)])
    fsdp_losses, fsdp_state, optimizers = _train(
        sharded, ParallelConfig(data_parallel="fsdp"), batches, device
    )
    wq = sharded.parts[0].layers["0"].attention.wq.weight
    return {
        "losses": {"cpu": ref.losses, "device": plain_losses, "fsdp": fsdp_losses},
        "dtensor": isinstance(wq, DTensor),
        "device": wq.device.type,
        "mesh": dist.get_backend_config(mesh.get_group()),
        "fused": bool(optimizers.optimizers[0].defaults["fused"]),
        "param_diff_fsdp_vs_device": _max_diff(fsdp_state, plain_state),
        "param_diff_device_vs_cpu": _max_diff(plain_state, ref.state),
        "checkpoint": _guarded(_checkpoint_facts, sharded, optimizers, mesh, device, tmp),
    }


def _moe_facts(device: torch.device, tmp: Path) -> dict:
    """A tiny MoE model (4 experts, top-2, balance loss) from the same CPU-initialised weights three ways: the CPU
    reference, unsharded on the device (on a Hopper GPU in bf16 the experts would take torch._grouped_mm; here
    fp32, the segment loop), and with apply_ep's dispatch over a one-rank device mesh: its count and row
    all-to-alls then carry device tensors over that mesh's backend (NCCL on CUDA), as they do at ep > 1."""
    args = tiny_args(n_layers=2, n_experts=4, top_k=2, moe_hidden=32, aux_loss_coef=0.01)
    batches, ref, plain_losses, plain_state = _reference_and_device_runs(args, device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("ep",))
    ep = ParallelModel([apply_ep(full_model(args).to(device), mesh)])
    ep_losses, ep_state, _ = _train(ep, ParallelConfig(), batches, device)
    w1 = ep.parts[0].layers["0"].feed_forward.experts.w1
    return {
        "losses": {"cpu": ref.losses, "device": plain_losses, "ep": ep_losses},
        "dtensor": isinstance(w1, DTensor),
        "device": w1.device.type,
        "mesh": dist.get_backend_config(mesh.get_group()),
        "param_diff_ep_vs_device": _max_diff(ep_state, plain_state),
        "param_diff_device_vs_cpu": _max_diff(plain_state, ref.state),
    }


def _manager(state: dict, root: Path, device: torch.device, seen: list[str]) -> CheckpointManager:
    mgr = CheckpointManager(
        CheckpointConfig(async_save=True),
        str(root),
        state,
        rank=0,
        world_size=1,
        event=lambda kind, **kw: seen.append(kind),
        device_type=device.type,
    )
    # What the constructor makes when world_size > 1 (here of one rank): the save talks over gloo while the
    # tensors it writes are CUDA DTensors on an NCCL mesh, the multi-GPU combination.
    mgr.group = dist.new_group(backend="gloo")
    return mgr


def _checkpoint_facts(
    pm: ParallelModel, optimizers: Optimizers, mesh: DeviceMesh, device: torch.device, tmp: Path
) -> dict:
    """Save the trained FSDP model, its optimizer and train state asynchronously; load them into a fresh sharded
    model with other weights; compare everything gathered."""
    control, seen = dist.new_group(backend="gloo"), []
    train = TrainState(control)
    train.step = STEPS
    mgr = _manager(dict(model=ModelState(pm.parts), optimizer=optimizers, train=train), tmp, device, seen)
    mgr.save(STEPS)
    saved = mgr.wait()
    mgr.shutdown()
    fresh = ParallelModel(
        [apply_fsdp(full_model(tiny_args(), seed=1).to(device), mesh, reshard_after_forward=True)]
    )
    fresh_opt = Optimizers(fresh.parts, lambda part: build_optimizer(part, OPT), OPT, STEPS)
    fresh_train = TrainState(control)
    mgr = _manager(
        dict(model=ModelState(fresh.parts), optimizer=fresh_opt, train=fresh_train), tmp, device, seen
    )
    loaded = mgr.load_latest()
    mgr.shutdown()
    before, after = optimizers.state_dict(), fresh_opt.state_dict()
    moments = [k for k in before if k.startswith("state.") and isinstance(before[k], torch.Tensor)]
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    wq = fresh.parts[0].layers["0"].attention.wq.weight
    return {
        "saved": saved,
        "loaded": loaded,
        "train_step": fresh_train.step,
        "events": seen,
        "param_diff": _max_diff(full_state_dict(pm.parts[0]), full_state_dict(fresh.parts[0])),
        "moments": len(moments),
        "moment_diff": max(_max_diff({k: full(before[k])}, {k: full(after[k])}) for k in moments),
        "on_device": isinstance(wq, DTensor)
        and wq.device.type == device.type
        and all(after[k].device.type == device.type for k in moments if k.endswith("exp_avg")),
    }


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _sharded_init_facts(device: torch.device, tmp: Path) -> dict:
    """Issue 23's sharded initialisation as a run does it: the model built on meta, sharded by FSDP2 over a one-rank
    device mesh, then materialised. Per storage (the device; the host under FSDP's CPU offload): whether its
    parameters are DTensor shards, where they live, which differ from the single-process weights drawn on the device
    (bit for bit), and whether the device RNG is left elsewhere than that init leaves it."""
    args = ModelArgs(
        dim=48, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=90, vocab_size=131, max_seq_len=16
    )
    want = {k: v.cpu() for k, v in build_model(args, 7, device).state_dict().items()}
    rng = _rng_state(device)
    facts = {}
    for storage in dict.fromkeys([device.type, "cpu"]):
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard_cp",))
        offload = CPUOffloadPolicy(pin_memory=False) if storage != device.type else None
        model = apply_fsdp(build_meta_model(args), mesh, reshard_after_forward=True, offload_policy=offload)
        materialize(model, 7, device, storage_device=torch.device(storage))
        got = model.state_dict()
        facts[storage] = {
            "shards": all(isinstance(v, DTensor) for v in got.values()),
            "devices": sorted({v.to_local().device.type for v in got.values()}),
            "differ": sorted(
                k for k, v in got.items() if k in want and not torch.equal(v.to_local().cpu(), want[k])
            ),
            "missing": sorted(want.keys() - got.keys()),
            "rng_moved": not torch.equal(_rng_state(device), rng),
        }
    return facts


@pytest.fixture(scope="module")
def group_facts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_group") / "facts.json"
    spawn(_group_worker, 1, str(CUDA), str(out), timeout=240)
    return json.loads(out.read_text())


def _ok(facts: dict) -> dict:
    assert "error" not in facts, facts["error"]
    return facts


def _backends(config: str) -> dict[str, str]:
    """'cuda:nccl,cpu:gloo' -> {'cuda': 'nccl', 'cpu': 'gloo'}; a bare 'nccl' serves every device."""
    if ":" not in config:
        return {"cuda": config, "cpu": config}
    return dict(pair.split(":") for pair in config.split(","))


def _assert_close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    print(f"{what}: max relative loss difference {worst:.1e} (allowed {rtol:.0e})")
    assert worst <= rtol, f"{what}: {got} vs {want}"


def test_the_default_group_carries_cuda_tensors_on_nccl_and_cpu_tensors_on_gloo(group_facts):
    """CPU twins: the decision, in tests/unit/test_device_branches.py:
    test_init_distributed_pairs_nccl_with_gloo_for_cuda_only; the gloo side, every test of tests/distributed/."""
    f = _ok(group_facts["process_group"])
    assert _backends(f["default"]) == {"cuda": "nccl", "cpu": "gloo"}
    assert f["control"] == "gloo"
    assert f["sums"] == [["cuda", [1.0] * 4], ["cpu", [1.0] * 4]]
    assert f["mean"] == ["cuda", [2.0] * 3]  # all_reduce_mean over the device mesh's NCCL group
    assert _backends(f["mesh"])["cuda"] == "nccl"


def test_the_control_plane_exchanges_cpu_tensors_on_its_gloo_group(group_facts):
    """CPU twins: tests/distributed/test_control_plane.py (no control-plane collective on the default group) and
    tests/unit/test_device_branches.py::test_the_control_group_is_gloo_whatever_the_mesh_device."""
    f = _ok(group_facts["control_plane"])
    assert f["results"] == {
        "any_false": False,
        "any_true": True,
        "broadcast": {"step": 3, "path": "ck"},
        "main_first": 7,
        "rng_rows": [1, torch.get_rng_state().numel()],
        "preempted": False,
    }
    ops = {c["op"] for c in f["calls"]}
    assert {"all_reduce", "all_gather", "broadcast_object_list"} <= ops, f["calls"]
    for call in f["calls"]:
        assert call["backend"] == "gloo" and set(call["devices"]) <= {"cpu"}, call
        assert call.get("object_device", "cpu") == "cpu", call


def test_fsdp2_on_cuda_matches_the_unsharded_cuda_run_and_the_cpu_reference(group_facts):
    """CPU twin: tests/distributed/test_data_parallel.py::test_sharded_data_parallel_matches_reference[fsdp]
    (FSDP over 2 gloo ranks against the same reference). Here: CUDA kernels with TF32 off, fused AdamW on
    DTensors, and FSDP2's NCCL collectives, against the CPU reference of the same initial weights."""
    f = _ok(group_facts["fsdp"])
    assert f["dtensor"] and f["device"] == "cuda" and f["fused"]
    assert _backends(f["mesh"])["cuda"] == "nccl"
    losses = f["losses"]
    _assert_close(losses["fsdp"], losses["device"], 1e-5, "FSDP2 vs unsharded, both on CUDA")
    # Different kernels and reduction orders (and fused vs foreach AdamW): close, not equal.
    _assert_close(losses["device"], losses["cpu"], 1e-4, "CUDA vs the CPU reference")
    fsdp_diff, cpu_diff = f["param_diff_fsdp_vs_device"], f["param_diff_device_vs_cpu"]
    print(f"largest weight difference: FSDP vs unsharded {fsdp_diff:.1e}, CUDA vs CPU {cpu_diff:.1e}")
    assert fsdp_diff <= 1e-5 and cpu_diff <= 1e-3
    assert losses["device"][-1] < losses["device"][0]


def test_moe_with_its_expert_dispatch_on_cuda_matches_the_cpu_reference(group_facts):
    """CPU twin: tests/distributed/test_expert_parallel.py (ep 2 and 4 over gloo against the same reference). Here
    the dispatch's all-to-alls run on CUDA tensors over NCCL, with fused AdamW on the DTensor experts."""
    f = _ok(group_facts["moe"])
    assert f["dtensor"] and f["device"] == "cuda" and _backends(f["mesh"])["cuda"] == "nccl"
    losses = f["losses"]
    _assert_close(losses["ep"], losses["device"], 1e-5, "MoE with its ep dispatch vs without, both on CUDA")
    _assert_close(losses["device"], losses["cpu"], 1e-4, "MoE on CUDA vs the CPU reference")
    assert f["param_diff_ep_vs_device"] <= 1e-5 and f["param_diff_device_vs_cpu"] <= 1e-3
    assert losses["device"][-1] < losses["device"][0]


def test_a_sharded_cuda_checkpoint_round_trips_through_dcp_over_a_gloo_group(group_facts):
    """CPU twins: tests/unit/test_checkpoint.py::test_save_then_load_restores_everything (one process) and
    tests/e2e/test_checkpoint_layouts.py (sharded layouts on gloo). Here the tensors are CUDA DTensors, staged to
    pinned host memory asynchronously, and the save's group is gloo while the mesh is NCCL."""
    c = _ok(_ok(group_facts["fsdp"])["checkpoint"])
    assert c["saved"] and c["loaded"] == STEPS and c["train_step"] == STEPS
    assert "checkpoint_saved" in c["events"] and "checkpoint_loaded" in c["events"]
    assert c["param_diff"] == 0.0 and c["moments"] > 0 and c["moment_diff"] == 0.0
    assert c["on_device"], "the loaded parameters or moments left the device"


# -- In this process, no process group -------------------------------------------------------------------------


def test_setup_process_makes_cuda_fp32_matmuls_full_fp32():
    """CPU twin (the flags): tests/unit/test_device_branches.py::test_setup_process_turns_tf32_off_for_cuda_only.
    Here the matmul itself: relative to its largest entry, TF32's 10-bit mantissa errs by ~4e-4, fp32 by ~1e-7."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    a, b = (torch.randn(1024, 1024, device=CUDA, generator=g) for _ in range(2))
    exact = a.double() @ b.double()
    with kept_process_settings():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        setup_process(DistEnv(0, 1, 0, 1, CUDA), threads=1, deterministic=False)
        flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        err = ((a @ b).double() - exact).abs().max() / exact.abs().max()
    assert flags == (False, False)
    assert err < 1e-5, f"relative error {err:.1e}: the matmul ran in TF32"


def test_auto_adamw_is_fused_on_cuda_and_steps_like_foreach():
    """CPU twin (the choice), in tests/unit/test_device_branches.py:
    test_auto_adamw_is_fused_for_cuda_and_foreach_for_cpu. Here the fused kernel runs: its step counter lives on
    the device, and one update from the same gradients equals the foreach update to rounding."""
    fused_model, foreach_model = (full_model(tiny_args()).to(CUDA) for _ in range(2))
    fused = build_optimizer(fused_model, OptimizerConfig())
    foreach = build_optimizer(foreach_model, OptimizerConfig(implementation="foreach"))
    assert fused.defaults["fused"] and not fused.defaults["foreach"]
    x = torch.randint(0, 128, (2, 32), device=CUDA)
    fused_model(x).float().square().mean().backward()
    for p, q in zip(fused_model.parameters(), foreach_model.parameters(), strict=True):
        q.grad = p.grad.clone()  # the same gradients for both: only the update kernels differ
    fused.step()
    foreach.step()
    for (name, p), q in zip(fused_model.named_parameters(), foreach_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    step = fused.state[next(fused_model.parameters())]["step"]
    assert step.device.type == "cuda" and step.item() == 1


def _cuda_state(seed: int) -> tuple[dict, nn.Module, Optimizers]:
    model = full_model(tiny_args(), seed).to(CUDA)
    optimizers = Optimizers([model], lambda m: build_optimizer(m, OPT), OPT, 100)
    model(torch.randint(0, 128, (2, 16), device=CUDA)).float().square().mean().backward()
    optimizers.step()
    return {"model": ModelState([model]), "optimizer": optimizers, "train": TrainState()}, model, optimizers


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_manager_round_trips_cuda_state(tmp_path, async_save):
    """CPU twins: tests/unit/test_checkpoint.py::test_save_then_load_restores_everything and (the staging flags)
    tests/unit/test_device_branches.py::test_async_save_pins_and_copies_non_blocking_only_for_a_cuda_run."""
    state, model, optimizers = _cuda_state(seed=0)
    state["train"].step = 7
    mgr = CheckpointManager(
        CheckpointConfig(async_save=async_save),
        str(tmp_path),
        state,
        rank=0,
        world_size=1,
        device_type="cuda",
    )
    mgr.save(7)
    assert mgr.wait()
    if async_save:
        options = mgr.stager._config  # torch's DefaultStager keeps its StagingOptions here (pinned 2.13)
        assert options.use_pinned_memory and options.use_non_blocking_copy
    mgr.shutdown()
    state2, model2, optimizers2 = _cuda_state(seed=1)
    mgr2 = CheckpointManager(
        CheckpointConfig(), str(tmp_path), state2, rank=0, world_size=1, device_type="cuda"
    )
    assert mgr2.load_latest() == 7 and state2["train"].step == 7
    mgr2.shutdown()
    for (name, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert q.device.type == "cuda" and torch.equal(p, q), name
    m1, m2 = (o.optimizers[0].state_dict()["state"][0]["exp_avg"] for o in (optimizers, optimizers2))
    assert m2.device.type == "cuda" and torch.equal(m1, m2)


def test_an_async_save_holds_the_weights_of_kernels_still_queued(tmp_path):
    """No CPU twin is possible: a CPU has no streams. The save of a step must hold that step's weights even while
    the GPU is still computing them (the loop does not synchronise between the optimizer step and the save on
    steps it does not log). Staging copies on a side stream in a thread; unless it waits for the work already
    queued on the training stream, it copies the weights from before the update."""
    lin = nn.Linear(2048, 2048, bias=False, device=CUDA)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    torch.cuda.synchronize()
    mgr = CheckpointManager(
        CheckpointConfig(async_save=True),
        str(tmp_path),
        {"model": ModelState([lin])},
        rank=0,
        world_size=1,
        device_type="cuda",
    )
    with torch.no_grad():
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU clock cycles queued ahead of the "update"
        lin.weight.fill_(2.0)  # the optimizer's update, still queued when the save starts
    mgr.save(1)
    assert mgr.wait()
    mgr.shutdown()
    fresh = nn.Linear(2048, 2048, bias=False, device=CUDA)
    mgr = CheckpointManager(
        CheckpointConfig(), str(tmp_path), {"model": ModelState([fresh])}, rank=0, world_size=1
    )
    assert mgr.load_latest() == 1
    mgr.shutdown()
    values = fresh.weight.unique().tolist()
    assert values == [2.0], f"the checkpoint holds {values[:4]}: staged before the queued update ran"


def test_peak_memory_is_the_cuda_allocators_peak():
    """CPU twins: tests/unit/test_metrics.py::test_peak_memory_is_positive_on_cpu (the RSS branch) and
    tests/unit/test_device_branches.py::test_peak_memory_on_cuda_reads_the_allocator_peak (the branch taken).
    Here: a 256 MiB tensor raises the peak by 256 MiB and freeing it does not lower it (a process RSS, what the
    CPU branch reads, would be far above it with a CUDA context loaded)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(CUDA)
    base = torch.cuda.memory_allocated(CUDA) / 2**20
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=CUDA)
    del x
    assert peak_memory_mib(CUDA) - base == pytest.approx(256, abs=2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_on_cuda_writes_finite_falling_losses(tmp_path, precision):
    """CPU twin: tests/e2e/test_train_cli.py::test_single_process_run_writes_the_run_directory_contract. Here the
    run is on the GPU (the start event and the log line say so), in both precisions, with a checkpoint mid-run."""
    run = tmp_path / "run"
    # metrics.peak_tflops 0 after QUICK's fixed CPU figure: the GPU table's peak, which the MFU check reads
    args = ["--config", DEBUG, *QUICK, "--metrics.peak_tflops", "0", "--run.dir", str(run)]
    args += ["--training.device", "cuda"]
    proc = run_cli("train", *args, "--precision.compute", precision, "--checkpoint.interval", "10")
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]
    assert all(m["loss"] is not None and math.isfinite(m["loss"]) for m in metrics), metrics
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert all(m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1 and 0 < m["mem_peak_mib"] < 4096 for m in metrics)
    (start,) = events(run, "start")
    assert start["device"] == "cuda" and start["precision"] == precision
    mechanism = " via torch.autocast(cuda, bf16)" if precision == "bf16" else ""
    assert f"precision {precision}{mechanism} on cuda" in proc.stderr
    assert [e["step"] for e in events(run, "checkpoint_saved")] == [10, 20]


# -- fp8 (torchao float8) against bf16 ------------------------------------------------------------------------------


def _fp8_worker(rank: int, world_size: int, out: str) -> None:
    """bf16, fp8 tensorwise, fp8 rowwise (one GPU, autocast as train.py chooses there) and fp8 tensorwise under
    FSDP2 on a one-rank mesh (the bf16 MixedPrecisionPolicy and fp8 all-gather), 30 steps each, as train.py runs
    them: parallelize/apply_fsdp -> build_step_runner -> forward_backward -> clip -> Optimizers.step."""
    from tests.distributed.test_precision import ARGS, STEPS, markov_batches

    _join_as_the_code_does(CUDA)
    batches = markov_batches(STEPS)
    facts: dict = {}
    for name, recipe, fsdp in (
        ("bf16", None, False),
        ("tensorwise", "tensorwise", False),
        ("rowwise", "rowwise", False),
        ("tensorwise_fsdp", "tensorwise", True),
    ):
        tcfg = TrainingConfig(micro_batch=4)
        pcfg = PrecisionConfig(compute="fp8" if recipe else "bf16", fp8_recipe=recipe or "tensorwise")
        precision = resolve_precision(pcfg, fsdp, "cuda")
        model = full_model(ARGS).to(CUDA)
        if fsdp:
            mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard_cp",))
            apply_fp8(model, recipe, fsdp_all_gather=precision.fp8_all_gather)
            policy = precision.mp_policy()
            pm = ParallelModel([apply_fsdp(model, mesh, reshard_after_forward=True, mp_policy=policy)])
        else:
            pm = parallelize(model, ParallelDims(), ParallelConfig(), device=CUDA, n_microbatches=1,
                             precision=precision)  # fmt: skip
        optimizers = Optimizers(pm.parts, lambda part: build_optimizer(part, OPT), OPT, STEPS)
        runner = build_step_runner(pm, ParallelDims(), ParallelConfig(), tcfg, CUDA, precision=precision)
        losses = []
        for x, y in batches:
            loss = runner.forward_backward(x.to(CUDA), y.to(CUDA))
            runner.clip()
            optimizers.step()
            losses.append(loss.item())
        kinds = {type(m).__name__ for m in pm.parts[0].modules()}
        facts[name] = {"losses": losses, "float8": "Float8Linear" in kinds, "describe": precision.describe()}
    Path(out).write_text(json.dumps(facts))


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 needs compute capability >= 8.9",
)
def test_fp8_trains_within_tolerance_of_bf16(tmp_path):
    """CPU twins: tests/unit/test_precision.py::test_fp8_is_refused_before_launch_off_fp8_hardware and
    ::test_fp8_swaps_the_block_linears_and_keeps_the_output_projection (which layers become Float8Linear). Here
    the float8 matmuls run: over 30 steps each recipe, and tensorwise with FSDP2's fp8 all-gather, follows bf16
    within 5% in loss (e4m3 keeps 3 mantissa bits; the scales are dynamic) and learns as much."""
    out = tmp_path / "fp8.json"
    spawn(_fp8_worker, 1, str(out))
    facts = json.loads(out.read_text())
    bf16 = facts.pop("bf16")["losses"]
    assert bf16[-1] < bf16[0] - 0.5
    for name, f in facts.items():
        rel = max(abs(a - b) / b for a, b in zip(f["losses"], bf16, strict=True))
        print(f"fp8 {name}: max relative loss difference from bf16 over 30 steps {rel:.2e} ({f['describe']})")
        assert f["float8"] and 0 < rel < 5e-2, (name, rel)


def test_calibrate_measures_this_gpu(tmp_path):
    """CPU twin: tests/unit/test_planner.py::test_gpu_calibration_measures_in_place_of_the_datasheet_fractions (the
    same code on gloo under an H200's name). Here: the local GPU's measured bf16 matmul rate and AdamW bandwidth are
    plausible shares of its datasheet figures, and the profile is saved under its kind for `--device KIND` plans.
    One device: NCCL's all-reduce needs two GPUs, so the NVLink figure stays the datasheet's."""
    from scaletrain.planning.calibrate_gpu import calibrate_gpu, gpu_kind
    from scaletrain.planning.estimators.hardware import ACHIEVABLE_HBM, GPUS, load_profile

    kind = gpu_kind(torch.cuda.get_device_name(CUDA))
    lines: list[str] = []
    prof, _ = calibrate_gpu(tmp_path, 1, lines.append)
    print("\n".join(lines))
    sheet = GPUS[kind]
    assert 0.3 < prof.matmul["bf16"][1] / sheet.peak_flops["bf16"] < 1.05, lines
    assert 0.2 < prof.memory_bw / (sheet.memory_bw / ACHIEVABLE_HBM) < 1.05, lines  # of the raw HBM figure
    assert prof.memory_bytes == torch.cuda.get_device_properties(CUDA).total_memory
    assert load_profile(kind, tmp_path) == prof


def test_the_cuda_rng_state_round_trips_through_the_train_state():
    """Issue 24 item 4: the CUDA generator is checkpointed per rank; restored, the next draws repeat."""
    device = torch.device("cuda", 0)
    torch.cuda.manual_seed(1234)
    saved = TrainState(device=device).state_dict()
    first = torch.rand(8, device=device)
    TrainState(device=device).load_state_dict(saved)
    assert torch.equal(torch.rand(8, device=device), first)


def test_busy_time_from_cuda_events_is_positive_and_within_the_wall_time():
    """Issue 24 item 4: straggler detection's busy time on a GPU is the device time of the bracketed compute."""
    import time

    from scaletrain.resilience.busy import EventClock

    clock, x = EventClock(), torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    clock.step_start()
    clock.compute_start()
    for _ in range(10):
        x = torch.tanh(x @ x)
    clock.compute_end()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    (busy,) = clock.step_end()
    assert 0 < busy <= wall


@pytest.mark.parametrize("storage", ["cuda", "cpu"])
def test_sharded_initialisation_on_cuda_draws_the_single_process_weights(group_facts, storage):
    """Issue 23: a model sharded by FSDP2 on meta and materialised draws every parameter whole on the GPU (the same
    CUDA generator as build_model there) and keeps its shard where the shards live: on the GPU, or on the host under
    FSDP's CPU offload (storage "cpu"); bit for bit the single-process CUDA weights, with the truncated normal of
    models/init. CPU twins: tests/distributed/test_sharded_init.py (20 layouts on 4 gloo ranks) and this section run on
    the CPU (tests/distributed/test_sharded_init.py::test_the_gpu_checks_section_holds_on_the_cpu)."""
    f = _ok(group_facts["sharded_init"])[storage]
    assert f == {"shards": True, "devices": [storage], "differ": [], "missing": [], "rng_moved": False}, f


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs CUDA sm90+"
)
def test_moe_on_hopper_uses_grouped_mm_and_equals_the_loop():
    """Under tests/gpu, so the GPU check runs it (marked gpu in tests/unit, it never ran). CPU twin of the choice:
    tests/unit/test_moe.py's grouped-mm probe tests."""
    moe = make_moe().to("cuda", torch.bfloat16)
    x = torch.randn(4, 64, DIM, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_usable(x)
    grouped = moe(x)
    _GROUPED_OK["cuda:0"] = False  # force the loop
    try:
        loop = moe(x)
    finally:
        _GROUPED_OK.clear()
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
