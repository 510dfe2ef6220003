"""How the model is cut over ranks: tensor, pipeline (with virtual chunks) and data parallel.

Also where the layers of each pipeline stage come from (``split_pipeline_layers``, and
``layer_range`` for one stage or virtual chunk): the model builder and the checkpoint code
both need the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from megatron.config.base import (
    ConfigError,
    Slice,
    internal,
    one_of,
    option,
    optional_positive,
    positive,
    require,
    set_field,
)

DP_MODES = ("allreduce", "decentralized")
CP_COMM_TYPES = ("p2p", "a2a", "allgather")
DP_TOPOLOGIES = ("complete", "ring", "exp", "alternating-exp-ring")


def context_flag(attention: str) -> str:
    """The flag that splits sequences for ``attention`` (``ParallelConfig.context_attention``):
    Ulysses' own, else --context-parallel-size."""
    return "--ds-sequence-parallel-size" if attention == "ulysses" else "--context-parallel-size"


@dataclass(frozen=True)
class ParallelConfig(Slice):
    """Parallel degrees. The data-parallel size is what the world size leaves (times the
    devices of each process under XLA SPMD)."""

    world_size: int = internal("the launcher: WORLD_SIZE, else SLURM_NTASKS, else 1", 1)
    # Under torch_xla's SPMD (--xla-spmd) each process drives this many devices, each of them
    # a data-parallel rank; None: one device per process.
    xla_spmd_devices: Optional[int] = internal("the XLA runtime, under --xla-spmd", None)
    tensor_model_parallel_size: int = option(
        default=1, help="Ranks that split each layer's weights (Megatron's tensor parallelism).")
    pipeline_model_parallel_size: int = option(
        default=1, help="Ranks that split the layers into consecutive pipeline stages.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        default=None, help="Interleaved 1F1B: transformer layers per model chunk; each stage "
        "then holds several chunks (needs --pipeline-model-parallel-size > 2). Off when unset.",
        feeds=("virtual_pipeline_model_parallel_size",))
    # Chunks per stage, from the flag above and --num-layers (RunConfig resolves it).
    virtual_pipeline_model_parallel_size: Optional[int] = internal(
        "--num-layers-per-virtual-pipeline-stage and --num-layers", None)
    decoder_first_pipeline_num_layers: Optional[int] = option(
        default=None, help="Uneven pipeline split: transformer layers on the first stage "
        "(the other stages share the rest evenly). Even split when unset.",
        feeds=("pipeline_stage_num_layers",))
    decoder_last_pipeline_num_layers: Optional[int] = option(
        default=None, help="Uneven pipeline split: transformer layers on the last stage. "
        "Even split when unset.", feeds=("pipeline_stage_num_layers",))
    sequence_parallel: bool = option(
        default=False, help="Shard layer-norm and dropout activations over the tensor-parallel "
        "ranks along the sequence (turned off at tensor-parallel size 1, as in Megatron).")
    # Decentralized data parallelism (issue 15): megatron/core/distributed/gossip.py.
    # Long sequences (issue 33): megatron/core/context_parallel.py.
    context_parallel_size: int = option(
        default=1, help="Ranks that split each sequence (context parallelism): each holds "
        "two of 2N chunks (i and 2N-1-i, balancing the causal work) and attention spans them "
        "as --cp-comm-type says.")
    cp_comm_type: str = option(
        default="p2p", choices=CP_COMM_TYPES, help="How context-parallel attention sees the "
        "other ranks' tokens: p2p (ring attention: keys and values travel round the ring, "
        "partial results merged by their log-sum-exp), a2a (all-to-all from sequence shards "
        "to head shards and back, Ulysses-style) or allgather (every rank gathers all keys and "
        "values).", feeds=("context_attention",))
    ds_sequence_parallel_size: int = option(
        default=1, help="DeepSpeed-Ulysses (Megatron-DeepSpeed's flag): ranks that split each "
        "sequence into contiguous shards, exchanged for head shards by all-to-all around "
        "attention. Combines with tensor, pipeline and data parallelism here.",
        feeds=("context_degree", "context_attention"))
    # Mixtures of experts (issue 34): megatron/model/moe.py.
    expert_model_parallel_size: int = option(
        default=1, help="Ranks that share out each mixture-of-experts layer's experts (each "
        "holds --num-experts / this many); tokens travel to their experts and back by "
        "all-to-all or all-gather (--moe-token-dispatcher-type). Cut out of the data-parallel "
        "ranks: it must divide the data-parallel size. Megatron-DeepSpeed's "
        "--moe-expert-parallel-size is the same.")
    dp_mode: str = option(
        default="allreduce", choices=DP_MODES, help="How data-parallel replicas agree: "
        "allreduce (average the gradients every step) or decentralized (each replica steps on "
        "its own gradients, then averages its parameters with its --dp-topology neighbours).")
    dp_topology: str = option(
        default="complete", choices=DP_TOPOLOGIES, help="With --dp-mode decentralized, who "
        "averages with whom: complete (everyone), ring (the left, then the right neighbour), "
        "exp (the rank 2^k away, k cycling), alternating-exp-ring (inside each node, then exp "
        "between nodes).")
    dp_overlap: bool = option(
        default=False, help="With --dp-mode decentralized, overlap the neighbour averaging "
        "with the forward and backward: the average of the parameters before the step is "
        "exchanged while the gradient is computed, and the local update is applied to it.")

    def __post_init__(self) -> None:
        positive(self, "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "ds_sequence_parallel_size")
        one_of(self, "cp_comm_type", CP_COMM_TYPES)
        require(self.context_parallel_size == 1 or self.ds_sequence_parallel_size == 1,
                f"--context-parallel-size ({self.context_parallel_size}) and "
                f"--ds-sequence-parallel-size ({self.ds_sequence_parallel_size}) both split the "
                "sequence: use one of them")
        optional_positive(self, "xla_spmd_devices", "num_layers_per_virtual_pipeline_stage",
                          "virtual_pipeline_model_parallel_size",
                          "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        cp, cp_flag = self.context_degree, self.context_flag
        with_cp = f" x {cp_flag} ({cp})" if cp > 1 else ""
        require(self.world_size % (tp * pp * cp) == 0,
                f"world size ({self.world_size}) is not divisible by --tensor-model-parallel-size "
                f"({tp}) x --pipeline-model-parallel-size ({pp}){with_cp}")
        require(cp == 1 or self.dp_mode == "allreduce",
                f"{cp_flag} ({cp}) needs --dp-mode allreduce: decentralized data parallelism "
                "does not know the context-parallel ranks")
        if self.sequence_parallel and tp == 1:
            set_field(self, "sequence_parallel", False)
        one_of(self, "dp_mode", DP_MODES)
        one_of(self, "dp_topology", DP_TOPOLOGIES)
        self._check_dp_topology()
        self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        """Expert parallelism is carved out of the data-parallel ranks."""
        ep, dp = self.expert_model_parallel_size, self.data_parallel_size
        positive(self, "expert_model_parallel_size")
        if ep == 1:
            return
        require(self.context_degree == 1,
                f"--expert-model-parallel-size ({ep}) cannot be combined with "
                f"{self.context_flag} ({self.context_degree}) yet")
        require(self.dp_mode == "allreduce",
                f"--expert-model-parallel-size ({ep}) needs --dp-mode allreduce")
        require(self.xla_spmd_devices is None,
                f"--expert-model-parallel-size ({ep}) does not run under XLA SPMD")
        require(dp % ep == 0,
                f"--expert-model-parallel-size ({ep}) must divide the data-parallel size "
                f"({dp} = world size {self.world_size} / (--tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size}))")

    def _check_dp_topology(self) -> None:
        """The sizes ring and exp need (alternating-exp-ring's nodes are checked at start-up,
        where LOCAL_WORLD_SIZE is known)."""
        dp, name = self.data_parallel_size, self.dp_topology
        require(not self.dp_overlap or self.dp_mode == "decentralized",
                "--dp-overlap needs --dp-mode decentralized (all-reduce data parallelism "
                "overlaps its gradient reduction with --overlap-grad-reduce)")
        if self.dp_mode != "decentralized" or dp == 1:
            return
        require(name != "ring" or dp % 2 == 0,
                f"--dp-topology ring needs an even data-parallel size, got {dp}")
        require(name != "exp" or dp & (dp - 1) == 0,
                f"--dp-topology exp needs a power-of-2 data-parallel size, got {dp}")

    @property
    def devices_per_process(self) -> int:
        """Devices each process computes on: several under XLA SPMD, else one."""
        return self.xla_spmd_devices or 1

    @property
    def context_degree(self) -> int:
        """Ranks that split each sequence: --context-parallel-size or, for DeepSpeed-Ulysses,
        --ds-sequence-parallel-size (one of them is 1)."""
        return max(self.context_parallel_size, self.ds_sequence_parallel_size)

    @property
    def context_flag(self) -> str:
        """The flag that set ``context_degree``, for messages."""
        return context_flag(self.context_attention)

    @property
    def context_attention(self) -> str:
        """How attention spans the split sequence: --cp-comm-type, or ``ulysses``
        (contiguous shards, all-to-all around attention)."""
        return "ulysses" if self.ds_sequence_parallel_size > 1 else self.cp_comm_type

    @property
    def data_parallel_size(self) -> int:
        """Model replicas that read different samples: processes per replica come from tensor,
        pipeline and context parallelism; under XLA SPMD each device of a process is one
        replica."""
        return (self.world_size // (self.tensor_model_parallel_size
                                    * self.pipeline_model_parallel_size * self.context_degree)
                * self.devices_per_process)

    def stage_num_layers(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers held by each pipeline stage (all its virtual chunks together)."""
        return split_pipeline_layers(num_layers, self.pipeline_model_parallel_size,
                                     self.decoder_first_pipeline_num_layers,
                                     self.decoder_last_pipeline_num_layers)

    def check_virtual_pipeline(self, num_layers: int) -> Optional[int]:
        """Chunks per stage for ``--num-layers-per-virtual-pipeline-stage`` (None: off)."""
        per_chunk, pp = self.num_layers_per_virtual_pipeline_stage, \
            self.pipeline_model_parallel_size
        if per_chunk is None:
            return None
        name = "--num-layers-per-virtual-pipeline-stage"
        # Megatron-DeepSpeed requires pp > 2: with two stages the interleaved schedule would
        # batch several sends and receives between the same two ranks.
        require(pp > 2, f"{name} ({per_chunk}) needs --pipeline-model-parallel-size > 2, "
                f"got {pp}")
        require(self.decoder_first_pipeline_num_layers is None
                and self.decoder_last_pipeline_num_layers is None,
                f"{name} cannot be combined with --decoder-first-pipeline-num-layers/"
                "--decoder-last-pipeline-num-layers")
        per_stage = self.stage_num_layers(num_layers)[0]
        require(per_stage % per_chunk == 0,
                f"{name} ({per_chunk}) does not divide the layers per pipeline stage: "
                f"--num-layers ({num_layers}) / --pipeline-model-parallel-size ({pp}) = "
                f"{per_stage}")
        vp = per_stage // per_chunk
        return vp if vp > 1 else None


def split_pipeline_layers(num_layers: int, pp: int, first: Optional[int] = None,
                          last: Optional[int] = None) -> tuple[int, ...]:
    """Transformer layers on each pipeline stage: even, or with a given first/last stage."""
    if first is None and last is None:
        require(num_layers % pp == 0, f"--num-layers ({num_layers}) is not divisible by "
                f"--pipeline-model-parallel-size ({pp})")
        return (num_layers // pp,) * pp
    require(pp > 1, "--decoder-first-pipeline-num-layers/--decoder-last-pipeline-num-layers "
            f"need --pipeline-model-parallel-size > 1 (got {pp})")
    given = [n for n in (first, last) if n is not None]
    middle_stages = pp - len(given)
    rest = num_layers - sum(given)
    names = (f"--decoder-first-pipeline-num-layers ({first}) and "
             f"--decoder-last-pipeline-num-layers ({last})")
    if middle_stages == 0:
        require(rest == 0, f"{names} must add up to --num-layers ({num_layers}) with 2 stages")
        return (first, last)
    require(rest >= middle_stages and rest % middle_stages == 0,
            f"uneven pipeline split: --num-layers ({num_layers}) minus {names} leaves {rest} "
            f"layers, which do not split evenly over the other {middle_stages} stage(s) of "
            f"--pipeline-model-parallel-size ({pp})")
    stages = [rest // middle_stages] * middle_stages
    if first is not None:
        stages.insert(0, first)
    if last is not None:
        stages.append(last)
    return tuple(stages)


def layer_range(stage_layers: Sequence[int], pipeline_rank: int = 0,
                virtual_size: Optional[int] = None, virtual_rank: int = 0) -> tuple[int, int]:
    """``(first_global_layer, count)`` for one stage, or one virtual chunk of a stage.

    With interleaving (``virtual_size`` v > 1) the model is cut into ``p * v`` equal chunks and
    stage i holds chunks ``i, i + p, i + 2p, ...`` (Megatron's layout), which needs a uniform
    split.
    """
    if not virtual_size or virtual_size == 1:
        return sum(stage_layers[:pipeline_rank]), stage_layers[pipeline_rank]
    p, num_layers = len(stage_layers), sum(stage_layers)
    if len(set(stage_layers)) != 1 or num_layers % (p * virtual_size) != 0:
        raise ConfigError(
            f"interleaving needs --num-layers ({num_layers}) split evenly over "
            f"--pipeline-model-parallel-size ({p}) x virtual stages ({virtual_size}); "
            f"stages hold {list(stage_layers)}")
    per_chunk = num_layers // (p * virtual_size)
    return (virtual_rank * p + pipeline_rank) * per_chunk, per_chunk
