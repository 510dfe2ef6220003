"""DeepSpeed's engine behind ``--deepspeed`` (its configuration is ``config.py``'s).

- **Engine**: ``setup_engine`` builds the model, our optimizer and LR schedule (or DeepSpeed's
  when the JSON names them) and calls ``deepspeed.initialize`` with our parallel state as its
  ``mpu``, so ZeRO shards over the data-parallel group and tensor parallelism stays ours.
  Without ``--no-pipeline-parallel`` the model is GPT's layers as a DeepSpeed
  ``PipelineModule`` (tied LM head, a topology matching our groups), run with
  ``train_batch``/``eval_batch``.
- **Recompute and checkpoints**: DeepSpeed's activation checkpointing configured with our RNG
  tracker; ``engine.save_checkpoint``/``load_checkpoint`` with the iteration, consumed samples,
  our LR schedule and every data-parallel rank's RNG states as client state; our manifest
  (megatron/checkpointing/manifest.py) written into the folder before the `latest` tag, and
  checked on load.
- **Conversion helpers** for megatron/checkpointing/formats/deepspeed/engine_folders.py: ZeRO-3's weights
  gathered with DeepSpeed's ``zero_to_fp32``, and ZeRO's optimizer files unpickled.

The training loop (megatron/training/) is the same as without DeepSpeed: its
``DeepSpeedEngine`` calls the ``DeepSpeedRun`` below where ours runs its own schedule, step
and checkpoint code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.async_save import raise_save_failure
from megatron.checkpointing.errors import CheckpointError
from megatron.checkpointing.files import write_torch
from megatron.checkpointing.folder import (
    DEEPSPEED,
    CheckpointFolder,
    folder_digests,
    latest_checkpoint,
    make_tmp_folder,
    publish_checkpoint,
)
from megatron.checkpointing.formats.deepspeed.universal import (
    UNIVERSAL_CHECKPOINT_INFO,
    load_into_deepspeed,
    universal_checkpoint_info,
)
from megatron.checkpointing.formats.deepspeed.universal_folder import find_universal
from megatron.checkpointing.manifest import build_manifest
from megatron.checkpointing.paths import MANIFEST_FILENAME
from megatron.checkpointing.ranks import all_true, broadcast_from_rank0
from megatron.checkpointing.retention import remove_leftover_folders
from megatron.checkpointing.rng import capture_rng_state, restore_rng_state
from megatron.config import RunConfig
from megatron.core import parallel_state
from megatron.core.nonfinite import grads_are_finite, locate_nonfinite_loss, ranks_where
from megatron.core.optimizer import build_torch_optimizer, get_param_groups
from megatron.core.optimizer_param_scheduler import build_optimizer_param_scheduler
from megatron.core.pipeline_parallel.schedules import StageInfo, takes_stage
from megatron.core.tensor_parallel.random import get_rng_tracker, set_checkpoint_implementation
from megatron.integrations.deepspeed.moe import (
    add_moe_loss,
    check_expert_groups,
    deepspeed_moe_layers,
    use_deepspeed_moe,
)
from megatron.model.gpt_batch import gpt_batch
from megatron.model.gpt_model_pipe import (
    EmbeddingPipe,
    FinalLayerNormPipe,
    LMHeadPipe,
    TransformerLayerPipe,
    lm_logits,
    lm_loss,
)
from megatron.platform.launch_env import distributed_env
from megatron.platform.output import print_rank_0

# Our parallel state as DeepSpeed's mpu --------------------------------------------------


class ParallelStateMPU:
    """The methods DeepSpeed calls on ``mpu``, answered from megatron.core.parallel_state.

    Used by the plain engine (pipeline size 1), where DeepSpeed's "model parallel" group
    (gradient-norm reduction, checkpoint file names) is our tensor-parallel group.
    """

    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group_ranks = staticmethod(parallel_state.get_data_parallel_group_ranks)
    get_tensor_model_parallel_group = staticmethod(
        parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(
        parallel_state.get_tensor_model_parallel_src_rank)
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_pipeline_model_parallel_group = staticmethod(
        parallel_state.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(
        parallel_state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(
        parallel_state.get_pipeline_model_parallel_world_size)
    # DeepSpeed-Ulysses' names for our context-parallel group, and for the data x context
    # group over which ZeRO shards and reduces (DeepSpeed divides the sum by the data-parallel
    # size alone, so each context rank's loss must be its share: _deepspeed_loss).
    get_sequence_parallel_group = staticmethod(parallel_state.get_context_parallel_group)
    get_sequence_parallel_rank = staticmethod(parallel_state.get_context_parallel_rank)
    get_sequence_parallel_world_size = staticmethod(
        parallel_state.get_context_parallel_world_size)

    @staticmethod
    def get_sequence_data_parallel_group():
        return parallel_state.get_data_parallel_group(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_rank():
        return parallel_state.get_data_parallel_rank(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_world_size():
        return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _deepspeed_loss(loss):
    """The loss DeepSpeed's engine differentiates: ours (gpt_batch.masked_mean_loss, which
    is the context group's size times this rank's share, for an average over data x context
    ranks) divided by that size, as DeepSpeed sums over the sequence-parallel ranks."""
    return loss / parallel_state.get_context_parallel_world_size()


# Activation checkpointing -----------------------------------------------------------------


def configure_activation_checkpointing(cfg: RunConfig) -> None:
    """Recompute through DeepSpeed's checkpointing (with --deepspeed-activation-
    checkpointing), drawing dropout from our RNG tracker; else the built-in recompute."""
    d = cfg.deepspeed
    if not d.deepspeed_activation_checkpointing:
        set_checkpoint_implementation(None)
        return
    # optional: deepspeed, imported only under --deepspeed
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    deepspeed.checkpointing.configure(
        ParallelStateMPU(), partition_activations=d.partition_activations,
        contiguous_checkpointing=d.contigious_checkpointing,
        num_checkpoints=cfg.model.num_layers, checkpoint_in_cpu=d.checkpoint_in_cpu,
        synchronize=d.synchronize_each_layer, profile=False)
    # DeepSpeed saves and restores its module's tracker around a recompute; ours is the one
    # dropout in tensor-parallel regions draws from (get_states/set_states alike).
    ds_checkpointing._CUDA_RNG_STATE_TRACKER = get_rng_tracker()
    set_checkpoint_implementation(deepspeed.checkpointing.checkpoint)


# Models ---------------------------------------------------------------------------------


def build_pipeline_module(cfg: RunConfig, device: torch.device):
    """GPT as DeepSpeed's PipelineModule: embedding, layers, final norm, LM head (tied to the
    embedding, or its own layer with --untie-embeddings-and-output-weights); stages over a
    topology laid out as our groups (tensor fastest, then data, then pipeline), layers split
    evenly."""
    # optional: deepspeed, imported only under --deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    m, p = cfg.model, cfg.parallel
    tied = dict(tied_weight_attr="word_embeddings.weight")
    untied = m.untie_embeddings_and_output_weights
    specs = [LayerSpec(EmbeddingPipe, m, device=device) if untied else
             TiedLayerSpec("embed", EmbeddingPipe, m, device=device, **tied)]
    specs += [LayerSpec(TransformerLayerPipe, m, i, device=device) for i in range(m.num_layers)]
    specs += [LayerSpec(FinalLayerNormPipe, m, device=device),
              LayerSpec(LMHeadPipe, m, device=device) if untied else
              TiedLayerSpec("embed", EmbeddingPipe, m, device=device, forward_fn=lm_logits,
                            **tied)]
    topology = PipeModelDataParallelTopology(num_pp=p.pipeline_model_parallel_size,
                                             num_mp=p.tensor_model_parallel_size,
                                             num_dp=cfg.data_parallel_size)
    return PipelineModule(layers=specs, loss_fn=lm_loss, topology=topology,
                          partition_method="type:TransformerLayerPipe")


def _check_topology(engine) -> None:
    """DeepSpeed's grid must put this rank where our groups do."""
    grid = engine.grid
    ours = (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    theirs = (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank())
    if ours != theirs:
        raise RuntimeError(f"DeepSpeed's pipeline topology places rank {dist.get_rank()} at "
                           f"(stage, data, tensor) {theirs}, our groups at {ours}")


def _show_deepspeed_log() -> None:
    """DeepSpeed's own INFO lines (engine, ZeRO stage) in the log, as users know them."""
    # optional: deepspeed, imported only under --deepspeed
    from deepspeed.utils import logger

    if dist.get_rank() == 0:  # its per-rank INFO lines would repeat on every rank
        logger.setLevel(logging.INFO)
        for handler in logger.handlers:
            handler.setLevel(logging.INFO)


# The engine ---------------------------------------------------------------------------


class _PipeBatches:
    """Our micro-batches (``gpt_batch``, pretrain_gpt.py's) as DeepSpeed's pipeline engine
    reads them: ``((tokens, position_ids), (labels, loss_mask))``, each ``[b, s]``."""

    def __init__(self, iterator: Iterator, cfg: RunConfig, eod: Optional[int],
                 device: torch.device) -> None:
        self.iterator, self.data, self.eod, self.device = iterator, cfg.data, eod, device
        self.context_attention = cfg.parallel.context_attention

    def __iter__(self):
        return self

    def __next__(self):
        sample = next(self.iterator)["text"].to(self.device, non_blocking=True)
        batch = gpt_batch(sample, self.eod, self.data, causal_only=True,
                          context_attention=self.context_attention)
        return (batch.tokens, batch.position_ids), (batch.labels, batch.loss_mask)


class EngineOptimizer:
    """What the training loop reads from an optimizer, from DeepSpeed's."""

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    def get_loss_scale(self) -> Optional[float]:
        inner = self.engine.optimizer
        for name in ("cur_scale", "loss_scale"):
            value = getattr(inner, name, None)
            if isinstance(value, (int, float, torch.Tensor)):
                return float(value)
        return None

    def params_norm(self) -> Optional[float]:
        return None  # --log-params-norm is refused with --deepspeed (RunConfig)


class DeepSpeedRun:
    """DeepSpeed's engine in the shape the training loop calls: one training step, one
    evaluation step, save and load."""

    def __init__(self, engine, scheduler, cfg: RunConfig, ctx: Any, pipeline: bool) -> None:
        self.engine, self.scheduler, self.cfg, self.ctx = engine, scheduler, cfg, ctx
        self.pipeline = pipeline
        self.optimizer = EngineOptimizer(engine)
        self.chunks = [engine.module]

    # Steps.
    def _batches(self, data_iterator) -> Optional[_PipeBatches]:
        if data_iterator is None:
            return None
        eod = self.ctx.tokenizer.eod if self.ctx.tokenizer is not None else None
        return _PipeBatches(data_iterator, self.cfg, eod, self.ctx.device)

    def _forward(self, forward_step: Callable, data_iterator):
        if takes_stage(forward_step):
            return forward_step(data_iterator, self.engine, stage=StageInfo())
        return forward_step(data_iterator, self.engine)

    def train_step(self, forward_step: Callable, data_iterator, num_microbatches: int):
        """One iteration; returns (per-micro-batch loss dicts, applied, grad norm, where the
        first NaN/Inf loss was: ``(rank, micro-batch)`` or None; always None without
        --check-for-nan-in-loss-and-grad).

        A step is never applied when a loss or a gradient is NaN/Inf on any rank, as in the
        built-in engine: DeepSpeed's optimizers skip a step with non-finite gradients (and
        ``_refuse_nonfinite_steps`` gives the one it drives bare the same rule); a NaN/Inf
        loss on any rank makes the last micro-batch's gradients NaN everywhere, so that rule
        applies even where the loss's own gradients stayed finite.
        """
        engine, check = self.engine, self.cfg.optimizer.check_for_nan_in_loss_and_grad
        bad_loss = None
        if self.pipeline:
            loss = engine.train_batch(data_iter=self._batches(data_iterator))
            losses = ([{"lm loss": loss.detach()}]
                      if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else [])
            bad_loss = locate_nonfinite_loss(losses) if check else None
        else:
            losses = []
            for micro in range(num_microbatches):
                output, loss_func = self._forward(forward_step, data_iterator)
                loss, reported = add_moe_loss(self.engine.module, *loss_func(output),
                                              self.cfg.deepspeed.moe_loss_coeff)
                losses.append(reported)
                if check and micro == num_microbatches - 1:  # before the boundary's backward
                    bad_loss = locate_nonfinite_loss(losses)
                    if bad_loss is not None:
                        loss = loss * float("nan")
                # DeepSpeed divides by gradient_accumulation_steps.
                engine.backward(_deepspeed_loss(loss))
                engine.step()  # applies the update at the accumulation boundary only
        applied = engine.was_step_applied()
        norm = engine.get_global_grad_norm()
        # Our learning-rate schedule, where it drives the engine's optimizer, advances in the
        # training loop, as for every engine.
        return losses, applied, float(norm) if norm is not None else None, bad_loss

    def eval_step(self, forward_step: Callable, data_iterator, num_microbatches: int):
        """One forward-only iteration; returns the per-micro-batch loss dicts."""
        if self.pipeline:
            loss = self.engine.eval_batch(self._batches(data_iterator), return_logits=False,
                                          compute_loss=True, reduce_output="avg")
            last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            return [{"lm loss": loss.detach()}] if last else []
        losses = []
        with torch.no_grad():
            for _ in range(num_microbatches):
                output, loss_func = self._forward(forward_step, data_iterator)
                losses.append(loss_func(output)[1])
        return losses

    # Checkpoints.
    def save(self, save_dir: str, iteration: int, consumed_train_samples: int,
             consumed_valid_samples: int) -> str:
        """DeepSpeed's checkpoint of ``iteration`` (tag ``global_step{iteration}``) with our
        state as client state; every rank must call it. Returns its folder."""
        rng_states = [None] * parallel_state.get_data_parallel_world_size()
        dist.all_gather_object(rng_states, capture_rng_state(),
                               group=parallel_state.get_data_parallel_group())
        client = {
            "iteration": iteration, "consumed_train_samples": consumed_train_samples,
            "consumed_valid_samples": consumed_valid_samples,
            "opt_param_scheduler": (self.scheduler.state_dict()
                                    if self.scheduler is not None else None),
            "rng_states": rng_states, "config": self.cfg.to_dict(),
        }
        if not deepspeed_moe_layers(self.engine.module):  # DeepSpeed-MoE writes its own
            # What DeepSpeed's ds_to_universal.py needs to join tensor-parallel pieces.
            client[UNIVERSAL_CHECKPOINT_INFO] = universal_checkpoint_info(self.cfg.model,
                                                                          self.pipeline)
        tag = DEEPSPEED.folder_name(iteration)
        rank0 = dist.get_rank() == 0
        # Written under a temporary tag (global_stepN.tmp-XXXX) and renamed once complete:
        # a failed or killed save leaves no global_stepN, and the next save removes the
        # temporary folder. `latest` is ours, written last (save_latest=False).
        tmp_tag = broadcast_from_rank0(
            os.path.basename(make_tmp_folder(save_dir, tag)) if rank0 else None)
        tmp_dir = os.path.join(save_dir, tmp_tag)
        with _recorded_write_failures(self.engine) as failures:
            self.engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client,
                                        save_latest=False)
        error = failures[0] if failures else None
        if not all_true(error is None):  # every rank got through DeepSpeed's collectives
            if rank0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise_save_failure(iteration, save_dir, error, dist.get_rank())
        _on_rank0_for_all(lambda: _publish_deepspeed_save(save_dir, tmp_dir, iteration,
                                                          self.cfg))
        print_rank_0(f"  successfully saved DeepSpeed checkpoint at iteration {iteration} "
                     f"to {save_dir}/{tag}")
        return os.path.join(save_dir, tag)

    def load(self, state: Any) -> None:
        """--load: DeepSpeed's latest checkpoint into the engine and our ``state``."""
        ck = self.cfg.checkpoint
        universal = _on_rank0_for_all(lambda: find_universal(ck.load, ck.universal_checkpoint))
        if universal is not None:
            load_into_deepspeed(self, state, universal)
            return
        folder = _on_rank0_for_all(lambda: _latest_deepspeed_folder(
            ck.load, checksums=not ck.no_verify_checkpoint))
        if folder is None:
            # Said once, here: DeepSpeed's own load would warn on every rank first.
            print_rank_0(f"WARNING: --load {ck.load}: no DeepSpeed checkpoint there "
                         f"('{DEEPSPEED.tracker}' file missing); training from scratch")
            return
        tag = os.path.basename(folder)
        path, client = self.engine.load_checkpoint(
            ck.load, tag=tag, load_optimizer_states=not (ck.no_load_optim or ck.finetune),
            load_lr_scheduler_states=not (ck.no_load_lr_state or ck.finetune),
            load_module_only=ck.finetune)
        if path is None:
            raise CheckpointError(f"--load {ck.load}: DeepSpeed could not load the checkpoint "
                                  f"'{DEEPSPEED.tracker}' names ({tag})")
        reset = []
        if ck.finetune:
            reset.append("iteration, data position, optimizer (--finetune)")
        else:
            state.iteration = client["iteration"]
            state.consumed_train_samples = client["consumed_train_samples"]
            state.consumed_valid_samples = client["consumed_valid_samples"]
            state.last_saved, state.last_checkpoint = state.iteration, path
            sched = client.get("opt_param_scheduler")
            if self.scheduler is not None and sched is not None and not ck.no_load_lr_state:
                self.scheduler.load_state_dict(sched)
        if not ck.no_load_rng and not ck.finetune:
            restore_rng_state(client["rng_states"][parallel_state.get_data_parallel_rank()])
        else:
            reset.append("random states")
        print_rank_0(f" loaded DeepSpeed checkpoint {path} at iteration {state.iteration} "
                     f"(consumed samples {state.consumed_train_samples})"
                     + (f"; starting anew: {', '.join(reset)}" if reset else ""))


