"""run(config, env): build the pieces, resume, then one training loop that reads like the algorithm.

Each optimizer step: forward and backward over this rank's ``accumulation_steps`` micro-batches
(already read; ``no_sync`` on all but the last), the method's own exchange, clip, step,
schedule. On log steps the ranks reduce the loss and, in the same all-reduce, agree whether to
go on. Between log steps no collective runs but the gradient exchange (DDP's, FSDP's, or the
method's: DeMo every step, DiLoCo and SparseLoCo every --local-steps, AdamW across sites every
step) and no host synchronisation. Evaluate and checkpoint on their cadences.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from torchrun_ddp.build import Trainer, build_trainer, checkpoint_storage, train_timeout_s
from torchrun_ddp.checkpoint import StartFlags, agree_on_start, record_run_id
from torchrun_ddp.config import TrainConfig
from torchrun_ddp.distributed import (
    DistEnv,
    StopRequest,
    init_distributed,
    pick_device,
    seconds_since_process_start,
    set_collective_timeout,
    setup_logging,
    shutdown_distributed,
)
from torchrun_ddp.errors import DataError, UserError
from torchrun_ddp.evaluation import evaluate
from torchrun_ddp.faults import after_update, before_update, hold_point
from torchrun_ddp.inputs import (
    Inputs,
    checkpoint_root,
    prepare_inputs,
    print_plan,
    record_data_error,
)
from torchrun_ddp.methods import method_for
from torchrun_ddp.metrics import (
    any_rank,
    check_loss,
    check_records,
    is_log_step,
    no_step_message,
    progress_bar,
)
from torchrun_ddp.model import autocast_context, causal_lm_inputs, compile_failure
from torchrun_ddp.parallel.modes import gradient_sync_off, mode_for
from torchrun_ddp.resume import rebuild_problem, record_start, resume, resumed_config
from torchrun_ddp.sites import join_sites, leave_sites
from torchrun_ddp.training_data import bad_record_count
from torchrun_ddp.training_state import save, save_final_model

log = logging.getLogger("torchrun_ddp")


def run(config: TrainConfig, env: DistEnv) -> bool:
    """Train as one rank of a torchrun job (or alone), always tearing the process group down.

    Returns True when training finished (or for --dry-run) and False when SIGTERM/SIGINT stopped
    it after a checkpoint (train.py then exits with status 143).
    """
    setup_logging(env.rank, config.verbose)
    if config.dry_run:
        print_plan(config, env)  # a real start's input checks, then the plan
        return True
    inputs = prepare_inputs(config, env)
    device = pick_device(env, config.device)
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    attempt = init_distributed(env, device, config.backend, config.timeout_s)
    try:
        trainer = start(config, env, device, inputs, attempt)
        finished = train(trainer)
        if finished and config.save_at_end:
            save_final_model(trainer)
        trainer.metrics.close()
        leave_sites(trainer)
        return finished
    except DataError as exc:
        if env.is_main:
            record_data_error(config, exc)
        raise
    except torch._dynamo.exc.TorchDynamoException as exc:  # --compile: no silent eager fallback
        raise compile_failure(exc) from exc
    finally:
        shutdown_distributed()


def start(
    config: TrainConfig, env: DistEnv, device: torch.device, inputs: Inputs, attempt: int = 1
) -> Trainer:
    """Collective: find the storage domains of --checkpoint-dir, agree on what to resume
    (``checkpoint.agree_on_start``: one path for a shared folder and a folder per node), build
    this rank's trainer and resume it; rank 0 then trims ``metrics.jsonl`` to the resumed step
    and saves the resolved config (with the armed test hooks, if any, as a comment: see
    faults.py). ``attempt`` > 1 (or a torchrun restart count above 0) marks a
    restart of this job, which resumes its own checkpoints even under --no-resume.

    Raises UserError (every rank) for views of --checkpoint-dir that do not form storage
    domains, and for a start that is refused (see ``checkpoint.agree_on_start``)."""
    restarted = attempt > 1 or env.restart_count > 0
    mode = inputs.mode or mode_for(config, env.world_size, env.local_world_size)
    method = inputs.method or method_for(config)
    root, storage = checkpoint_root(config), checkpoint_storage(config, env, mode)
    metrics = Path(config.output_dir) / "metrics.jsonl"
    flags = StartFlags(
        config.resume, config.resume_from, config.overwrite_output_dir, restarted,
        config.verify_checkpoints,
    )  # fmt: skip
    rebuild = partial(rebuild_problem, method)
    plan = agree_on_start(root, storage, flags, rebuild, partial(check_records, metrics))
    trained = resumed_config(config, env, plan)  # the resumed shape, before anything is built
    if inputs.test_hooks:
        log.warning("test hooks armed by the test harness: %s", inputs.test_hooks)
    trainer = build_trainer(trained, env, device, inputs, plan.run_id, storage, mode, method)
    resume(trainer, plan)
    log.info(
        "attempt %d: ready to train from step %d, %.1f s after the process started",
        attempt, trainer.step, seconds_since_process_start(),
    )  # fmt: skip
    if env.rank == storage.leader:  # every start check has passed: the folder is this run's
        record_run_id(root, plan.run_id)
    if env.is_main:
        record_start(trainer, config, plan, inputs.test_hooks)
    return trainer


def train(trainer: Trainer) -> bool:
    """The training loop. Returns True when training finished (step limit or end of data) and
    False when it was stopped by SIGTERM/SIGINT, after saving a checkpoint."""
    config = trainer.config
    max_steps = config.max_steps if config.max_steps > 0 else math.inf
    hold_point(0)  # tests only (faults.py): hold:0, before the first step and the sites' join
    join_sites(trainer)  # --fault-tolerance sites: a site behind the live ones heals here
    first_step = trainer.step + 1
    with StopRequest() as stop:
        data_ends, stopping = check_in(trainer, max_steps, stop.requested)
        if data_ends and trainer.step == 0:
            raise UserError(
                no_step_message(config.log_every, max_steps, trainer.window.tokens_per_step)
            )
        if trainer.step == 0 and config.eval_every:
            trainer.metrics.log({"step": 0, **evaluate(trainer)})  # the untrained baseline
        trainer.model.train()
        progress = progress_bar(trainer.step, max_steps, trainer.env.is_main)
        while trainer.step < max_steps and not data_ends:
            started = time.perf_counter()
            loss, grad_norm = optimizer_step(trainer, trainer.data.next_step())
            trainer.step += 1
            if trainer.step == first_step:  # start-up is over: notice a lost rank sooner
                set_collective_timeout(train_timeout_s(config))
                log.info(
                    "step %d done %.1f s after the process started",
                    trainer.step, seconds_since_process_start(),
                )  # fmt: skip
            trainer.tokens_seen += trainer.window.tokens_per_step
            step_time = time.perf_counter() - started
            trainer.window.add(loss, grad_norm, step_time, trainer.compression.pop_step_bytes())
            progress.update()
            if is_log_step(trainer.step, config.log_every, max_steps):
                data_ends, stopping = check_in(trainer, max_steps, stop.requested, progress)
            if trainer.step >= max_steps or data_ends:
                flush_exchange(trainer)
            if stopping:
                save(trainer)
                log.warning("stopped by a signal: checkpoint saved at step %d", trainer.step)
                return False
            after_step(trainer)
    if data_ends:
        log.info("end of training data after %d steps", trainer.step)
    progress.close()
    finish(trainer)
    return True


def check_in(
    trainer: Trainer, max_steps: float, stop_requested: bool, progress: tqdm | None = None
) -> tuple[bool, bool]:
    """Collective, before the first step and on log steps: read this rank's micro-batches up to
    the next log step, then agree over all ranks (one all-reduce, riding on the loss reduction
    of the log step) whether any rank's data ends before it and whether any rank was asked to
    stop. Logs the window's record. Returns (data ends, stop), the same on every rank."""
    step, log_every = trainer.step, trainer.config.log_every
    ahead = min(log_every - step % log_every, max_steps - step)
    has_data = trainer.data.read_ahead(int(ahead))
    flags = [not has_data, stop_requested]
    trainer.window.add_data_time(trainer.data.pop_data_time())
    tokens = trainer.data.local_tokens(int(ahead))  # summed over ranks in the same all-reduce
    if trainer.window.steps == 0:  # before the first step: nothing to log yet
        data_ends, stopping = any_rank(flags, trainer.device, tokens)
        trainer.data.set_global_tokens(tokens)
        return data_ends, stopping
    lr = float(trainer.scheduler.get_last_lr()[0])
    record, (data_ends, stopping) = trainer.window.flush(step, lr, flags, tokens)
    trainer.data.set_global_tokens(tokens)
    check_loss(float(record["loss"]), step, trainer.config.max_loss)
    if skipped := bad_record_count(trainer.data.trained_position):
        record["bad_records"] = skipped
    trainer.metrics.log(record)
    if progress is not None:
        progress.set_postfix(loss=round(record["loss"], 3), tok_s=int(record["tokens_per_s"]))
    return data_ends, stopping


