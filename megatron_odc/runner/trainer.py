"""The plugin's training loop: a megatron-core GPT with the chosen data-parallel backend.

:func:`train` sets up the process group and megatron's parallel state, then hands the run to a
:class:`Trainer`, whose components are built from the validated flags (``arguments.py``) and do the work:

- ``data`` (``data_pipeline.DataPipeline``): this rank's microbatches of every minibatch;
- ``model`` / ``optimizer`` (``mcore.backends.build_backend``) and ``scheduler``: the GPT under
  ``odc``, ``fsdp``, ``ddp`` or ``distopt``, and Megatron's ``OptimizerParamScheduler``;
- checkpoints (``checkpoint.py``): ``--save`` / ``--load`` / ``--finetune``; Hugging Face models
  (``mcore/hf_bridge.py``): ``--load-hf`` (loaded into the GPT before the backend wraps it) and
  ``--save-hf``;
- the log (``log.py``): Megatron-style lines with ODC's figures, and the same figures in TensorBoard /
  wandb (``tensorboard.py``) on rank 0.

One iteration ([Note: one training iteration] in ``data_pipeline.py``): take this rank's planned
microbatches, run megatron-core's schedule over them (``mcore.step.train_step``; a rank with none only
joins the fence), step the scheduler, log every ``--log-interval`` iterations, save every
``--save-interval``. With ``--pipeline-model-parallel-size`` > 1 the plan is made over DP replicas,
every stage of a replica runs its microbatches under the 1F1B schedule, and the last stage's loss is
sent to the other stages of its pipeline, so every rank logs and checks the same loss ([Note: ODC with
pipeline stages] in ``mcore/pipeline.py``).

[Note: bitwise resume]
A checkpoint's extra state holds the sampler position, the scheduler state, the consumed samples and
the RNG states of every rank (``checkpoint.training_state``). Restored after the model, optimizer and
data are built, the next iteration sees exactly the state the uninterrupted run saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_odc.mcore import hf_bridge, optimizer_setup
from megatron_odc.mcore.backends import build_backend
from megatron_odc.mcore.config import LOCKSTEP_BACKENDS, ODC_ENGINE_BACKENDS, ODCConfig
from megatron_odc.mcore.model import FP8Settings, GPTConfig, build_gpt_model, with_mixed_precision
from megatron_odc.mcore.parallel import DataParallelCoordinates, model_parallel
from megatron_odc.mcore.pipeline import from_last_stage
from megatron_odc.mcore.step import gpt_forward_step, train_step
from megatron_odc.runner import checkpoint, errors, save_lock
from megatron_odc.runner.data_pipeline import DataPipeline
from megatron_odc.runner.health import HealthMonitor, default_store
from megatron_odc.runner.log import LogInterval, setup_logging
from megatron_odc.runner.tensorboard import MetricsWriter

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainResult:
    """What a training run did, as seen by this rank.

    Attributes:
        start_iteration: iteration the run started from (0, or the loaded checkpoint's).
        iteration: iteration reached at the end.
        losses: iteration -> global per-token mean lm loss of that iteration (every rank has them).
        grad_norms: iteration -> global gradient norm before clipping.
        elapsed_s: wall time of the training loop.
        num_tokens: tokens of every sample trained on in this run, all ranks.
        plan_wait_s: iteration -> seconds this rank waited for its plan and packed microbatches
            (they are made one minibatch ahead, so ~0 after the first).
    """

    start_iteration: int
    iteration: int
    losses: dict[int, float]
    grad_norms: dict[int, float]
    elapsed_s: float
    num_tokens: int
    plan_wait_s: dict[int, float] = dataclasses.field(default_factory=dict)
    num_skipped: int = 0
    """Iterations of this run whose optimizer step was skipped (fp16: inf/nan gradients)."""

    @property
    def final_loss(self) -> float | None:
        """Loss of the last iteration trained in this run, or None when none was."""
        return self.losses[max(self.losses)] if self.losses else None


def train(args: argparse.Namespace) -> TrainResult:
    """Run training for validated ``args`` (``arguments.validate_args``).

    Initialises the default process group from torchrun's environment unless one is already up (it is
    then left up) and megatron's parallel state for the run. On a machine without CUDA, megatron-core
    must already run on CPU (``integration/cpu.py``; ``python -m megatron_odc.train`` does it).

    Returns:
        The :class:`TrainResult` of this rank.
    """
    on_cuda = torch.cuda.is_available()
    own_process_group = not dist.is_initialized()
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    try:
        if own_process_group:
            if on_cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if on_cuda else "gloo", timeout=timeout)
        setup_logging(dist.get_rank())
        health = HealthMonitor(
            default_store(), dist.get_rank(), dist.get_world_size(), timeout.total_seconds()
        ).start()
        finished = False
        try:
            # One job per --save directory (save_lock.py): taken before anything is built.
            with (
                save_lock.hold(args.save),
                model_parallel(
                    args.tensor_model_parallel_size,
                    args.pipeline_model_parallel_size,
                    timeout_minutes=args.distributed_timeout_minutes,
                ) as coordinates,
            ):
                device = torch.device("cuda") if on_cuda else torch.device("cpu")
                trainer = Trainer(args, coordinates, device, health)
                try:
                    result = trainer.run()
                finally:
                    trainer.close()
            finished = True
            return result
        except Exception as error:
            health.end_if_launcher_gone()  # a peer ended with its launcher: so does this rank
            errors.settle(error)  # which rank prints a user error (see errors.py)
            if isinstance(error, ValueError):
                raise
            failure = health.failure(error)  # a peer that died or stopped, named
            if failure is error:
                raise
            raise failure from error
        finally:
            health.stop(finished=finished)
    finally:
        if own_process_group and dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    """One training run on this rank; see the module docstring for its components.

    Args:
        args: validated flags.
        coordinates: this rank's DP rank, size and group.
        device: the training device.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        coordinates: DataParallelCoordinates,
        device: torch.device,
        health: HealthMonitor,
    ) -> None:
        self.args = args
        self.device = device
        self.health = health
        self.dp_group = coordinates.dp_group
        logger.info(
            "megatron_odc.train: world %d (DP %d x TP %d x PP %d) on %s | --dp-backend %s | "
            "--balance %s | %d layers, hidden %d, %d heads, seq %d",
            dist.get_world_size(),
            coordinates.dp_size,
            args.tensor_model_parallel_size,
            coordinates.pp_size,
            device.type,
            args.dp_backend,
            args.balance,
            args.num_layers,
            args.hidden_size,
            args.num_attention_heads,
            args.seq_length,
        )
        self.data = DataPipeline(
            args, dp_rank=coordinates.dp_rank, dp_size=coordinates.dp_size, device=device
        )
        gpt = build_gpt_model(
            GPTConfig.from_args(args, vocab_size=self.data.vocab_size),
            seed=args.seed,
            transformer_impl=args.transformer_impl,
            fp8=_fp8_settings(args),
        ).to(device)
        if args.load_hf is not None:
            with self.health.phase("load"):
                hf_bridge.load_hf_weights(gpt, args.load_hf)  # every DP replica: the same weights
        self.model, self.optimizer = build_backend(
            args.dp_backend,
            with_mixed_precision(gpt),
            optimizer_setup.optimizer_config(args, optimizer="adam"),
            odc_config=ODCConfig.from_args(args)
            if args.dp_backend in ODC_ENGINE_BACKENDS
            else None,
        )
        topology = getattr(self.model, "topology", None)  # ODCDataParallel's shard x replica split
        if topology is not None:
            logger.info(
                "ODC: --odc-transport %s | sharded over %d ranks%s",
                self.model.transport_name,
                topology.shard_size,
                f" x {topology.replica_size} replicas (hybrid sharding)" if topology.hybrid else "",
            )
        self.scheduler = optimizer_setup.scheduler(args, self.optimizer)
        # Rank 0 writes the text log, so it writes TensorBoard / wandb: the same numbers.
        self.metrics = MetricsWriter.open(args) if dist.get_rank() == 0 else None

    # ------------------------------------------------------------------ run

    def run(self) -> TrainResult:
        """The iterations from the start (or the loaded checkpoint) to ``--train-iters``."""
        args = self.args
        with self.health.phase("load"):
            start = self._load()
        result = TrainResult(start, start, {}, {}, 0.0, 0)
        interval = LogInterval()
        last_saved = start if args.load is not None and not args.finetune else None
        last_saved_hf = None
        loop_start = time.perf_counter()
        iteration = start
        while iteration < args.train_iters:
            iteration += 1
            with self.health.phase("iteration", iteration):  # the phases below nest in it
                self._iteration(iteration, interval, result)
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                elapsed = time.perf_counter() - loop_start
                eta_s = elapsed / (iteration - start) * (args.train_iters - iteration)
                with self.health.phase("log", iteration):
                    self._log(interval, result, eta_s)
                interval = LogInterval()
            if args.save_interval and iteration % args.save_interval == 0:
                if args.save:
                    self._save(iteration)
                    last_saved = iteration
                if args.save_hf:
                    self._save_hf(iteration)
                    last_saved_hf = iteration
            if args.exit_interval and iteration % args.exit_interval == 0:
                logger.info(
                    "exiting at iteration %d (--exit-interval %d)", iteration, args.exit_interval
                )
                break
        if args.save and last_saved != iteration:
            self._save(iteration)
        if args.save_hf and last_saved_hf != iteration:
            self._save_hf(iteration)
        result.iteration = iteration
        result.elapsed_s = time.perf_counter() - loop_start
        if iteration > start and result.num_skipped == iteration - start:
            raise ValueError(
                f"every optimizer step of this run was skipped (iterations {start + 1}-{iteration}: "
                f"inf/nan gradients at every step, loss scale now {self._loss_scale()}), so the "
                "model did not train. Lower --loss-scale or --initial-loss-scale, check the data "
                "and --lr, or train in --bf16"
            )
        return result

    def _iteration(self, iteration: int, interval: LogInterval, result: TrainResult) -> None:
        """One minibatch: this rank's microbatches, the step, the scheduler."""
        args = self.args
        start = time.perf_counter()
        with self.health.phase("data", iteration):
            minibatch = self.data.next_minibatch()
        assignment, batches = minibatch.assignment, minibatch.batches
        counts = assignment.num_microbatches_per_rank
        if args.dp_backend in LOCKSTEP_BACKENDS and len(set(counts)) != 1:
            raise RuntimeError(
                f"--balance {args.balance} planned unequal microbatch counts {counts}, which "
                f"--dp-backend {args.dp_backend} cannot run"
            )
        self.lr = _current_lr(self.optimizer)
        report = train_step(
            self.model,
            self.optimizer,
            gpt_forward_step,
            batches,
            seq_length=max((b["tokens"].shape[1] for b in batches), default=args.seq_length),
            micro_batch_size=1,
            phase=lambda name: self.health.phase(name, iteration),
        )
        if report["update_successful"]:  # Megatron-LM's rule: a skipped step keeps the schedule
            self.scheduler.step(increment=args.global_batch_size)
        else:
            result.num_skipped += 1
        if report["losses"]:
            pair = torch.stack([r["lm loss"].double() for r in report["losses"]]).sum(dim=0)
        else:
            pair = torch.zeros(2, dtype=torch.float64)
        pair = from_last_stage(pair)  # every stage logs and checks the pipeline's loss
        num_tokens = sum(assignment.plan.lengths.values())
        grad_norm = report["grad_norm"]
        if args.check_for_nan_in_loss_and_grad:
            self._check_finite(iteration, pair, grad_norm)
        interval.add(
            iteration=iteration,
            elapsed_s=time.perf_counter() - start,
            num_tokens=num_tokens,
            microbatch_counts=counts,
            pair=pair,
            grad_norm=None if grad_norm is None else float(grad_norm),
            learning_rate=self.lr,
            update_successful=report["update_successful"],
            plan_wait_s=minibatch.plan_wait_s,
            plan_s=minibatch.plan_s,
        )
        result.num_tokens += num_tokens
        result.plan_wait_s[iteration] = minibatch.plan_wait_s

    def _check_finite(self, iteration: int, pair: torch.Tensor, grad_norm: Any) -> None:
        """``--check-for-nan-in-loss-and-grad``: stops every rank when the iteration's global lm loss or
        grad norm is not finite, or its minibatch has no loss token (collective over DP: every rank
        raises the same error).

        Raises:
            ValueError: naming the iteration and, when a rank's local loss is the culprit, the rank.
        """
        dp_ranks = dist.get_process_group_ranks(self.dp_group)
        slots = torch.zeros(2 * len(dp_ranks), dtype=torch.float64, device=self.device)
        mine = dp_ranks.index(dist.get_rank())
        slots[2 * mine : 2 * mine + 2] = pair.to(self.device)
        dist.all_reduce(slots, group=self.dp_group)
        per_rank = slots.view(-1, 2).cpu()
        loss_sum, num_tokens = per_rank.sum(dim=0).tolist()
        stop = "the run stopped (--check-for-nan-in-loss-and-grad)"
        bad = [
            f"rank {r} ({s} over {n:.0f} loss tokens)"
            for r, (s, n) in zip(dp_ranks, per_rank.tolist(), strict=True)
            if not math.isfinite(s)
        ]
        if bad:
            which = ", ".join(bad)
            raise ValueError(
                f"iteration {iteration}: the lm loss is not finite: the local loss sum of {which}; "
                f"{stop}. Lower --lr, check the data, or pass --no-check-for-nan-in-loss-and-grad "
                "to train on regardless"
            )
        if num_tokens == 0:
            raise ValueError(
                f"iteration {iteration}: its minibatch of {self.args.global_batch_size} samples has "
                f"no loss token on any rank (their responses lie beyond --seq-length "
                f"{self.args.seq_length} or are empty), so the lm loss is undefined; {stop}. Raise "
                "--seq-length or shorten the prompts, or pass --no-check-for-nan-in-loss-and-grad"
            )
        norm = None if grad_norm is None else float(grad_norm)
        if norm is not None and not math.isfinite(norm):
            raise ValueError(
                f"iteration {iteration}: the grad norm is {norm} (lm loss {loss_sum / num_tokens:.6E}); "
                f"{stop}. Lower --lr, or pass --no-check-for-nan-in-loss-and-grad to train on "
                "regardless"
            )

    def _log(self, interval: LogInterval, result: TrainResult, eta_s: float) -> None:
        """Reduce the interval over DP (collective), record it, log its line on rank 0 and hand its
        figures to TensorBoard / wandb (``--tensorboard-dir``, ``--wandb-project``)."""
        pairs = interval.reduce(self.device, self.dp_group)
        log_telemetry = getattr(self.model, "log_telemetry", None)
        telemetry = log_telemetry() if log_telemetry is not None else None  # collective
        figures = interval.figures(
            pairs=pairs,
            global_batch_size=self.args.global_batch_size,
            telemetry=telemetry,
            eta_s=eta_s,
            loss_scale=self._loss_scale(),
        )
        for step in figures.per_iteration:
            result.losses[step.iteration] = step.lm_loss
            if step.grad_norm is not None:
                result.grad_norms[step.iteration] = step.grad_norm
        logger.info(figures.line(self.args.train_iters))
        if self.metrics is not None:
            self.metrics.write(figures)

    # ------------------------------------------------------------------ checkpoints

    def _load(self) -> int:
        """Load ``--load`` when given; returns the iteration to start from."""
        args = self.args
        if args.load is None:
            return 0
        latest = checkpoint.latest_iteration(args.load)
        if latest is None:
            if args.finetune:
                raise ValueError(f"--finetune: no checkpoint found in --load {args.load!r}")
            logger.warning("no checkpoint found in --load %s: training from scratch", args.load)
            return 0
        built_lrs = optimizer_setup.group_lr_bounds(
            self.optimizer
        )  # this run's, before the load replaces them
        iteration, extra = checkpoint.load_checkpoint(
            args.load,
            self.model,
            self.optimizer,
            finetune=args.finetune,
            train_iters=args.train_iters,  # a resume beyond --train-iters is refused
        )
        if args.finetune or checkpoint.is_release(args.load):  # release: weights only, iteration 0
            logger.info(
                "loaded the weights of iteration %d from %s (%s)",
                latest,
                args.load,
                "--finetune" if args.finetune else "a release checkpoint",
            )
            return 0
        if self._check_schedule(extra.get("scheduler"), iteration) == "flags":
            optimizer_setup.set_group_lr_bounds(self.optimizer, built_lrs)
        checkpoint.restore_training_state(extra, self.data.sampler, self.scheduler)
        logger.info(
            "resumed from %s at iteration %d (%d consumed samples)",
            args.load,
            iteration,
            extra.get("consumed_samples", iteration * args.global_batch_size),
        )
        return iteration

    def _check_schedule(self, saved: dict | None, iteration: int) -> str:
        """Megatron-LM's rule for a resumed schedule: flags that change it are refused unless
        ``--override-opt_param-scheduler`` (the flags win) or ``--use-checkpoint-opt_param-scheduler``
        (the checkpoint wins) says which one applies.

        Returns:
            ``"flags"`` when this run's schedule applies and differs from the checkpoint's, else
            ``"checkpoint"``.

        Raises:
            ValueError: naming each setting that differs and both flags.
        """
        args = self.args
        if saved is None:
            return "checkpoint"  # restore_training_state names the missing entry
        differences = optimizer_setup.schedule_differences(self.scheduler, saved)
        if not differences:
            return "checkpoint"
        if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
            winner = "flags" if args.override_opt_param_scheduler else "checkpoint's values"
            logger.info(
                "--load %s: the schedule differs from the checkpoint's (%s); the %s apply from "
                "iteration %d",
                args.load,
                "; ".join(differences),
                winner,
                iteration + 1,
            )
            return "flags" if args.override_opt_param_scheduler else "checkpoint"
        raise ValueError(
            f"--load {args.load}: this run's learning-rate schedule differs from the one saved at "
            f"iteration {iteration}: {'; '.join(differences)}. Add --override-opt_param-scheduler "
            "to continue with this run's flags from there, or --use-checkpoint-opt_param-scheduler "
            "to keep the checkpoint's schedule"
        )

    def _loss_scale(self) -> float | None:
        """The optimizer's loss scale, where there is one (``--fp16``, or ``--loss-scale``)."""
        if not (self.args.fp16 or self.args.loss_scale):
            return None
        return float(self.optimizer.get_loss_scale())

    def _save(self, iteration: int) -> None:
        with self.health.phase("save", iteration):
            self._save_checkpoint(iteration)

    def _save_checkpoint(self, iteration: int) -> None:
        start = time.perf_counter()
        extra = checkpoint.training_state(
            self.data.sampler, self.scheduler, iteration, self.args.global_batch_size
        )
        checkpoint.save_checkpoint(
            self.args.save, iteration, self.model, self.optimizer, extra_state=extra
        )
        logger.info(
            "saved checkpoint at iteration %d to %s (%.2f s)",
            iteration,
            self.args.save,
            time.perf_counter() - start,
        )

    def _save_hf(self, iteration: int) -> None:
        """``--save-hf``: the model as a Hugging Face directory (collective; rank 0 writes)."""
        with self.health.phase("save", iteration):
            start = time.perf_counter()
            hf_bridge.export_hf(self.model, self.args.save_hf, self.args.load_hf)
            logger.info(
                "saved the Hugging Face model at iteration %d to %s (%.2f s)",
                iteration,
                self.args.save_hf,
                time.perf_counter() - start,
            )

    def close(self) -> None:
        """Release the data path's lookahead thread and the backend's resources (the ODC transport's
        memory)."""
        self.data.close()
        if self.metrics is not None:
            self.metrics.close()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()


def _fp8_settings(args: argparse.Namespace) -> FP8Settings | None:
    if args.fp8_format is None:
        return None
    return FP8Settings(args.fp8_format, args.fp8_recipe, args.fp8_param_gather)


def _current_lr(optimizer: Any) -> float:
    groups: Sequence[dict] = optimizer.param_groups
    for group in groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(groups[0]["lr"])
