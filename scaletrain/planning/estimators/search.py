"""The planner's search: every layout of a model on N devices (pp, dp_replicate, dp_shard, cp, tp, the data-parallel
mode, the pipeline schedule, recompute and micro-batch), pruned by the layout rules (parallel/layout.py) and the memory
model, ranked by the time model. Also the estimate of one given layout (`plan --config`, `train --dry-run`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from scaletrain.config import Config, ParallelConfig
from scaletrain.errors import ConfigError
from scaletrain.models.llama import ModelArgs
from scaletrain.optim.optimizers import adamw_implementation
from scaletrain.parallel.layout import Layout, global_batch_sequences, layout_problems
from scaletrain.parallel.pipeline import SCHEDULES
from scaletrain.planning.estimators.hardware import DeviceProfile
from scaletrain.planning.estimators.memory import CPU_ESTIMATE_ERROR, PARTS, GiB, pp_rank_bytes
from scaletrain.planning.estimators.time import step_time

MODES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
POLICIES = ("none", "selective", "full")
LAYOUT_KEYS = (
    "dp_replicate",
    "dp_shard",
    "tp",
    "pp",
    "cp",
    "ep",
    "data_parallel",
    "sequence_parallel",
    "pp_schedule",
)


@dataclass
class Plan:
    """One layout with its predicted memory (the fullest rank) and step time."""

    cfg: Config
    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    memory_by_pp_rank: list[float] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def choices(self) -> dict[str, object]:
        """The layout knobs this plan sets, as the overrides name them."""
        p = self.cfg.parallel
        out: dict[str, object] = {k: getattr(p, k) for k in LAYOUT_KEYS}
        out["dp_shard"] = self.layout.dp_shard
        out["pp_microbatches"] = int(self.time["microbatches"]) if p.pp > 1 else 0
        out["recompute"] = self.cfg.memory.recompute
        out["micro_batch"] = self.cfg.training.micro_batch
        return out

    def to_json(self) -> dict:
        return {
            "layout": self.choices(),
            "peak_memory_bytes": self.memory["total"],
            "memory_breakdown": {k: self.memory[k] for k in (*PARTS, "host") if k in self.memory},
            "memory_by_pp_rank": self.memory_by_pp_rank,
            "step_time_s": self.time["step_time_s"],
            "tokens_per_s": self.time["tokens_per_s"],
            "mfu": self.time["mfu"],
            "breakdown": {
                k: v for k, v in self.time.items() if k not in ("step_time_s", "tokens_per_s", "mfu")
            },
        }

    def overrides(self) -> list[str]:
        """The command-line overrides that apply this plan's layout to a config."""
        out = []
        for k, v in self.choices().items():
            section = "memory" if k == "recompute" else "training" if k == "micro_batch" else "parallel"
            out += [f"--{section}.{k}", str(v).lower() if isinstance(v, bool) else str(v)]
        return out

    def describe(self) -> str:
        lay = self.choices()
        sizes = " ".join(
            f"{k}={lay[k]}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") if lay[k] != 1
        )
        extra = f" {lay['pp_schedule']} m={lay['pp_microbatches']}" if lay["pp"] > 1 else ""
        sp = " sp" if lay["sequence_parallel"] else ""
        return (
            f"{sizes or 'single'} {lay['data_parallel']}{sp}{extra} recompute={lay['recompute']} "
            f"micro_batch={lay['micro_batch']}"
        )


def device_bytes(profile: DeviceProfile, world_size: int) -> int:
    """Memory one rank may use: the device's, or on a CPU this process's share of the host (as validate does)."""
    if profile.kind == "cpu":
        return profile.memory_bytes // max(1, world_size)  # every rank is a process on this host
    return profile.memory_bytes


def _device_type(profile: DeviceProfile) -> str:
    return "cuda" if profile.kind == "gpu" else "cpu"


def memory_error(profile: DeviceProfile) -> float:
    """The memory estimate's stated error on this device: a plan must fit with it to spare (memory_problem)."""
    return CPU_ESTIMATE_ERROR if profile.kind == "cpu" else 0.0


