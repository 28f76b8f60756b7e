"""Model shapes as data. Weights are random at these shapes (no hub downloads), which leaves every
byte count and timing unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from directkv.errors import unknown_name


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "llama" (RMSNorm, RoPE, GQA, gated MLP) or "opt" (LayerNorm, learned positions, MLP)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype_bytes: int = 2  # bf16 weights and KV
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        if self.family not in ("llama", "opt"):
            raise ValueError(f"family must be 'llama' or 'opt', got {self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- parameters and bytes -------------------------------------------------------------
    def layer_params(self) -> int:
        h, q, kv, f = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        if self.family == "llama":
            attn = h * q + 2 * h * kv + q * h
            mlp = 3 * h * f
            norms = 2 * h
        else:
            attn = (h * q + q) + 2 * (h * kv + kv) + (q * h + h)
            mlp = (h * f + f) + (f * h + h)
            norms = 4 * h
        return attn + mlp + norms

    def embedding_params(self) -> int:
        v, h = self.vocab_size, self.hidden_size
        if self.family == "llama":
            return 2 * v * h + h  # untied embedding and LM head, final norm
        return v * h + (self.max_context + 2) * h + 2 * h  # tied head, learned positions, final LN

    def weight_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params()

    def weight_bytes(self) -> int:
        return self.weight_params() * self.dtype_bytes

    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.kv_dim * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer()

    # ---- FLOPs -------------------------------------------------------------------------------
    def linear_flops_per_token(self) -> int:
        """Matmul FLOPs of one token through every layer's projections and MLP plus the LM head."""
        h, q, kv, f = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        per_layer = 2 * (h * q + 2 * h * kv + q * h) + 2 * (3 if self.family == "llama" else 2) * h * f
        return self.num_layers * per_layer + 2 * h * self.vocab_size

    def attention_flops(self, q_len: int, kv_len: int) -> int:
        """QK^T and PV FLOPs of one layer for q_len queries against kv_len keys (no causal discount)."""
        return 4 * self.num_heads * self.head_dim * q_len * kv_len


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072),
        # OPT's learned position table has 2048 rows upstream; the paper runs OPT to 32K context,
        # so the random-weight table here is sized to 32768 positions.
        ModelSpec("opt-6.7b", "opt", 32, 4096, 32, 32, 128, 16384, 50272, 32768),
        ModelSpec("opt-13b", "opt", 40, 5120, 40, 40, 128, 20480, 50272, 32768),
        ModelSpec("opt-30b", "opt", 48, 7168, 56, 56, 128, 28672, 50272, 32768),
        ModelSpec("tiny", "llama", 2, 256, 8, 2, 32, 512, 1024, 8192),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise unknown_name("model", name, MODELS) from None
