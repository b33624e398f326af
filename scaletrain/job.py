"""What a training job is made of and how it is put together: `build` sets up the processes, the mesh, the data, the
parallelised model and every mechanism the loop calls, and returns them as a `Job`; `build_core` is the part every
run and the tests that train a layout share (the model parallelised, its optimizers, the step runner)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from scaletrain import metrics
from scaletrain.checkpoint import CheckpointManager, LoaderState, ModelState, TrainState, build_checkpointing
from scaletrain.checkpoint.hf.in_training import FinalExport
from scaletrain.checkpoint.hf.sharded import load_hf_sharded
from scaletrain.config import Config, MemoryConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from scaletrain.config.io import to_dict
from scaletrain.data import build_loader, load_tokenizer, resolve_cache_dir
from scaletrain.data.ramp import BatchRamp
from scaletrain.data.streaming import SourceDry
from scaletrain.metrics import MetricsWriter, MoEMonitor, StepMeter
from scaletrain.models import Transformer, build_meta_model, count_parameters, resolve_model_args
from scaletrain.optim.optimizers import Optimizers
from scaletrain.parallel import DistEnv, ParallelDims, init_distributed
from scaletrain.parallel.layout import Layout, updates_each_replica
from scaletrain.parallel.mesh import all_reduce_mean, broadcast_object, main_first, setup_process
from scaletrain.parallel.parallelize import ParallelModel, parallelize
from scaletrain.parallel.step import Evaluation, StepRunner, build_step_runner
from scaletrain.precision import Precision, resolve_precision
from scaletrain.resilience import fault_tolerance
from scaletrain.resilience.fault_tolerance import NoReplicaGroup, ReplicaGroup
from scaletrain.resilience.faults import FaultInjector
from scaletrain.resilience.guard import Guard
from scaletrain.resilience.membership import RankLease, host_of_each_rank, node_of_each_rank, restart_count
from scaletrain.resilience.preemption import Preemption
from scaletrain.resilience.timelimit import JobLimits
from scaletrain.run.directory import RunDir, open_run_dir

log = logging.getLogger("scaletrain")


@dataclass
class Job:
    """What `build` made: the pieces the loop calls, each owning its own mechanism."""

    cfg: Config
    env: DistEnv
    dims: ParallelDims
    run: RunDir
    writer: MetricsWriter
    loader: object
    runner: StepRunner
    optimizers: Optimizers
    train_state: TrainState
    ckpt: CheckpointManager
    guard: Guard
    preemption: Preemption
    limits: JobLimits
    meter: StepMeter
    batches: BatchRamp  # the global batch of each step: training.global_batch, or the batch ramp's
    info: dict  # what the start event says of the setup
    moe: MoEMonitor  # MoE: expert load, moe_* metrics (inert for a dense model); the bias update is in optimizers
    # fault_tolerance: this rank's replica group (resilience/fault_tolerance); NoReplicaGroup without
    ft: ReplicaGroup | NoReplicaGroup
    lease: RankLease  # this process's hold on its rank in the run directory
    eval: Evaluation  # training.eval_interval: validation with the step's forward, each result kept by step
    # checkpoint.last_save_in_hf: the final weights also as a Hugging Face directory; None when off
    final_export: FinalExport | None

    def tokens(self, step: int) -> int:
        """Tokens trained by steps 1..step."""
        return self.batches.consumed(step) * self.cfg.data.seq_len

    def resume(self) -> int:
        """Load the newest complete copy across both tiers (if any) and say where the run starts; a fresh start with
        training.eval_interval evaluates the initial weights (step 0)."""
        self.ckpt.load_latest()
        start, restart = self.train_state.step, restart_count()
        self.ft.begin(start)
        self.writer.event("start", step=start, resumed=start > 0, restart=restart, **self.info)
        # The first window begins where goodput's segment does, at `start`: the set-up and the load before it are
        # restart time, and counting them as step time too put goodput above 1 on short runs.
        self.meter.reset()
        if self.cfg.training.eval_interval and start == 0:
            self.eval(0)
        return start

    def next_batch(self, step: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The global batch of `step` (this rank's share); None when data.when_dry = "stop" ends the job before it:
        a source was read to its end by this batch, on every rank at the same sample (each walks the whole global
        batch), and the loader's position is left after step - 1, which the final save then holds."""
        try:
            return self.loader.next_batch(sequences)
        except SourceDry as e:
            self.limits.source_dry(step - 1, e.name, self.cfg.data.sources[e.index].path, e.epoch)
            return None

    def step_done(self, step: int, sequences: int) -> None:
        """Step `step` of `sequences` sequences counts: in the train state (what a checkpoint saves), in throughput."""
        self.train_state.step, self.train_state.tokens = step, self.tokens(step)
        self.meter.step_done(sequences * self.cfg.data.seq_len)

    def stopping(self, step: int) -> bool:
        """SIGTERM, Ctrl-C or run.time_limit ends the job after this step (each agreed by every rank; a stop by every
        replica group of the step, under fault_tolerance)."""
        return (self.preemption.stopping(step, self.writer.event, self.ckpt.final_save_note(), self.ft.stop_agreed())
                or self.limits.time_up(step, self.ckpt.save_seconds))  # fmt: skip

    def close(self, step: int) -> str | None:
        """The final save (protected by the memory tier), then fault_tolerance's parameter digest and leaving the
        quorum. Returns why the job ended early, to be continued: time_limit, stop_at_step (exit 75), Ctrl-C (130).
        A job ended by data.when_dry = "stop" is finished at its step: nothing is left to continue with."""
        stopped = self.limits.stopped(step) or self.preemption.stop_reason()
        finished = step == self.cfg.training.steps or (self.limits.dry is not None and not stopped)
        self.ckpt.close(step, finished=finished)
        if finished and self.final_export is not None:
            self.final_export(step)  # checkpoint.last_save_in_hf
        self.ft.close()
        return stopped

    def interrupted(self, step: int) -> None:
        """Ctrl-C: recorded, and the writer closed (the KeyboardInterrupt goes on to the launcher: exit 130)."""
        self.writer.event("interrupted", step=step)
        self.writer.close()

    def release(self) -> None:
        """However the loop ended: the guard's watchdog stops and the signals get their previous actions back."""
        self.guard.close()
        self.preemption.close()
        self.lease.close()


