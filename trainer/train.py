"""The training run: build, parallelize, optimizer, resume, then a loop that fits on one screen.

Every rank runs `train`. One small all-reduce per step carries the loss and whether any rank
was told to stop (SIGTERM), so every rank makes the same decision at the same step: a NaN
on one rank stops all of them, and a preemption saves one checkpoint collectively. It is
started before the step's last backward and read after it (`Shared`), so it costs the step
no round trip of its own.

**The loss of a step** is the sum of the per-token cross-entropies over the step's target
tokens divided by the number of target tokens in the whole step: every micro-batch of
gradient accumulation on every rank (`step_targets`), not a mean per micro-batch averaged
again. Each rank's micro-batch contributes ``sum * world / targets`` (DDP and FSDP average
gradients over the ranks, which divides by ``world`` again). Without loss masks every token
is a target and the count is known (``B * T * accum * world``): the same loss as the mean per
micro-batch, without a collective. With masks (chat and instruction data, trainer.data) the
count is summed over the ranks first, one small all-reduce per step before its first forward.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.checkpoint import (
    CheckpointError,
    DiskFull,
    Progress,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.config import ConfigError, OptimConfig, TrainConfig
from trainer.data import IGNORE_INDEX, BatchSampler, DataError, TokenDataset, check_vocab
from trainer.env import TrainerEnv, write_crash, write_exit_file
from trainer.events import ExitCode, Keys
from trainer.fence import Fence, Superseded
from trainer.lora import apply_lora, init_lora, lora_param_count, targets_for
from trainer.mesh import layout
from trainer.metrics import MetricsLogger, StepWindow, format_line, peak_flops
from trainer.models import build_model, vocab_size
from trainer.moe import MoE, load_metrics
from trainer.parallelize import (
    all_reduce_sum,
    apply_ac,
    apply_compile,
    apply_ddp,
    apply_ep,
    apply_fsdp,
    build_ep_mesh,
    build_mesh,
    clip_grad_norm,
    destroy_distributed,
    init_distributed,
    materialize_fsdp,
    maybe_no_sync,
    sync_expert_grads,
)

__all__ = ["build_optimizer", "lr_at", "train"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Progress lines on stdout: the first logged step, then at most one a second (eval and the
# last step always). Every logged step still goes to metrics.jsonl and Redis; a line per
# step of a fast model would only flood the log that the worker forwards and the store keeps.
PRINT_EVERY_S = 1.0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from lr down to min_lr_ratio * lr."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, cfg.steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matmul weights only (not biases, norms or embeddings).

    The fused implementation (one kernel over every parameter of a device; CPU and CUDA,
    DTensor shards too, GradScaler-aware): on CPU torch's default is the per-parameter loop,
    ~5x slower here (~4 ms a step of the benchmarks' small Llama). Same update to ~1e-7."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():  # the tied head appears once, as the embedding
        if not p.requires_grad:
            continue  # frozen (LoRA's base weights): no optimizer state at all
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


class StopFlag:
    """Set by SIGTERM; the loop checks it (collectively) at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class Shared:
    """The step's one collective: the sum over ranks of the loss (NaN anywhere is NaN
    everywhere) and of the stop votes.

    Started without waiting, after the last forward: it travels on the process group's own
    thread (gloo) or stream (NCCL) while the backward runs, instead of costing a round trip of
    its own after it. Every rank starts it at the same point, before the backward's gradient
    reductions, so the collectives' order is the same everywhere."""

    def __init__(
        self, loss_sum: torch.Tensor, stop_requested: bool, extra: torch.Tensor | None = None
    ) -> None:
        flag = torch.full_like(loss_sum, float(stop_requested))
        parts = [loss_sum[None], flag[None]] + ([] if extra is None else [extra.to(loss_sum)])
        self._tensor = torch.cat(parts)  # extra: an moe model's router statistics
        self._work = (
            dist.all_reduce(self._tensor, op=dist.ReduceOp.SUM, async_op=True)
            if dist.is_initialized()
            else None
        )

    def result(self) -> tuple[float, float, list[float]]:
        """(loss sum, stop votes, extra) summed over all ranks; waits for the collective."""
        if self._work is not None:
            self._work.wait()
        loss_sum, votes, *extra = self._tensor.tolist()
        return loss_sum, votes, extra