def estimate(
    cfg: Config, args: ModelArgs, layout: Layout, profile: DeviceProfile, gpus_per_node: int | None = None
) -> Plan:
    """Predicted memory and time of `cfg`'s layout (raises ConfigError/ValueError where it does not tile)."""
    layout.checked()
    t, seq, world_size = cfg.training, cfg.data.seq_len, layout.world_size
    ranks = pp_rank_bytes(
        args,
        cfg.parallel,
        t,
        seq,
        world_size,
        local_batch=max(layout.local_batch, 1),
        overhead_bytes=profile.process_bytes(world_size, cfg.precision.compute),
        memory=cfg.memory,
        activation_slack=profile.activation_slack,
        precision=cfg.precision.compute,
        qk_clip=cfg.optimizer.qk_clip > 0,
        foreach_step=adamw_implementation(cfg.optimizer.implementation) == "foreach",
        gloo=_device_type(profile) == "cpu",
    )
    worst = max(ranks, key=lambda e: e["total"])
    time = step_time(
        args,
        cfg.parallel,
        t,
        cfg.memory,
        seq,
        world_size,
        profile,
        global_batch=layout.global_batch,
        gpus_per_node=gpus_per_node,
        precision=cfg.precision.compute,
        mechanism=cfg.precision.mechanism,
        optimizer=cfg.optimizer,
    )
    return Plan(cfg, layout, worst, time, [r["total"] for r in ranks])


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in (2**i for i in range(0, 20)) if d <= cap and n % d == 0]


def _ep_sizes(args: ModelArgs, dp: int, mode: str) -> list[int]:
    """Expert-parallel sizes to try: 1, and under fsdp (the mode ep runs with) every power of two dividing both the
    experts and the data-parallel ranks it is carved from."""
    experts = getattr(args, "n_experts", 0)
    return [1] + (
        [e for e in _divisors(dp, dp) if e > 1 and experts % e == 0] if experts and mode == "fsdp" else []
    )