def build_core(
    model: Transformer,
    dims: ParallelDims,
    parallel: ParallelConfig,
    training: TrainingConfig,
    optimizer: OptimizerConfig,
    *,
    device: torch.device,
    n_microbatches: int,
    memory: MemoryConfig | None = None,
    precision: Precision | None = None,
    eod: int | None = None,
    routing_bias_rate: float = 0.0,
    init_seed: int | None = None,
    ramp: BatchRamp | None = None,
) -> tuple[ParallelModel, Optimizers, StepRunner]:
    """The model (consumed) parallelised, its optimizers and the step runner, as every run assembles them: build
    and the tests that train a layout call this, so that what they check is what runs. `precision` None: fp32.
    `init_seed`: `model` is on meta and each rank materialises only its share (parallelize); None: materialised.
    `ramp`: training.batch_ramp's batches, which the LR schedule then counts in tokens; None: no ramp."""
    args = model.args
    pm = parallelize(model, dims, parallel, device=device, n_microbatches=n_microbatches, memory=memory,
                     compile=training.compile, precision=precision, init_seed=init_seed)  # fmt: skip
    optimizers = Optimizers.for_model(pm.parts, args, optimizer, parallel.data_parallel, dims, device,
                                      training.steps, routing_bias_rate, ramp)  # fmt: skip
    runner = build_step_runner(pm, dims, parallel, training, device, eod, precision)
    return pm, optimizers, runner