def step_targets(
    batches: list[tuple[torch.Tensor, ...]], masked: bool, device: torch.device
) -> float:
    """The target tokens of one optimizer step over all micro-batches and all ranks: summed
    over the ranks (a collective, on ``device``) when the data has loss masks or is packed,
    else every token of every rank's batches (all of one shape)."""
    if not masked:
        local = sum(b[1].numel() for b in batches)
        return float(local * (dist.get_world_size() if dist.is_initialized() else 1))
    count = sum(int((b[1] != IGNORE_INDEX).sum()) for b in batches)
    # int64: exact at any size (fp32 counts only up to 2^24 tokens exactly)
    return float(all_reduce_sum(torch.tensor(count, dtype=torch.int64, device=device)).item())


def token_loss_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, doc: torch.Tensor | None = None
) -> torch.Tensor:
    """The sum of the cross-entropies (fp32) of the targets of ``y`` (IGNORE_INDEX: none);
    ``doc``: packed rows' document ids (trainer.data)."""
    logits = model(x) if doc is None else model(x, doc=doc)
    return F.cross_entropy(
        logits.float().view(-1, logits.shape[-1]), y.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )  # fmt: skip


def check_preflight(cfg: TrainConfig) -> None:
    """What the config cannot rule out (it depends on this host); runs before any process group."""
    if cfg.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("precision: fp16 needs CUDA (GradScaler); use bf16 or fp32 on CPU")


@dataclass
class Position:
    """The step a rank is at (counted from 1), for the record of a crash."""

    step: int | None = None


def train(cfg: TrainConfig, run_dir: Path, data_dir: Path, env: TrainerEnv) -> int:
    """Run to cfg.steps (or until SIGTERM); the process exit code."""
    check_preflight(cfg)
    # Data errors surface here, on every rank alike, before any process group exists.
    # Named as the spec names them (data.path), never by the server's absolute path.
    seq, label = cfg.model.seq_len, cfg.data.path
    pack = cfg.data.packing
    train_data = TokenDataset(data_dir, "train", seq, label, packing=pack)
    val_data = TokenDataset(data_dir, "val", seq, label, packing=pack) if cfg.eval.every else None
    used = [train_data] if val_data is None else [train_data, val_data]
    check_vocab(cfg.data.path, vocab_size(cfg.model), used)
    if cfg.init is not None:  # fine-tuning: the init weights must fit before any process group
        from trainer.hf import check_init

        for note in check_init(cfg, run_dir, None):  # init.path: resolved by __main__
            _say(env, note)
    if cfg.lora is not None:  # targets that match nothing: a spec_error before any group
        _adapted(_on_meta(cfg), cfg)
    layout(cfg, env.world_size, env.nodes)  # fsdp.replicate divides the world, or spec_error
    device = init_distributed(env)
    stop = StopFlag()
    stop.install()
    metrics = MetricsLogger(
        run_dir, env, enabled=env.is_main, tracking=cfg.tracking, params=cfg.model_dump(mode="json")
    )
    at = Position()
    try:
        return _run(cfg, run_dir, env, device, train_data, val_data, stop, metrics, at)
    except torch.OutOfMemoryError as exc:
        message = f"out of memory: {str(exc).splitlines()[0]}"
        print(f"trainer: oom: rank {env.rank}: {message}", file=sys.stderr, flush=True)
        write_exit_file(run_dir, "oom", message, rank=env.rank, step=None, exit_code=ExitCode.OOM)
        return ExitCode.OOM
    except DiskFull as exc:
        print(f"trainer: disk_full: rank {env.rank}: {exc}", file=sys.stderr, flush=True)
        try:  # the room a refused checkpoint would have taken is there; if not, the exit
            write_exit_file(  # code (77) still says disk_full through torchrun's report
                run_dir, "disk_full", str(exc), rank=env.rank, step=at.step,
                exit_code=ExitCode.DISK_FULL,
            )  # fmt: skip
        except OSError:
            pass
        return ExitCode.DISK_FULL
    except Superseded as exc:
        # No exit.json: the run folder belongs to the newer attempt now (trainer.fence).
        print(f"trainer: rank {env.rank}: {exc}", file=sys.stderr, flush=True)
        return ExitCode.SUPERSEDED
    except (ConfigError, CheckpointError, DataError):
        raise  # known failures: trainer.__main__ reports them (spec_error)
    except Exception as exc:
        # Recorded here, before the finally below leaves the process group: the peers fail
        # with connection errors once it is gone, and their record must not come first.
        write_crash(run_dir, exc, rank=env.rank, step=at.step)
        raise
    finally:
        metrics.close()
        stop.restore()
        destroy_distributed()