def _layouts(cfg: Config, args: ModelArgs, world: int, node: int) -> Iterator[ParallelConfig]:
    """Every (pp, dp_replicate, dp_shard, cp, tp, mode, schedule) of `world` ranks: tp and cp in powers of two
    (tp up to the node: checked with the reason in _reject), pp up to the layers."""
    base = cfg.parallel
    for tp, cp, pp in itertools.product(
        _divisors(world, 2 * node), _divisors(world, 64), _divisors(world, args.n_layers)
    ):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for mode in MODES if dp * cp > 1 else ("ddp",):
            reps = [1]
            if mode == "hsdp":  # shard within a node, replicate across nodes
                shard = max(1, node // (tp * cp))
                reps = [dp // shard] if dp % shard == 0 and 1 < shard < dp else []
            scheds = SCHEDULES if pp > 1 else (base.pp_schedule,)
            for rep, sched, ep in itertools.product(reps, scheds, _ep_sizes(args, dp, mode)):
                yield dataclasses.replace(
                    base, tp=tp, cp=cp, pp=pp, dp_replicate=rep, dp_shard=-1, data_parallel=mode,
                    sequence_parallel=tp > 1, pp_schedule=sched, pp_microbatches=0, ep=ep,
                )  # fmt: skip


def _reason(problem: str) -> str:
    """The family a validate message belongs to, for counting rejections."""
    families = [
        # Before "micro-batches": the ramp's pp refusal names them too.
        ("batch_ramp is not supported with parallel.pp", "the batch ramp cannot run with pipeline stages"),
        ("sequences do not split into training.micro_batch", "the batch ramp's first step does not split"),
        ("does not divide model.n_kv_heads", "tp does not divide the kv heads"),
        ("does not divide model.n_heads", "tp does not divide the heads"),
        ("does not divide", "tp does not divide a model size"),
        ("global batch", "global batch not divisible by micro_batch x data-parallel ranks"),
        ("layers but", "more pipeline stages than layers"),
        ("cannot run inside pipeline", "ddp/zero1 cannot run inside pipeline stages"),
        ("DTensor", "ddp/zero1 cannot hold tensor-parallel parameters"),
        ("tied embeddings", "tied embeddings cannot be split over stages or tp"),
        ("tensor parallel splits the embedding", "tied embeddings cannot be split over stages or tp"),
        ("micro-batches", "pipeline micro-batch rule of the schedule"),
        ("seq_len", "seq_len does not split over cp"),
    ]
    return next((name for key, name in families if key in problem), problem.split(";")[0][:70])


def search(
    cfg: Config, args: ModelArgs, world: int, profile: DeviceProfile, gpus_per_node: int
) -> tuple[list[Plan], Counter, dict[str, str]]:
    """(plans that fit, fastest first; rejected candidates counted by reason; an example message per reason)."""
    plans, rejected, example = [], Counter(), {}
    have, least = device_bytes(profile, world), float("inf")
    gb = global_batch_sequences(cfg.training, cfg.data.seq_len)
    for p in _layouts(cfg, args, world, gpus_per_node):
        dp = p.dp_replicate * (world // (p.tp * p.cp * p.pp * p.dp_replicate))
        local = gb // dp if gb % dp == 0 else 0
        for micro, policy in itertools.product(_divisors(local, 16) or [1], POLICIES):
            cand = dataclasses.replace(
                cfg,
                parallel=p,
                training=dataclasses.replace(cfg.training, micro_batch=micro),
                memory=dataclasses.replace(cfg.memory, recompute=policy),
            )
            layout = Layout.of(cand, world)
            why, detail = _reject(cand, layout, args, gpus_per_node)
            if why is None:
                plan = estimate(cand, args, layout, profile, gpus_per_node)
                if plan.memory["total"] * (1 + memory_error(profile)) > have:
                    why, least = "does not fit in memory", min(least, plan.memory["total"])
                else:
                    plans.append(plan)
                    continue
            rejected[why] += 1
            example.setdefault(why, detail)
    if least < float("inf"):
        example["does not fit in memory"] = (
            f"the least any of them needs is {least / GiB:.1f} GiB per rank; a rank has {have / GiB:.1f} GiB"
        )
    plans.sort(key=lambda pl: (pl.time["step_time_s"], pl.memory["total"]))
    return plans, rejected, example


def _reject(cfg: Config, layout: Layout, args: ModelArgs, node: int) -> tuple[str | None, str]:
    p = cfg.parallel
    if p.tp > node:
        return "tp spans nodes", f"tp = {p.tp} > {node} devices per node: its collectives need NVLink"
    try:
        problems = layout_problems(cfg, layout, args)
    except (ConfigError, ValueError) as e:
        problems = [str(e)]
    if problems:
        return _reason(problems[0]), problems[0]
    if p.pp > 1:
        # The candidates leave parallel.pp_microbatches 0: one micro-batch per training.micro_batch sequences.
        if layout.microbatches < p.pp and p.pp_schedule != "gpipe":
            return "fewer micro-batches than stages", "the bubble would exceed the compute"
    return None, ""


def pick(cfg: Config, args: ModelArgs, world: int, profile: DeviceProfile, gpus_per_node: int) -> Plan:
    """The fastest plan that fits (parallel.auto); ConfigError with the rejections when none does."""
    plans, rejected, example = search(cfg, args, world, profile, gpus_per_node)
    if not plans:
        gb = global_batch_sequences(cfg.training, cfg.data.seq_len)
        raise ConfigError(no_plan_message(world, rejected, example, cfg.model.preset, gb))
    return plans[0]


def no_plan_message(
    world: int, rejected: Counter, example: dict[str, str], name: str, global_batch: int
) -> str:
    reasons = "; ".join(f"{why} ({n}{': ' + example[why] if example.get(why) else ''})" for why, n in
                        rejected.most_common())  # fmt: skip
    return (
        f"no layout of model '{name}' fits on {world} devices: every candidate was refused — {reasons}. "
        + (_what_to_change(rejected, world, global_batch))
    )


def _what_to_change(rejected: Counter, world: int, global_batch: int) -> str:
    """The change that answers the refusals: a batch that splits over the devices when that refused every
    layout (more devices would not help), else memory."""
    if set(rejected) <= {"global batch not divisible by micro_batch x data-parallel ranks"}:
        fits = -(-global_batch // world) * world
        return (
            f"Use a global batch of {fits} sequences, a multiple of {world} that every data-parallel size divides, "
            f"or a device count that divides {global_batch}"
        )
    return "Use more devices, a shorter seq_len, recompute or a smaller model"


def format_table(plans: list[Plan], rejected: Counter, example: dict[str, str], top: int) -> str:
    """The ranked plans (memory, step time, tokens/s, MFU) and the rejected families with their counts."""
    width = max([62, *(len(pl.describe()) for pl in plans[:top])])
    lines = [f"{'#':>3}  {'layout':<{width}} {'memory GiB':>10} {'step s':>9} {'tokens/s':>11} {'MFU':>6}"]
    for i, pl in enumerate(plans[:top], 1):
        lines.append(
            f"{i:>3}  {pl.describe():<{width}} {pl.memory['total'] / GiB:>10.2f} {pl.time['step_time_s']:>9.4g} "
            f"{pl.time['tokens_per_s']:>11.4g} {100 * pl.time['mfu']:>5.1f}%"
        )
    lines.append(f"{len(plans)} layouts fit; rejected {sum(rejected.values())}:")
    for why, n in rejected.most_common():
        lines.append(f"  {n:>6}  {why}" + (f" ({example[why]})" if example.get(why) else ""))
    return "\n".join(lines)