def forward_backward(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    precision: str = "fp32",
    step_tokens: torch.Tensor | None = None,
    no_sync: Callable[[torch.nn.Module], AbstractContextManager[None]] = gradient_sync_off,
) -> torch.Tensor:
    """Accumulate gradients over the micro-batches (int64 [B, L] token ids, or [B, 3, L] ids,
    labels, positions: ``model.causal_lm_inputs``); returns the step's loss (detached).

    Without ``step_tokens`` each micro-batch's mean loss is divided by their number, so the
    accumulated gradient equals one large batch's where every window trains the same number of
    tokens (text packed back to back). With ``step_tokens`` (0-d, the step's trained tokens over
    all ranks and micro-batches) each micro-batch's summed token loss is divided by
    ``step_tokens / world_size``: after the mean over ranks (DDP's all-reduce, FSDP's
    reduce-scatter) the gradient is that of the mean over every trained token of the step, as
    one large batch gives; the returned value averaged over ranks is that mean. Gradients are
    all-reduced (DDP) or reduce-scattered (FSDP) only on the last micro-batch; ``no_sync`` (the
    mode's ``DataParallel.no_sync``; by default whichever ``model`` is) skips it on the others.
    The forward runs under ``autocast_context(precision)``, backward outside it (torch's AMP).
    """
    total = torch.zeros((), device=batches[0].device)
    divisor = None
    if step_tokens is not None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        divisor = step_tokens.clamp(min=1) / world_size
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        with nullcontext() if last else no_sync(model):
            with autocast_context(precision, batch.device):
                if divisor is None:
                    loss = model(**causal_lm_inputs(batch)).loss / len(batches)
                else:
                    loss = model(**causal_lm_inputs(batch), num_items_in_batch=divisor).loss
            loss.backward()
        total += loss.detach()
    return total