def _refuse_nonfinite_steps(engine) -> None:
    """DeepSpeed skips a step whose gradients hold NaN/Inf inside its own optimizers (ZeRO,
    fp16, bf16), which report it in ``optimizer.overflow``; the torch optimizer it drives bare
    (ZeRO stage 0 in fp32) would apply it. Give that one the same rule: its step first checks
    every rank's gradients (one all-reduce: every rank steps together, in both engines), and
    skips when any is NaN/Inf, setting ``overflow``, which the engine reads (the step is not
    applied and counted as skipped)."""
    optimizer, model = engine.optimizer, engine.module
    if hasattr(optimizer, "overflow"):
        return
    step = optimizer.step

    def step_if_finite(*args, **kwargs):
        optimizer.overflow = bool(ranks_where(not grads_are_finite([model])))
        return None if optimizer.overflow else step(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = step_if_finite


def _on_rank0_for_all(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on global rank 0 and give its result to every rank; an error there is
    raised on every rank (so none waits in a collective for a rank that stopped)."""
    error, result = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    shared = [(result, None if error is None else (type(error).__name__, str(error)))]
    dist.broadcast_object_list(shared, src=0)
    if error is not None:
        raise error
    result, failure = shared[0]
    if failure is not None:
        raise CheckpointError(f"on rank 0: {failure[0]}: {failure[1]}")
    return result


@contextlib.contextmanager
def _recorded_write_failures(engine):
    """Within: a file DeepSpeed's engine fails to write (a full disk) is removed and its
    failure recorded in the yielded list instead of raised, so that this rank goes on
    through the engine's collectives with the others; later writes of the save are skipped.
    The files are written by our ``write_torch`` (torch.save through a Python file), whose
    error names the file and the space needed and free."""
    failures: list[BaseException] = []
    checkpoint_engine = engine.checkpoint_engine

    def save(state_dict, path: str) -> None:
        if not failures:
            try:
                write_torch(state_dict, path)
            except CheckpointError as error:
                failures.append(error)

    def copy_recovery_script(save_path: str) -> None:
        if not failures:
            try:
                recovery_script(save_path)
            except OSError as error:
                failures.append(CheckpointError(f"cannot copy DeepSpeed's zero_to_fp32.py "
                                                f"into {save_path}: {error}"))

    recovery_script = engine._copy_recovery_script
    checkpoint_engine.save, engine._copy_recovery_script = save, copy_recovery_script
    try:
        yield failures
    finally:
        del checkpoint_engine.save, engine._copy_recovery_script  # the class's own again


def _publish_deepspeed_save(save_dir: str, tmp_dir: str, iteration: int, cfg: RunConfig) -> None:
    """Rank 0, after every rank saved into ``tmp_dir``: its manifest, the rename to
    ``global_stepN``, then the `latest` tag, atomically; folders of killed saves go."""
    layout = {"tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
              "pipeline_model_parallel_size":
                  parallel_state.get_pipeline_model_parallel_world_size(),
              "data_parallel_size": parallel_state.get_data_parallel_world_size(),
              "engine": "deepspeed"}
    publish_checkpoint(save_dir, tmp_dir, iteration, build_manifest(
        iteration, layout, cfg.to_dict(), folder_digests(tmp_dir)), naming=DEEPSPEED)
    remove_leftover_folders(save_dir)


def _latest_deepspeed_folder(load_dir: str, checksums: bool) -> Optional[str]:
    """The DeepSpeed checkpoint folder to resume from (`latest`'s tag, or the newest complete
    one when `latest` is missing or names an incomplete folder), checked against its manifest;
    None when there is none."""
    folder = latest_checkpoint(load_dir, DEEPSPEED)
    if folder is None:
        return None
    _verify_deepspeed_folder(folder.path, checksums)
    return folder.path


def _verify_deepspeed_folder(folder: str, checksums: bool) -> None:
    """``folder``'s files against its manifest (sizes; ``checksums``: CRC-32 too), naming the
    first that differs; a folder without one (saved by DeepSpeed elsewhere) with a warning."""
    checkpoint = CheckpointFolder(os.path.dirname(folder), folder, 0, naming=DEEPSPEED)
    if checkpoint.manifest is None:
        logging.getLogger(__name__).warning(
            "DeepSpeed checkpoint %s has no %s (saved elsewhere, or by an older version): "
            "its files are not verified", folder, MANIFEST_FILENAME)
        return
    checkpoint.verify(checksums=checksums)


def cpu_comm_op_to_build() -> Optional[str]:
    """The folder DeepSpeed is about to compile its shared-memory CPU all-reduce op into when
    its communication starts (DeepSpeed's CPU accelerator, the op neither shipped with the
    package nor built before on this machine); None when nothing is built."""
    # optional: deepspeed, imported only under --deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.name, False) \
            or installed_ops.get(builder.name, False):
        return None
    # torch's JIT loader names the folder (TORCH_EXTENSIONS_DIR, Python and CUDA tags).
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(builder.name, verbose=False)
    return None if os.path.exists(os.path.join(folder, f"{builder.name}.so")) else folder


def setup_engine(model_provider: Callable, ctx: Any, ds_config: dict) -> DeepSpeedRun:
    """The model, optimizer and LR schedule inside DeepSpeed's engine for this run."""
    # optional: deepspeed, imported only under --deepspeed
    import deepspeed

    cfg = ctx.config
    _show_deepspeed_log()
    # DeepSpeed reads the launcher's variables; a plain `python pretrain_gpt.py` (or srun)
    # sets none of them.
    env = distributed_env()
    os.environ.setdefault("LOCAL_RANK", str(env["local_rank"]))
    os.environ.setdefault("RANK", str(env["rank"]))
    os.environ.setdefault("WORLD_SIZE", str(env["world_size"]))
    ours = parallel_state.torch_group_names()
    building = cpu_comm_op_to_build()
    if building is not None:  # a minute of silence otherwise: the run would look hung
        print_rank_0(f"> DeepSpeed builds its CPU communication op (deepspeed_shm_comm) into "
                     f"{building}: once per machine, about a minute; later runs reuse it")
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    configure_activation_checkpointing(cfg)
    pipeline = not cfg.deepspeed.no_pipeline_parallel
    if pipeline:
        model = build_pipeline_module(cfg, ctx.device)
    else:
        model = model_provider(ctx, pre_process=True, post_process=True, first_layer=0,
                               num_layers=cfg.model.num_layers)
        if cfg.model.num_experts is not None:  # Megatron-DeepSpeed's experts
            use_deepspeed_moe(model, cfg.deepspeed)
    opt = cfg.optimizer
    groups = get_param_groups([model], opt.weight_decay, opt.lr)
    stage = ds_config["zero_optimization"]["stage"]
    if cfg.model.num_experts is not None and cfg.deepspeed.create_moe_param_group:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        # DeepSpeed names the expert groups after the groups they come from.
        groups = split_params_into_different_moe_groups_for_optimizer(
            [{"name": f"group{i}", **g} for i, g in enumerate(groups)])
    optimizer = None if "optimizer" in ds_config else build_torch_optimizer(opt, groups)
    if stage == 3 and not pipeline and model.shared_embedding_or_output_weight() is not None:
        # The LM head reads the embedding's weight outside the embedding's forward.
        deepspeed.zero.register_external_parameter(model,
                                                   model.shared_embedding_or_output_weight())
    engine, _, _, ds_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=groups if optimizer is None else None,
        mpu=None if pipeline else ParallelStateMPU(), config=ds_config)
    # DeepSpeed makes its groups (the pipeline grid's, ZeRO's) with torch's default timeout
    # of 30 minutes: they get --distributed-timeout-minutes and names for timeout reports.
    parallel_state.adopt_groups(parallel_state.torch_group_names() - ours, "DeepSpeed")
    if not pipeline:
        check_expert_groups(engine.module)
    if pipeline:
        _check_topology(engine)
    if cfg.optimizer.check_for_nan_in_loss_and_grad:
        _refuse_nonfinite_steps(engine)
    scheduler = None
    if ds_scheduler is None:
        scheduler = build_optimizer_param_scheduler(
            cfg.scheduler, opt, engine.optimizer, global_batch_size=cfg.training.global_batch_size,
            train_iters=cfg.training.train_iters, train_samples=cfg.training.train_samples)
    print_rank_0(f"> DeepSpeed engine {deepspeed.__version__}: ZeRO stage {stage}, "
                 f"{'pipeline engine (PipelineModule)' if pipeline else 'plain model'}, "
                 f"optimizer {'from the JSON file' if optimizer is None else 'ours'}, "
                 f"LR schedule {'from the JSON file' if scheduler is None else 'ours'}")
    return DeepSpeedRun(engine, scheduler, cfg, ctx, pipeline)


# Conversion ------------------------------------------------------------------------------


