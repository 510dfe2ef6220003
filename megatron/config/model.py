"""The model slice: shape, numerics and activation recomputation of a GPT (GPT-2/GPT-3)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from megatron.config.base import (
    Slice,
    flag,
    internal,
    non_negative,
    one_of,
    option,
    optional_positive,
    positive,
    precision_dtype,
    probability,
    received,
    require,
    set_field,
)
from megatron.config.parallel import context_flag

_MOE_FIELDS = ("moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
               "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
               "moe_expert_capacity_factor", "moe_token_drop_policy",
               "moe_pad_expert_input_to_capacity", "moe_layer_freq", "moe_ffn_hidden_size",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_grouped_gemm",
               "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
               "moe_token_dispatcher_type")
_LIST_TERM = re.compile(r"\[([01](?:\s*,\s*[01])*)\](?:\s*\*\s*(\d+))?")


def moe_layer_pattern(freq: str, num_layers: int) -> tuple[bool, ...]:
    """``--moe-layer-freq`` as one flag per layer: ``"N"`` makes layers 0, N, 2N, ... (0-based)
    mixtures of experts (Megatron-LM's rule); a list such as ``"([1]*3+[0])*2"`` or
    ``"[1,0,1,0]"`` names each layer and must have ``num_layers`` entries."""
    text = freq.replace(" ", "")
    if text.isdigit():
        n = int(text)
        require(n > 0, f"--moe-layer-freq must be positive, got {freq}")
        return tuple(i % n == 0 for i in range(num_layers))
    pattern = _expand_freq_list(text)
    require(pattern is not None, f"--moe-layer-freq {freq!r} is neither a number nor a list "
            "such as \"([1]*3+[0])*2\"")
    require(len(pattern) == num_layers, f"--moe-layer-freq {freq!r} names {len(pattern)} "
            f"layers; --num-layers is {num_layers}")
    require(any(pattern), f"--moe-layer-freq {freq!r} makes no layer a mixture of experts")
    return tuple(bool(x) for x in pattern)


def _expand_freq_list(text: str) -> Optional[list[int]]:
    """``[1,0]*2+[1]`` -> [1, 0, 1, 0, 1]; one level of ``(...)*n`` around it; None if
    malformed."""
    outer = re.fullmatch(r"\((.*)\)(?:\*(\d+))?", text)
    if outer:
        inner = _expand_freq_list(outer.group(1))
        return None if inner is None else inner * int(outer.group(2) or 1)
    out = []
    for term in text.split("+"):
        m = _LIST_TERM.fullmatch(term)
        if m is None:
            return None
        out += [int(x) for x in m.group(1).split(",")] * int(m.group(2) or 1)
    return out


_EXACT = "GeLU with the tanh approximation (OpenAI's GPT-2 code); exact erf GeLU otherwise."


@dataclass(frozen=True)
class ModelConfig(Slice):
    """The shape and numerics of a GPT model. Mixed precision (--fp16/--bf16) is owned here:
    it is the dtype of the model's parameters and activations."""

    num_layers: int = option("--num-layers", "--encoder-num-layers", default=2, required=True,
                             help="Transformer layers.")
    hidden_size: int = option(default=64, required=True, help="Hidden size.")
    num_attention_heads: int = option(default=4, required=True, help="Attention heads.")
    ffn_hidden_size: Optional[int] = option(
        default=None, help="Width of the MLP (4 x --hidden-size when unset; with --swiglu "
        "Megatron's 8/3 x --hidden-size rounded down to a multiple of 64).")
    kv_channels: Optional[int] = option(
        default=None, help="Size of each attention head (--hidden-size / "
        "--num-attention-heads when unset).")
    seq_length: int = option("--seq-length", "--encoder-seq-length", default=128,
                             required=True, help="Tokens per training sample.")
    max_position_embeddings: Optional[int] = option(
        default=None, help="Rows of the learned position table (--seq-length when unset).")
    make_vocab_size_divisible_by: int = option(
        default=128, help="Pad the vocabulary to a multiple of this times the tensor-parallel "
        "size (Megatron's rule: padding differs between tensor-parallel sizes).")
    layernorm_epsilon: float = option("--layernorm-epsilon", "--norm-epsilon", default=1e-5,
                                      help="Epsilon of the layer norms.")
    normalization: str = option(
        default="LayerNorm", metavar="{LayerNorm,RMSNorm}",
        help="The layer norms: LayerNorm (GPT) or RMSNorm (Llama); Megatron-DeepSpeed's "
        "layernorm/rmsnorm are accepted.")
    swiglu: bool = option(default=False, help="SwiGLU feed-forward layers (Llama): "
                          "silu(x W_gate) * (x W_up), then W_down.")
    group_query_attention: bool = option(
        default=False, help="Grouped-query attention: --num-query-groups key/value heads "
        "shared by the query heads.")
    num_query_groups: Optional[int] = option(
        "--num-query-groups", "--num-key-value-heads", default=None, feeds=("query_groups",),
        help="Key/value heads with --group-query-attention (1: multi-query attention); "
        "--num-key-value-heads (Megatron-DeepSpeed) turns grouped-query attention on. "
        "--num-attention-heads when unset.")
    add_qkv_bias: bool = option(default=False, help="Biases on the query/key/value projection "
                                "even with --disable-bias-linear (Qwen2).")
    hidden_dropout: float = option(default=0.1, help="Dropout after attention and MLP.")
    attention_dropout: float = option(default=0.1, help="Dropout of the attention weights.")
    init_method_std: float = option(
        default=0.02, help="Standard deviation of the normal weight initialization.")
    untie_embeddings_and_output_weights: bool = option(
        default=False, help="Give the output layer its own weights instead of the word "
        "embeddings'.")
    position_embedding_type: str = option(
        default="learned_absolute", choices=("learned_absolute", "rope", "none"),
        help="Learned absolute positions (GPT-2), rotary embeddings (Llama), or none.")
    rotary_percent: float = option(default=1.0, help="Share of each head rotated by RoPE.")
    rotary_base: int = option("--rotary-base", "--rotary-position-embeddings-theta",
                              "--rope-theta", default=10000, help="Base of RoPE's frequencies.")
    rotary_interleaved: bool = option(
        default=False, help="RoPE rotates adjacent channel pairs (GPT-J, Meta's Llama code) "
        "instead of the two halves of each head (Hugging Face's, Megatron's default).")
    use_rope_scaling: bool = option(
        default=False, help="Llama 3.1's RoPE frequency scaling (low-frequency channels "
        "slowed by --rope-scaling-factor, a smooth band between).")
    rope_scaling_factor: float = option(default=8.0, help="With --use-rope-scaling: the "
                                        "factor (Llama 3.1: 8).")
    add_bias_linear: bool = option(
        "--disable-bias-linear", default=True, action="store_false",
        help="No biases in the linear layers.")
    activation: str = option(
        "--openai-gelu", "--gelu-tanh", default="gelu", action="store_const",
        const="gelu_tanh", help=_EXACT)
    fp16: bool = option(default=False, help="Train in fp16 with fp32 main weights and loss "
                        "scaling.")
    bf16: bool = option(default=False, help="Train in bf16 with fp32 main weights and fp32 "
                        "gradient reduction.")
    attention_softmax_in_fp32: bool = option(
        default=True, action="store_true", help="Softmax in fp32 (always on here; Megatron "
        "forces it under fp16 with query-key layer scaling, its default).")
    use_flash_attn: bool = option(
        "--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-v1", "--use-flash-attn-triton",
        default=False,
        help="Use flash-attn where it is installed (PyTorch's SDPA otherwise, with a notice).")
    recompute_granularity: Optional[str] = option(
        default=None, choices=("full", "selective"), help="Recompute activations in the "
        "backward pass: whole layers (full) or only the attention core (selective). Off when "
        "unset.")
    recompute_method: Optional[str] = option(
        "--recompute-method", "--activations-checkpoint-method", default=None,
        choices=("uniform", "block"), help="With full recomputation: recompute every "
        "--recompute-num-layers layers as a block (uniform), or the first N layers of each "
        "stage (block).")
    recompute_num_layers: Optional[int] = option(
        "--recompute-num-layers", "--checkpoint-num-layers", "--activations-checkpoint-num-layers",
        default=1, help="Layers per recomputed block (full recomputation only).")

    num_experts: Optional[int] = option(
        default=None, help="Experts of each mixture-of-experts layer (unset or 1: dense MLPs "
        "everywhere, as Megatron-DeepSpeed's dense scripts pass).")
    moe_router_topk: int = option("--moe-router-topk", "--topk", default=2,
                                  help="Experts each token is routed to (--topk: "
                                  "Megatron-DeepSpeed's spelling).")
    moe_router_score_function: str = option(
        default="softmax", choices=("softmax", "sigmoid"), help="The router's score: softmax "
        "over the chosen experts' logits, or sigmoid scores renormalised over the chosen.")
    moe_router_pre_softmax: bool = option(
        default=False, help="Softmax over all experts before the top-k (the chosen "
        "probabilities then do not sum to 1).")
    moe_router_enable_expert_bias: bool = option(
        default=False, help="Loss-free balancing (DeepSeek-V3's): a per-expert bias added to "
        "the sigmoid scores for choosing the top-k only, moved after every step by "
        "--moe-router-bias-update-rate towards the experts that got fewer tokens than the "
        "mean (needs --moe-router-score-function sigmoid).")
    moe_router_bias_update_rate: float = option(
        default=1e-3, help="How far each expert's bias moves per step (--moe-router-enable-"
        "expert-bias).")
    moe_router_load_balancing_type: str = option(
        default="aux_loss", choices=("aux_loss", "seq_aux_loss", "none"),
        help="Load balancing: the Switch auxiliary loss over each micro-batch (aux_loss), "
        "per sequence (seq_aux_loss), or none.")
    moe_aux_loss_coeff: float = option(default=0.0, help="Weight of the load-balancing loss "
                                       "(0: not computed).")
    moe_z_loss_coeff: Optional[float] = option(
        default=None, help="Weight of the router z-loss, mean(logsumexp(logits)^2) (unset: "
        "none).")
    moe_expert_capacity_factor: Optional[float] = option(
        default=None, help="Each expert takes at most ceil(tokens x top-k / experts x this) "
        "tokens of a micro-batch, the rest are dropped (unset: dropless).")
    moe_token_drop_policy: str = option(
        default="probs", choices=("probs", "position"), help="Over capacity, an expert keeps "
        "its highest-probability tokens (probs) or its first ones (position).")
    moe_pad_expert_input_to_capacity: bool = option(
        default=False, help="Every expert computes exactly its capacity of tokens (padding "
        "with zero-weight tokens); needs --moe-expert-capacity-factor.")
    moe_layer_freq: str = option(
        default="1", feeds=("moe_layers",), help="Which layers are mixtures of experts: every Nth from the first "
        "(N), or Megatron's per-layer list such as \"([1]*3+[0])*2\" (1: experts).")
    moe_grouped_gemm: bool = option(
        default=False, help="Compute a rank's experts together with grouped matrix "
        "products (torch's grouped_mm: one kernel for all experts on a GPU) instead of one "
        "product per expert. The same weights and results; needs widths whose rows are "
        "16-byte multiples.")
    moe_token_dispatcher_type: str = option(
        default="allgather", choices=("allgather", "alltoall"), help="How tokens reach experts "
        "on other --expert-model-parallel-size ranks: allgather (every rank gathers all "
        "tokens, computes its experts' share, and the shares are summed back) or alltoall "
        "(each token travels only to the ranks of its experts and back). Same results.")
    moe_ffn_hidden_size: Optional[int] = option(
        default=None, help="Width of each expert's MLP (--ffn-hidden-size when unset).")
    moe_shared_expert_intermediate_size: Optional[int] = option(
        default=None, help="Width of a shared expert every token also goes through (unset: "
        "none).")
    moe_shared_expert_gate: bool = option(
        default=False, help="Scale the shared expert's output by a learned sigmoid gate of "
        "the token, sigmoid(x . g) (Qwen2-MoE's shared_expert_gate); needs "
        "--moe-shared-expert-intermediate-size.")

    vocab_size: int = internal("the tokenizer's vocabulary size (before padding)", 50257)
    apex_layernorm: bool = internal("programmatic: apex's fused LayerNorm; a run sets whether "
                                    "it is used (on CUDA with apex installed)", True)
    perform_initialization: bool = internal("programmatic: converters skip random init", True)
    tensor_model_parallel_size: int = received("parallel.tensor_model_parallel_size", 1)
    sequence_parallel: bool = received("parallel.sequence_parallel", False)
    # Ranks that split each sequence and how attention spans them (ParallelConfig's
    # context_degree and context_attention: --context-parallel-size with --cp-comm-type, or
    # --ds-sequence-parallel-size's ulysses).
    context_parallel_size: int = received("parallel.context_degree", 1)
    context_attention: str = received("parallel.context_attention", "p2p")
    expert_model_parallel_size: int = received("parallel.expert_model_parallel_size", 1)
    seed: int = received("training.seed", 1234)

    def __post_init__(self) -> None:
        positive(self, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size")
        require(self.hidden_size % self.num_attention_heads == 0 or self.kv_channels is not None,
                f"--hidden-size ({self.hidden_size}) is not divisible by "
                f"--num-attention-heads ({self.num_attention_heads})")
        tp = self.tensor_model_parallel_size
        require(self.num_attention_heads % tp == 0,
                f"--num-attention-heads ({self.num_attention_heads}) is not divisible by "
                f"--tensor-model-parallel-size ({tp})")
        probability(self, "hidden_dropout", "attention_dropout")
        positive(self, "init_method_std")
        one_of(self, "position_embedding_type", ("learned_absolute", "rope", "none"))
        self._resolve_families()
        one_of(self, "activation", ("gelu", "gelu_tanh"))
        require(not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive")
        self._resolve_recompute()
        if self.ffn_hidden_size is None:
            ffn = int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else \
                4 * self.hidden_size
            require(ffn > 0, f"--swiglu's default --ffn-hidden-size (8/3 x --hidden-size "
                    f"{self.hidden_size}, rounded down to a multiple of 64) is 0: give "
                    "--ffn-hidden-size")
            set_field(self, "ffn_hidden_size", ffn)
        if self.kv_channels is None:
            set_field(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.max_position_embeddings is None:
            set_field(self, "max_position_embeddings", self.seq_length)
        positive(self, "ffn_hidden_size", "kv_channels")
        require(self.ffn_hidden_size % tp == 0,
                f"--ffn-hidden-size ({self.ffn_hidden_size}) is not divisible by "
                f"--tensor-model-parallel-size ({tp})")
        require(self.position_embedding_type == "rope"
                or self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings ({self.max_position_embeddings}) is smaller than "
                f"--seq-length ({self.seq_length})")
        self._check_context_split()
        self._check_moe()
        require(not self.sequence_parallel or self.local_seq_length % tp == 0,
                f"--sequence-parallel needs --seq-length ({self.seq_length}) divisible by "
                f"--tensor-model-parallel-size ({tp})"
                + (f" x the context-parallel size ({self.context_parallel_size})"
                   if self.context_parallel_size > 1 else ""))

    def _check_context_split(self) -> None:
        """What splitting the sequence over ``context_parallel_size`` ranks needs."""
        cp, kind = self.context_parallel_size, self.context_attention
        if cp == 1:
            return
        flag = context_flag(kind)
        chunks = cp if kind == "ulysses" else 2 * cp
        require(self.seq_length % chunks == 0,
                f"--seq-length ({self.seq_length}) is not divisible by {chunks}: {flag} ({cp}) "
                + ("cuts each sequence into that many contiguous shards" if kind == "ulysses"
                   else "cuts each sequence into 2 x that many chunks (each rank holds two, "
                   "balancing the causal attention's work)"))
        if kind in ("a2a", "ulysses"):
            heads = self.num_attention_heads // self.tensor_model_parallel_size
            require(heads % cp == 0,
                    f"{flag} ({cp}) with all-to-all attention gives each rank a share of the "
                    f"attention heads: the {heads} heads of each tensor rank "
                    f"(--num-attention-heads {self.num_attention_heads} / "
                    f"--tensor-model-parallel-size {self.tensor_model_parallel_size}) do not "
                    f"divide by {cp}")
        if kind == "p2p":
            require(self.attention_dropout == 0.0,
                    f"--context-parallel-size ({cp}) with --cp-comm-type p2p merges partial "
                    "attention results across ranks and has no attention dropout: give "
                    f"--attention-dropout 0 (got {self.attention_dropout}), or --cp-comm-type "
                    "a2a")

    def _check_moe(self) -> None:
        """The mixture-of-experts options: checked, and resolved (expert width, layer list)."""
        if self.num_experts == 1:  # Megatron-DeepSpeed's dense scripts pass --num-experts 1
            set_field(self, "num_experts", None)
        ep = self.expert_model_parallel_size
        if self.num_experts is None:
            require(ep == 1, f"--expert-model-parallel-size ({ep}) needs --num-experts above 1")
            for name in _MOE_FIELDS:
                value = getattr(self, name)
                require(value == ModelConfig.__dataclass_fields__[name].default,
                        f"{flag(name)} ({value}) needs --num-experts above 1 (mixture-of-"
                        "experts layers); without it every layer has a dense MLP")
            return
        e, k, tp = self.num_experts, self.moe_router_topk, self.tensor_model_parallel_size
        require(e > 1, f"--num-experts must be positive, got {e}")
        require(1 <= k <= e, f"--moe-router-topk ({k}) must be between 1 and --num-experts "
                f"({e})")
        require(e % ep == 0, f"--num-experts ({e}) is not divisible by "
                f"--expert-model-parallel-size ({ep})")
        one_of(self, "moe_token_dispatcher_type", ("allgather", "alltoall"))
        require(not self.moe_router_enable_expert_bias
                or self.moe_router_score_function == "sigmoid",
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                "(megatron-core's rule: the bias is added to sigmoid scores)")
        non_negative(self, "moe_router_bias_update_rate")
        one_of(self, "moe_router_score_function", ("softmax", "sigmoid"))
        one_of(self, "moe_router_load_balancing_type", ("aux_loss", "seq_aux_loss", "none"))
        one_of(self, "moe_token_drop_policy", ("probs", "position"))
        non_negative(self, "moe_aux_loss_coeff")
        require(self.moe_z_loss_coeff is None or self.moe_z_loss_coeff >= 0,
                f"--moe-z-loss-coeff must be non-negative, got {self.moe_z_loss_coeff}")
        optional_positive(self, "moe_expert_capacity_factor")
        require(not self.moe_pad_expert_input_to_capacity
                or self.moe_expert_capacity_factor is not None,
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        require(not self.moe_shared_expert_gate
                or self.moe_shared_expert_intermediate_size is not None,
                "--moe-shared-expert-gate gates the shared expert: it needs "
                "--moe-shared-expert-intermediate-size")
        moe_layer_pattern(self.moe_layer_freq, self.num_layers)  # raises with the flag's name
        if self.moe_ffn_hidden_size is None:
            set_field(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        optional_positive(self, "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
        if self.moe_grouped_gemm:
            self._check_grouped_gemm()
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            width = getattr(self, name)
            require(width is None or width % tp == 0,
                    f"{flag(name)} ({width}) is not divisible by --tensor-model-parallel-size "
                    f"({tp})")

    def _check_grouped_gemm(self) -> None:
        """What torch's grouped_mm takes: every operand row 16-byte aligned."""
        import torch
        import torch.nn.functional as F

        require(hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm"),
                "--moe-grouped-gemm needs torch's grouped matrix product (torch 2.8 or later; "
                f"this is {torch.__version__})")
        per_row = 16 // torch.empty((), dtype=self.params_dtype).element_size()
        tp = self.tensor_model_parallel_size
        for what, width in (("--hidden-size", self.hidden_size),
                            ("--moe-ffn-hidden-size / tensor-parallel size",
                             self.moe_ffn_hidden_size // tp)):
            require(width % per_row == 0, f"--moe-grouped-gemm needs {what} ({width}) to be a "
                    f"multiple of {per_row} (rows of 16 bytes in {self.params_dtype})")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """For each layer (0-based), whether it is a mixture of experts."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    @property
    def local_seq_length(self) -> int:
        """Tokens of each sequence a context-parallel rank holds (all of them without)."""
        return self.seq_length // self.context_parallel_size

    def _resolve_families(self) -> None:
        """The Llama family's options, in both peers' spellings, checked and resolved."""
        names = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
        require(self.normalization.lower() in names,
                f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        set_field(self, "normalization", names[self.normalization.lower()])
        heads, tp = self.num_attention_heads, self.tensor_model_parallel_size
        # One field holds the groups: set only with grouped-query attention (a count given
        # alone, Megatron-DeepSpeed's --num-key-value-heads, turns it on; one per head is
        # plain multi-head attention), so a model made from this one with other heads keeps
        # its meaning.
        if self.num_query_groups == heads and not self.group_query_attention:
            set_field(self, "num_query_groups", None)
        set_field(self, "group_query_attention", self.num_query_groups is not None)
        groups = self.query_groups
        positive(self, "rope_scaling_factor")
        require(groups > 0, f"--num-query-groups must be positive, got {groups}")
        require(heads % groups == 0,
                f"--num-attention-heads ({heads}) is not divisible by --num-query-groups "
                f"({groups})")
        require(groups % tp == 0,
                f"--num-query-groups ({groups}) is not divisible by "
                f"--tensor-model-parallel-size ({tp}): each tensor rank holds whole groups")

    def _resolve_recompute(self) -> None:
        one_of(self, "recompute_granularity", (None, "full", "selective"))
        if self.recompute_granularity == "full":
            require(self.recompute_method in ("uniform", "block"),
                    "--recompute-granularity full needs --recompute-method uniform or block, "
                    f"got {self.recompute_method!r}")
        else:
            require(self.recompute_method is None,
                    f"--recompute-method ({self.recompute_method}) applies only to "
                    "--recompute-granularity full, not "
                    f"{self.recompute_granularity or 'unset'}")
            set_field(self, "recompute_num_layers", None)

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by x tp (Megatron)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def projection_size(self) -> int:
        """Width of the attention's queries (and its output): kv_channels x heads."""
        return self.kv_channels * self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups with grouped-query attention, else one per
        query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        """Width of the attention's keys (and of its values): kv_channels x query groups."""
        return self.kv_channels * self.query_groups

    @property
    def params_dtype(self):
        """The dtype of the model's parameters: fp16, bf16 or fp32."""
        return precision_dtype(self.fp16, self.bf16)
