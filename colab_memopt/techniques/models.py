"""The reference model: a small GPT-style decoder in plain PyTorch, with named sizes.

It follows the transformers calling convention, `model(input_ids, labels=input_ids)` returns an
object with `.loss` and `.logits` (labels are shifted inside), so a notebook can swap in a
transformers model without changing its training step. With `model.loss_chunk_tokens` set, the loss
is computed by chunks (`colab_memopt.techniques.loss`) and `.logits` is None whenever labels are given.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from colab_memopt.techniques.attention import attend
from colab_memopt.techniques.loss import causal_lm_loss, head_weight
from colab_memopt.techniques.structured import causal_semiseparable_mixing

ATTENTION_IMPLS = ("sdpa", "naive", "semiseparable")


@dataclass(frozen=True)
class GPTConfig:
    """Dimensions of the reference decoder.

    Attributes:
        n_layer: transformer blocks.
        d_model: hidden size (h in the activation formulas).
        n_head: attention heads (a).
        seq_len: longest sequence the position table holds (s).
        vocab_size: 256 for the byte-level corpus; larger sizes use GPT-2's 50257 for planning.
        attention: 'sdpa' (PyTorch's fused kernels), 'naive' (materialises the T x T scores) or
            'semiseparable' (a causal rank-d mixing matrix computed by chunks, no T x T; notebook 13).
        mlp_ratio: MLP hidden size over d_model.
    """

    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    seq_len: int = 64
    vocab_size: int = 256
    attention: str = "sdpa"
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")

    @property
    def n_params(self) -> int:
        """Return the parameter count (tied input and output embeddings counted once)."""
        d, L, V, T, r = self.d_model, self.n_layer, self.vocab_size, self.seq_len, self.mlp_ratio
        per_block = (
            2 * 2 * d  # two LayerNorms (weight, bias)
            + d * 3 * d + 3 * d  # qkv
            + d * d + d  # attention output
            + d * r * d + r * d  # MLP up
            + r * d * d + d  # MLP down
        )
        return V * d + T * d + L * per_block + 2 * d


MODEL_SIZES: dict[str, GPTConfig] = {
    # Trains in well under a second per step on 2 CPU cores: what CI runs.
    "tiny": GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=64),
    "small": GPTConfig(n_layer=4, d_model=128, n_head=4, seq_len=128),
    "medium": GPTConfig(n_layer=6, d_model=256, n_head=8, seq_len=256),
    "large": GPTConfig(n_layer=8, d_model=512, n_head=8, seq_len=512),
    # Published GPT-2 dimensions (Radford et al. 2019), byte vocabulary replaced by GPT-2's.
    "gpt2-small": GPTConfig(n_layer=12, d_model=768, n_head=12, seq_len=1024, vocab_size=50257),
    "gpt2-medium": GPTConfig(n_layer=24, d_model=1024, n_head=16, seq_len=1024, vocab_size=50257),
    "gpt2-large": GPTConfig(n_layer=36, d_model=1280, n_head=20, seq_len=1024, vocab_size=50257),
    # About 1.2B parameters: for planning, not for training on a T4 in fp32.
    "1b": GPTConfig(n_layer=22, d_model=2048, n_head=16, seq_len=2048, vocab_size=32000),
}


def get_config(size: str | GPTConfig, **overrides: object) -> GPTConfig:
    """Return the config of a named size (or a config), with fields overridden."""
    if isinstance(size, GPTConfig):
        config = size
    elif size in MODEL_SIZES:
        config = MODEL_SIZES[size]
    else:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)} or pass a GPTConfig")
    return replace(config, **overrides) if overrides else config


@dataclass
class CausalLMOutput:
    """What the model returns, like transformers' CausalLMOutput.

    `logits` is None when the loss was computed by chunks (`GPT.loss_chunk_tokens`): the full
    (B, T, V) logits were never built.
    """

    loss: torch.Tensor | None
    logits: torch.Tensor | None


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (fused SDPA or naive), or semiseparable sequence mixing."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.attention = config.attention
        self.window: int | None = None  # sliding-window attention in tokens (notebook 05); None: full causal
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.attention == "semiseparable":
            if self.window is not None:
                raise ValueError("a sliding window applies to 'sdpa' and 'naive' attention, not 'semiseparable'")
            y = causal_semiseparable_mixing(q, k, v)  # same q, k, v projections; no T x T matrix
        else:
            y = attend(q, k, v, impl=self.attention, window=self.window)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Two linear layers with GELU between."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.down = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, blocks, final LayerNorm, tied head.

    Set `loss_chunk_tokens` to an integer (tokens per chunk) to compute the loss with
    `colab_memopt.techniques.loss.causal_lm_loss` when labels are given: the (B, T, V) logits and their gradient
    are never held, and the output's `logits` is None. None (the default) keeps the plain loss.

    Example:
        >>> model = build_model("tiny"); model.loss_chunk_tokens = 128
        >>> model(ids, labels=ids).loss.backward()  # same loss and gradients, logits None
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.loss_chunk_tokens: int | None = None  # None: plain loss; an int: chunked loss (tokens per chunk)
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.config.seq_len}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)  # (B, T, C)
        chunk = self.loss_chunk_tokens
        if chunk is not None:
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
                raise ValueError(f"loss_chunk_tokens must be None or an integer >= 1 (tokens per chunk), got {chunk!r}")
            if type(self.lm_head) is not nn.Linear and not hasattr(self.lm_head, "dequantized"):
                # a quantized head has no plain weight to chunk over (an int8-trained one dequantizes it: int8train)
                raise ValueError(f"loss_chunk_tokens needs lm_head to be an nn.Linear, got {type(self.lm_head).__name__}")
            if labels is not None:
                loss = causal_lm_loss(x, head_weight(self.lm_head), labels, bias=self.lm_head.bias, chunk_tokens=chunk)
                return CausalLMOutput(loss=loss, logits=None)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if labels is not None:
            # Predict token t+1 from tokens <= t, as transformers' causal LMs do.
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
            )
        return CausalLMOutput(loss=loss, logits=logits)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Return the number of parameter elements, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _shapes_only() -> bool:
    """Return whether new tensors are meta or fake ones here (the planner builds the model so): nothing is allocated."""
    from torch._subclasses.fake_tensor import FakeTensor

    probe = torch.empty(0)
    return probe.device.type == "meta" or isinstance(probe, FakeTensor)


def _check_host_room(config: GPTConfig, dtype: torch.dtype | None) -> None:
    """Refuse, before allocating, a model whose fp32 weights alone exceed the host RAM this process may use.

    Under the meta device or fake tensors (the planner) nothing is allocated, and nothing is refused.
    """
    import resource

    from colab_memopt.core.env import host_memory

    if _shapes_only():
        return

    need = config.n_params * 4  # bytes: built in fp32 on the CPU, then cast
    room = host_memory().available_bytes
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        room = min(room, soft)
    if need > room:
        raise ValueError(
            f"this config has {config.n_params:,} parameters: {need / 2**30:.1f} GiB of fp32 weights, more than the "
            f"{room / 2**30:.1f} GiB of host RAM available (n_layer={config.n_layer}, d_model={config.d_model}, "
            f"seq_len={config.seq_len}, vocab_size={config.vocab_size}); build it with device='meta' to plan it"
        )


def build_model(
    size: str | GPTConfig = "tiny",
    *,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    **overrides: object,
) -> GPT:
    """Build the reference model with seeded random weights.

    Args:
        size: a name from `MODEL_SIZES` or a `GPTConfig`.
        device: where the weights live ('auto', 'cpu', 'cuda', or 'meta' to allocate nothing).
        dtype: weight dtype (default float32).
        seed: the weights' seed; the global RNG is left as it was.
        **overrides: config fields to change, e.g. `attention="naive"`, `seq_len=256`.

    Example:
        >>> model = build_model("tiny", attention="naive")
    """
    config = get_config(size, **overrides)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float16, or None, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if device != "meta":
        _check_host_room(config, dtype)
    if device == "meta":
        with torch.device("meta"):
            model = GPT(config)
    else:
        from colab_memopt.core.env import pick_device

        dev = pick_device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT(config)  # initialised on the CPU: the same weights whatever the device
        if dev.type != "cpu" and not _shapes_only():  # under meta or fake tensors (a plan) there is nothing to move
            model = model.to(dev)
    if dtype is not None:
        model = model.to(dtype)
    return model