def _fence(env: TrainerEnv) -> Fence | None:
    """The attempt's fence (trainer.fence) where a worker started the run; rank 0 asks it."""
    if not env.fenced or env.redis_url is None or env.job_id is None:
        return None  # a run by hand (or a test's): no worker raised a fence to check
    client = None
    if env.is_main:
        import redis

        client = redis.Redis.from_url(env.redis_url, socket_timeout=5, socket_connect_timeout=2)
    return Fence(client, Keys(env.redis_prefix).fence(env.job_id), env.attempt)


def _run(
    cfg: TrainConfig,
    run_dir: Path,
    env: TrainerEnv,
    device: torch.device,
    train_data: TokenDataset,
    val_data: TokenDataset | None,
    stop: StopFlag,
    metrics: MetricsLogger,
    at: Position,
) -> int:
    world, B, accum = env.world_size, cfg.batch.micro_batch_size, cfg.batch.grad_accum_steps
    # Weights are drawn from one seed on the CPU (rank 0's for FSDP): one process, DDP and
    # FSDP start identical. FSDP: build on meta, shard, then materialize the shards.
    fsdp = env.distributed and cfg.strategy == "fsdp"
    gpt = _adapted(_on_meta(cfg), cfg) if fsdp else _adapted(_seeded_model(cfg, run_dir), cfg)
    flops_per_token, n_params = gpt.flops_per_token(), gpt.num_params()
    if cfg.lora is not None:
        trainable, total = lora_param_count(gpt)
        _say(env, f"LoRA: {trainable:,} trainable of {total:,} parameters "
                  f"({100 * trainable / total:.2f}%)")  # fmt: skip
    ep = cfg.expert_parallel if env.distributed else 1  # layout(): 1 alone, or a spec_error
    if ep > 1:  # each rank keeps its slice of the experts it drew whole (one process's
        # init), still on the CPU: only the slice reaches the device
        apply_ep(gpt, build_ep_mesh(device, world, ep))
    gpt = gpt if fsdp else gpt.to(device)
    apply_ac(gpt, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(gpt)
    half = _DTYPES.get(cfg.precision)
    model: nn.Module = gpt
    if fsdp:
        # Offloading moves shards from an accelerator to CPU memory; a run on the CPU has
        # them there already (and FSDP2's offload needs an accelerator to copy to).
        offload = cfg.fsdp.cpu_offload and device.type != "cpu"
        if cfg.fsdp.cpu_offload and not offload:
            _say(env, "fsdp.cpu_offload: this run computes on the CPU; nothing to offload")
        model = apply_fsdp(
            gpt,
            param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
            reshard_after_forward=cfg.fsdp.reshard_after_forward,
            cpu_offload=offload,
            mesh=build_mesh(device, layout(cfg, world, env.nodes).mesh),  # 2-D: hsdp
        )
        seeded = _adapted(_seeded_model(cfg, run_dir), cfg) if env.is_main else None
        materialize_fsdp(gpt, device, seeded, cpu_offload=offload)
        del seeded
    elif env.distributed:
        model = apply_ddp(gpt, device)
    torch.manual_seed(cfg.seed)  # every rank's generator in the same state, whoever drew
    strategy = cfg.strategy if env.distributed else "single"
    mesh = layout(cfg, world, env.nodes) if env.distributed else None
    optimizer = build_optimizer(gpt, cfg.optim)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    autocast = (
        torch.autocast(device.type, dtype=half) if half is not None else contextlib.nullcontext()
    )

    progress = Progress(step=0, tokens_seen=0)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        progress = load_checkpoint(
            ckpt, model, optimizer, scaler, strategy=strategy, rank=env.rank, device=device
        )
        _say(env, f"resumed from {ckpt} at step {progress.step}")
    else:
        _say(env, f"{n_params:,} parameters, {strategy} x{world}, {cfg.precision}, {device}")
    if mesh is not None and (mesh.strategy == "hsdp" or mesh.expert > 1):
        _say(env, f"layout: {mesh.describe()}")
    sampler = BatchSampler(train_data, B, accum, env.rank, world, cfg.seed)
    masked = train_data.masks is not None or train_data.packed
    if train_data.packed:
        per_epoch = math.ceil(train_data.num_samples / sampler.samples_per_step)
        _say(env, f"packing: {train_data.examples:,} examples in {train_data.num_samples:,} rows"
                  f" of {cfg.model.seq_len} tokens, efficiency {100 * train_data.efficiency:.1f}%"
                  f" (dropped {train_data.pack_dropped} overlong, truncated"
                  f" {train_data.pack_truncated}); an epoch is {per_epoch} steps")  # fmt: skip
    val_sampler = BatchSampler(val_data, B, 1, env.rank, world, cfg.seed) if val_data else None
    tokens_per_step = B * accum * world * cfg.model.seq_len
    peak = peak_flops(device, cfg.precision)
    window = StepWindow(tokens_per_step, world, flops_per_token, peak, device)
    every = cfg.checkpoint.every
    fence = _fence(env)

    def save(progress: Progress) -> None:
        metrics.flush()  # the metrics up to a checkpointed step are on the wire before it is
        path = save_checkpoint(
            run_dir,
            progress,
            model,
            optimizer,
            scaler,
            strategy=strategy,
            rank=env.rank,
            world_size=world,
            keep=cfg.checkpoint.keep,
            model_config=cfg.model.model_dump(),
            lora=cfg.lora.model_dump() if cfg.lora is not None else None,
            hf=cfg.checkpoint.hf == "every",
            fence=fence,
        )
        if progress.step == cfg.steps:
            metrics.final_checkpoint(path, progress.step)
        if env.is_main:
            metrics.checkpoint(progress.step, path.name)  # checkpoint.written, for webhooks
        if env.is_main and cfg.checkpoint.hf == "every" and not stop.requested:
            from trainer.publish import publish  # step-N/hf/; the other ranks wait for it

            publish(path, train_data.folder)

    # moe: the router's losses join each micro-batch's (a mean over micro-batches here, over
    # the ranks by the gradient average). The experts' load is summed over the ranks before
    # the backward (a small collective per micro-batch), so the load-balancing loss is the
    # whole micro-batch's, as in one process; the statistics travel in the step's collective.
    moe = gpt if isinstance(gpt, MoE) else None
    model.train()
    quiet_until = 0.0  # the next progress line to stdout, not before (metrics go every step)
    for step in range(progress.step, cfg.steps):
        at.step = step + 1  # as in metrics and messages
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        router: torch.Tensor | None = None
        t_data = time.perf_counter()
        batches = [sampler.batch(step, micro) for micro in range(accum)]
        # world / targets: the step's loss is its target tokens' mean (module docstring)
        scale = world / max(1.0, step_targets(batches, masked, device))
        window.data_seconds += time.perf_counter() - t_data
        for micro in range(accum):
            x, y, *doc = (t.to(device, non_blocking=True) for t in batches[micro])
            last = micro == accum - 1
            with maybe_no_sync(model, sync=last):
                with autocast:
                    loss = token_loss_sum(model, x, y, *doc) * scale
                loss_sum += loss.detach()
                if moe is not None:  # the balance over the micro-batch of every rank
                    counts = all_reduce_sum(moe.router_counts())
                    loss = loss + moe.router_loss(counts) / accum
                    stats = moe.router_metrics(counts)
                    router = stats if router is None else router + stats
                if last:  # the step's one collective travels while the last backward runs
                    shared = Shared(loss_sum, stop.requested, router)
                scaler.scale(loss).backward()
        if ep > 1:
            sync_expert_grads(gpt)
        loss_total, stop_votes, router_sums = shared.result()
        loss_value, done = loss_total / world, step + 1
        if not math.isfinite(loss_value):
            return _fail_nan(env, run_dir, done, loss_value)
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        progress = Progress(done, progress.tokens_seen + tokens_per_step)
        window.add(time.perf_counter() - t0)

        stop_now = stop_votes > 0 and done < cfg.steps  # on the last step, just finish
        val_loss = None
        if val_sampler and (done % cfg.eval.every == 0 or done == cfg.steps):
            val_loss = evaluate(model, val_sampler, cfg.eval.steps, device, autocast, world)
        if done % cfg.log_every == 0 or done == cfg.steps or val_loss is not None:
            extra = load_metrics(router_sums, moe.cfg.n_experts, accum * world) if moe else {}
            record = window.record(
                done, cfg.steps, loss=loss_value, lr=lr, grad_norm=grad_norm, val_loss=val_loss,
                **extra,
            )  # fmt: skip
            if val_loss is not None or done == cfg.steps or time.monotonic() >= quiet_until:
                _say(env, format_line(record))
                quiet_until = time.monotonic() + PRINT_EVERY_S
            metrics.log(record)
        if stop_now or done == cfg.steps or (every and done % every == 0):
            save(progress)
        if stop_now:
            return _preempted(env, run_dir, done)
    _say(env, f"done: {progress.step} steps, {progress.tokens_seen:,} tokens")
    return ExitCode.OK


def _adapted(model: Any, cfg: TrainConfig) -> Any:
    """With ``cfg.lora``: the adapters added (B at zero, A drawn from the RNG as it stands
    after the base weights, the same on every rank) and everything else frozen."""
    if cfg.lora is not None:
        try:
            apply_lora(model, cfg.lora, targets_for(cfg.model, cfg.lora))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        init_lora(model)
    return model


def _on_meta(cfg: TrainConfig) -> Any:
    with torch.device("meta"):
        return build_model(cfg.model)


def _seeded_model(cfg: TrainConfig, run_dir: Path) -> Any:
    """The model on the CPU with its weights drawn from ``cfg.seed``; fine-tuning
    (``cfg.init``) then replaces them, unless the run resumes from a checkpoint of its own."""
    torch.manual_seed(cfg.seed)
    model: Any = build_model(cfg.model)
    model.init_weights()
    if cfg.init is not None and latest_checkpoint(run_dir) is None:
        from trainer.hf import load_init

        load_init(model, cfg.init, None, run_dir)  # init.path: resolved by __main__
    return model


@torch.no_grad()
def evaluate(
    model: nn.Module,
    sampler: BatchSampler,
    steps: int,
    device: torch.device,
    autocast: Any,
    world: int,
) -> float:
    """The mean loss per target token over the same ``steps`` val batches each time, all
    ranks together (without loss masks: the mean of the batches' means)."""
    model.eval()
    sums = torch.zeros(2, device=device)  # loss sum, target tokens
    for i in range(steps):
        x, y, *doc = (t.to(device, non_blocking=True) for t in sampler.batch(i, 0))
        with autocast:
            sums[0] += token_loss_sum(model, x, y, *doc)
        sums[1] += (y != IGNORE_INDEX).sum()
    model.train()
    loss, targets = all_reduce_sum(sums).tolist()
    return loss / max(1.0, targets)


def _say(env: TrainerEnv, line: str) -> None:
    if env.is_main:
        print(line, flush=True)


def _fail_nan(env: TrainerEnv, run_dir: Path, step: int, loss: float) -> int:
    """Every rank saw the same non-finite global loss: rank 0 reports, all exit NAN_LOSS."""
    message = (
        f"loss is {loss} at step {step}; the run diverged (lower optim.lr, "
        f"or check optim.weight_decay and optim.grad_clip)"
    )
    if env.is_main:
        print(f"trainer: nan_loss: {message}", file=sys.stderr, flush=True)
        write_exit_file(
            run_dir, "nan_loss", message, rank=env.rank, step=step, exit_code=ExitCode.NAN_LOSS
        )
    return ExitCode.NAN_LOSS


def _preempted(env: TrainerEnv, run_dir: Path, step: int) -> int:
    """SIGTERM reached a rank; all of them saved at this step and now exit 0.

    The line says what the ranks did, not why: a SIGTERM may be a user's cancel, a deadline
    or a preemption, which only its sender knows (under trainq the worker says which). The
    exit.json reason stays ``preempted``: a stop nobody asked the service for is one."""
    message = f"stopped on SIGTERM; checkpoint saved at step {step}"
    _say(env, message)
    if env.is_main:
        write_exit_file(
            run_dir, "preempted", message, rank=env.rank, step=step, exit_code=ExitCode.OK
        )
    return ExitCode.OK