def build(cfg: Config) -> Job:
    """Set up the job. The order matters where noted; each part gets only its own config section."""
    # -- Processes and the mesh: the device mesh for the model's tensors, one CPU group for control.
    env = init_distributed(cfg.training.device)
    setup_process(env, cfg.training.threads, cfg.training.deterministic)
    layout = Layout.of(cfg, env.world_size)  # the mesh sizes and the batch arithmetic, resolved once
    dims = layout.dims()
    dims.build_mesh(env.device.type)
    first = partial(main_first, env.is_main, dims.control)  # rank 0 first, then the others
    run, run_id = open_run_dir(to_dict(cfg), env.is_main, partial(broadcast_object, group=dims.control))
    rank = fault_tolerance.global_rank(env.rank, env.world_size)  # over all replica groups
    lease = RankLease(run.path, rank)  # one live process a rank
    writer = MetricsWriter(run.path, env.is_main, cfg.metrics.tensorboard, cfg.metrics.wandb_project)

    # -- Data: rank 0 tokenises (or finds the cache) first, then the others. The ranks of one data-parallel group
    # (tp, cp, pp peers) read one slice of the global batch; streamed, only the shards under it (data/counts.py).
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    batches = BatchRamp.of(cfg.training.batch_ramp, layout.global_batch)  # each step's batch (checked)
    dp = fault_tolerance.data_slice(dims.dp_rank, layout.dp_size, cfg.fault_tolerance)  # (rank, size)
    loader = first(lambda: build_loader(cfg.data, tokenizer, layout.global_batch, *dp, cfg.training.seed, log.info,
                                        batches.consumed(cfg.training.steps) * cfg.data.seq_len, dims.control))  # fmt: skip

    # -- Model: built on meta and parallelised there; each rank then materialises only its share, with the
    # single-process values for the seed (parallel/materialize.py). An HF import then overwrites each rank's share
    # with the rows it holds, read from the safetensors files (checkpoint/hf/sharded.py): no rank loads the whole.
    args = resolve_model_args(cfg.model, tokenizer.vocab_size, cfg.data.seq_len, moe=cfg.moe)
    model = build_meta_model(args)
    n_params = count_parameters(model)
    precision = resolve_precision(cfg.precision, layout.fsdp, env.device)
    eod = tokenizer.eod_id if cfg.data.document_mask else None  # masks attention at document ends
    pm, optimizers, runner = build_core(model, dims, cfg.parallel, cfg.training, cfg.optimizer, device=env.device,
                                        n_microbatches=layout.microbatches, memory=cfg.memory, precision=precision,
                                        eod=eod, routing_bias_rate=cfg.moe.bias_update_rate,
                                        init_seed=cfg.training.seed, ramp=batches)  # fmt: skip
    del model
    if cfg.model.init_from.startswith("hf:"):
        load_hf_sharded(pm.parts, Path(cfg.model.init_from[3:]), args)

    # -- What resumes: one dict of Stateful objects, saved and restored by the checkpoint tiers and rollbacks.
    train_state = TrainState(dims.control, env.device)  # on CUDA the device RNG is saved too
    moe = MoEMonitor.for_model(pm.parts, args.n_layers, args.n_experts, cfg.moe, dims, writer.event)
    # Besides the model, optimizer, data position and step: the runner's (fp16: the loss scaler), MoE's imbalance
    # streaks, and comm (PowerSGD's error feedback and Q factors with parallel.grad_compression; else empty).
    state = dict(model=ModelState(pm.parts), optimizer=optimizers, data=LoaderState(loader), train=train_state,
                 **runner.resumable(), **moe.resumable(), comm=pm.comm)  # fmt: skip
    described = dims.describe(cfg.parallel)
    nodes = node_of_each_rank(dims.control)  # address and ranks of each node: start event, replicas
    ckpt = build_checkpointing(fault_tolerance.group_checkpoint(cfg.checkpoint), run, run_id, state, env,
                               dims.control, described, writer.event, start_over=cfg.run.start_over,
                               hosts=host_of_each_rank(nodes))  # fmt: skip

    # -- Resilience: faults attach where each failure happens (loader, output layer, storage writer, commit).
    faults, loader = FaultInjector.for_job(cfg.resilience.inject, rank, run.path, writer.event if env.is_main else None,
                                           loader, pm.parts, ckpt, args.vocab_size)  # fmt: skip
    # the loss averaged over the data-parallel ranks for spikes
    guard = Guard(cfg.resilience, run.path, env, dims.control, writer.event,
                  partial(all_reduce_mean, mesh=dims.submesh("dp_cp")), faults, parts=pm.parts,
                  updates_each_replica=updates_each_replica(cfg.parallel.data_parallel), nodes=nodes)  # fmt: skip
    runner.clock = guard.clock  # the step brackets its compute for straggler detection (CUDA events on a GPU)

    # -- Metrics: the MFU peak is measured once per machine (rank 0 first, then cached).
    meter, peak_source = StepMeter.for_job(cfg.metrics, precision, args, n_params["active"], cfg.data.seq_len,
                                           layout.tokens_per_step, env.world_size, env.device, cfg.training.compile,
                                           resolve_cache_dir(cfg.data), writer.event, first)  # fmt: skip
    metrics.announce(cfg, env, n_params, described, layout.global_batch, layout.tokens_per_step, peak_source,
                     precision)  # fmt: skip
    evaluation = Evaluation(runner, loader, cfg.training, dims, env.device, writer.event, meter.exclude)
    parts = (cfg, env, dims, run, writer, loader, runner, optimizers, train_state, ckpt, guard)
    limits = JobLimits(cfg.run, cfg.training.steps, dims.control, writer.event)
    # fault_tolerance: what a healing group receives from a peer (the loader as saved, without the fault hooks)
    held = dict(parts=pm.parts, optimizers=optimizers, loader=state["data"].loader, train=train_state)
    preemption = Preemption(dims.control)  # fault_tolerance: every replica group stops after the same step
    ft = fault_tolerance.replica_group(cfg.fault_tolerance, env, held, writer.event, cfg.training.steps,
                                       preemption.requested, meter.reset)  # fmt: skip
    info = dict(world_size=env.world_size, precision=cfg.precision.compute, device=env.device.type, layout=described,
                parameters=n_params["total"], peak_flops_source=peak_source, nodes=nodes,
                **batches.announce(cfg.training.batch_ramp), **ft.describe())  # fmt: skip
    final_export = FinalExport.for_job(cfg.checkpoint, cfg.data.tokenizer, tokenizer, pm.parts, args, run.path,
                                       env.is_main and cfg.fault_tolerance.group <= 0, dims.control, writer.event)  # fmt: skip
    return Job(*parts, preemption, limits, meter, batches, info, moe, ft, lease, evaluation, final_export)