def optimizer_step(trainer: Trainer, batches: list[torch.Tensor]) -> tuple[Tensor, Tensor]:
    """One optimizer step over ``batches``: returns (mean loss, gradient norm before clipping)."""
    precision = trainer.config.precision
    trainer.method.before_forward()  # across sites: AdamW's quorum overlaps forward and backward
    loss = forward_backward(
        trainer.model, batches, precision, trainer.data.step_tokens, trainer.parallel.no_sync
    )
    trainer.method.after_backward()  # hsdp with a comm hook: the shards across replicas
    loss = before_update(trainer.step + 1, trainer.model, loss)  # tests only (faults.py)
    grad_norm = trainer.parallel.clip_grad_norm(trainer.model, trainer.config.max_grad_norm)
    trainer.optimizer.step()
    after_update(trainer.step + 1, trainer.model)  # tests only (faults.py)
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def flush_exchange(trainer: Trainer) -> None:
    """At the end of training (collective): apply the update in flight (--overlap-exchange), so
    the last step is evaluated, checkpointed and exported with it."""
    if trainer.method.flush():
        log.info("applied the last update in flight (step %d)", trainer.step)


def after_step(trainer: Trainer) -> None:
    """Evaluate and checkpoint on their cadences."""
    config, step = trainer.config, trainer.step
    if config.eval_every and step % config.eval_every == 0:
        trainer.metrics.log({"step": step, **evaluate(trainer)})
    if config.checkpoint_every and step % config.checkpoint_every == 0:
        save(trainer)


def finish(trainer: Trainer) -> None:
    """The last evaluation and checkpoint, unless the last step already made them."""
    config, step = trainer.config, trainer.step
    flush_exchange(trainer)  # a resumed update in flight when the loop never ran
    if warning := trainer.method.end_warning():
        log.warning("%s", warning)
    if config.eval_every == 0 or step % config.eval_every != 0:
        trainer.metrics.log({"step": step, **evaluate(trainer)})
    if not config.save_at_end:
        return
    if config.checkpoint_every == 0 or step % config.checkpoint_every != 0:
        save(trainer)
