"""The memory budget on paper: bytes per parameter and activations per layer.

Every figure here is a formula with its source; notebooks put it next to a measurement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from colab_memopt.techniques.models import GPT, GPTConfig
from colab_memopt.techniques.optimizers import steps_in_backward
from colab_memopt.core.console import quiet

# Bytes per parameter of the model states (weights, gradients, optimizer state) in mixed-precision
# AdamW training, as the literature counts them. They differ in what they include.
MODEL_STATE_CONVENTIONS = {
    "zero": (16, "ZeRO paper (Rajbhandari et al. 2020): 2 fp16 weights + 2 fp16 grads + 12 fp32 master, m, v"),
    "megatron": (18, "Megatron / stas00's ML Engineering book: as ZeRO plus fp32 gradients (+2 net)"),
    "zero_infinity": (20, "ZeRO-Infinity (Rajbhandari et al. 2021): as ZeRO plus fp32 gradient copy"),
    "accelerate_fp16": (8, "Accelerate estimate-memory for fp16 training: the largest component, not the sum"),
}

# Optimizer-state bytes per parameter element for fp32 parameters (PyTorch's implementations).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}
# Notebook 06 (lean optimizers): nominal bytes per parameter of large matrices (exact counts below).
# 8-bit states: 1 byte per value plus a 4-byte absmax per block of 256 (Dettmers et al. 2022,
# bitsandbytes); Lion keeps one momentum (Chen et al. 2023); Adam-mini keeps m and one v per block
# (Zhang et al. 2024); Adafactor keeps a row and a column vector per matrix, no m (Shazeer & Stern 2018).
OPTIMIZER_STATE_BYTES.update({
    "adafactor": 0, "adam8bit": 2, "adamw8bit": 2, "paged_adamw8bit": 2, "lion8bit": 1, "lion": 4, "adam_mini": 4,
})
# Notebook 16: LOMO keeps no state; AdaLomo an fp32 row and column vector per matrix (exact count below).
OPTIMIZER_STATE_BYTES.update({"lomo": 0, "adalomo": 0})
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit state for tensors with fewer elements
BNB_BLOCKSIZE = 256  # values per absmax block of the 8-bit optimizer states
BNB_QMAP_BYTES = 256 * 4  # the 8-bit code book, one per state, shared by all tensors of an optimizer


def fp32_training_bytes_per_param(optimizer: str = "adamw") -> int:
    """Return the bytes per parameter of plain fp32 training: 4 weights + 4 gradients + optimizer state."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    return 4 + 4 + OPTIMIZER_STATE_BYTES[optimizer]


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def param_bytes(params: Iterable[torch.Tensor]) -> int:
    """Return the bytes of the given parameters, each shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in _unique(params))


# Optimizers whose float32 `step` counter torch keeps on the CPU when the parameters are on CUDA (not
# fused, not capturable: the project's default; torch/optim/adam.py `_init_group`, _adafactor.py).
HOST_STEP_OPTIMIZERS = ("adam", "adamw", "adafactor")


def optimizer_state_split(params: Iterable[Any], optimizer: str, *, device: str | torch.device,
                          n_head: int | None = None) -> dict[str, int]:
    """Return the optimizer-state bytes by where they live when training on `device`: {'device', 'host'}.

    On CUDA, torch's Adam, AdamW and Adafactor keep their 4-byte `step` tensor per parameter tensor
    on the CPU ('host'); everything else is device memory. bitsandbytes' paged states are unified
    memory that lives on the GPU while the optimizer runs: counted as 'device' (`measure_step` reports
    them the same way). On the CPU everything is 'device'.

    Example:
        >>> optimizer_state_split(model.parameters(), "adamw", device="cuda")  # {'device': 8N, 'host': 4 * tensors}
    """
    items = list(params)
    total = optimizer_state_bytes(items, optimizer, n_head=n_head)
    host = 0
    if torch.device(device).type == "cuda" and optimizer.removesuffix("_in_backward") in HOST_STEP_OPTIMIZERS:
        host = 4 * sum(1 for p in _unique(p[1] if isinstance(p, tuple) else p for p in items) if p.requires_grad)
    return {"device": total - host, "host": host}


def optimizer_state_bytes(params: Iterable[torch.Tensor], optimizer: str, *, n_head: int | None = None,
                          model: torch.nn.Module | None = None, rank: int | None = None) -> int:
    """Return the exact optimizer-state bytes the optimizer allocates for these parameters (wherever they live).

    Adam and AdamW keep exp_avg and exp_avg_sq in the parameter's dtype plus a 4-byte float32
    `step` tensor per parameter tensor; SGD with momentum keeps one momentum buffer; SGD nothing.
    Lion keeps one momentum. Adafactor keeps a float32 step, and per matrix a row and a column
    vector (per 1-D tensor a full variance). bitsandbytes' 8-bit optimizers keep uint8 states with a
    float32 absmax per 256 values and a shared 256-entry code book per state, and 32-bit states for
    tensors under 4096 elements. Adam-mini needs (name, parameter) pairs and `n_head`.
    A name ending in '_in_backward' counts one optimizer per parameter (code books per tensor).
    On CUDA part of this lives in host memory: `optimizer_state_split` says which part.
    The optimizers with almost no state (GaLore, APOLLO, torchao's low-bit AdamW, BAdam) are counted by
    `lowstate.state_bytes`: `model` picks the projected weights and BAdam's blocks, `rank` the projection rank.
    """
    in_backward = optimizer.endswith("_in_backward")
    base = optimizer[: -len("_in_backward")] if in_backward else optimizer
    from colab_memopt.techniques.lowstate import LOW_STATE_OPTIMIZERS, state_bytes

    if base in LOW_STATE_OPTIMIZERS:
        return state_bytes(base, params, rank=rank, model=model, per_parameter=in_backward)
    if base not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    items = list(params)
    named = [it for it in items if isinstance(it, tuple)]
    if base == "adam_mini":
        if len(named) != len(items):
            raise ValueError("adam_mini needs (name, parameter) pairs, e.g. model.named_parameters()")
        from colab_memopt.techniques.optimizers import adam_mini_blocks

        seen, total = set(), 0
        for name, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                blocks = adam_mini_blocks(name, p, n_head=n_head)
                total += 4 * p.numel() + 4 * (p.numel() if blocks is None else blocks) + 4
        return total
    ps = [p for p in _unique(p[1] if isinstance(p, tuple) else p for p in items) if p.requires_grad]
    elems = sum(p.numel() * p.element_size() for p in ps)
    if base in ("adam", "adamw"):
        return 2 * elems + 4 * len(ps)
    if base in ("sgd_momentum", "lion"):
        return elems
    if base == "adalomo":  # lomo-optim 0.1.1: per matrix fp32 rows + columns, per 1-D tensor a full fp32 vector
        return sum(4 * (p.shape[0] + p.shape[1] if p.dim() >= 2 else p.numel()) for p in ps)
    if base == "adafactor":
        return sum(4 + 4 * (p.shape[-2] + p.shape[-1] if p.dim() >= 2 else p.numel()) for p in ps)
    if base in ("adam8bit", "adamw8bit", "paged_adamw8bit", "lion8bit"):
        n_states = 1 if base == "lion8bit" else 2
        total, any_8bit = 0, 0
        for p in ps:
            if p.numel() >= BNB_MIN_8BIT_SIZE:
                total += n_states * (p.numel() + 4 * -(-p.numel() // BNB_BLOCKSIZE))
                any_8bit += 1
            else:
                total += n_states * 4 * p.numel()
        code_books = any_8bit if in_backward else min(any_8bit, 1)
        return total + n_states * BNB_QMAP_BYTES * code_books
    return 0


def block_activation_bytes(
    config: GPTConfig, batch: int, seq: int, *, bytes_per_value: int = 4, attention: str | None = None
) -> int:
    """Return the bytes one block of the reference model keeps for backward (no recomputation).

    Counted from what PyTorch's autograd saves in `models.Block` (units of s*b*h values):
    LayerNorm outputs 2, qkv 3, attention output 1, residual stream after attention 1 and after the
    MLP 1, MLP up-projection and GELU outputs 2*r; LayerNorm mean and rstd (fp32, 2 per norm).
    SDPA adds its log-sum-exp (b*a*s fp32); naive attention adds the softmax output (a*s^2*b values)
    and the causal mask (s^2 bool). Checked to the byte against the tensor tracker in the tests.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    attention = attention or config.attention
    b, s, h, a, r = batch, seq, config.d_model, config.n_head, config.mlp_ratio
    total = (8 + 2 * r) * s * b * h * bytes_per_value + 2 * 2 * b * s * 4
    if attention == "sdpa":
        total += a * b * s * 4
    elif attention == "naive":
        total += a * s * s * b * bytes_per_value + s * s
    else:
        raise ValueError(f"attention must be 'sdpa' or 'naive', got {attention!r}")
    return total


def korthikanti_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *, flash: bool = False) -> int:
    """Return Korthikanti et al. (2022)'s activation bytes per transformer layer: s*b*h*(34 + 5*a*s/h).

    Their count assumes 16-bit activations, 1-byte dropout masks and no recomputation;
    memory-efficient (flash) attention removes the 5*a*s/h term.
    """
    sbh = seq * batch * hidden
    return 34 * sbh + (0 if flash else 5 * heads * seq * seq * batch)


@dataclass
class StepEstimate:
    """The analytic estimate of one training step: peak and its split, like a trace's."""

    peak_bytes: int
    by_category: dict[str, int]
    by_phase: dict[str, int]
    phase_categories: dict[str, dict[str, int]]


def _dims(model: torch.nn.Module) -> dict[str, int]:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: cannot estimate its activations")

    def first(*names: str, default: int | None = None) -> int:
        for n in names:
            value = getattr(config, n, None)
            if value is not None:
                return int(value)
        if default is None:
            raise ValueError(f"{type(model).__name__}.config has none of {names}")
        return default

    hidden = first("d_model", "hidden_size", "n_embd")
    heads = first("n_head", "num_attention_heads")
    return {
        "hidden": hidden,
        "layers": first("n_layer", "num_hidden_layers"),
        "heads": heads,
        "kv_heads": first("num_key_value_heads", default=heads),
        "inter": first("intermediate_size", "n_inner", default=4 * hidden) if not isinstance(model, GPT) else model.config.mlp_ratio * hidden,
        "vocab": first("vocab_size"),
    }


def activation_bytes(model: torch.nn.Module, batch: int, seq: int, *, bytes_per_value: int = 4,
                     checkpointing: bool = False) -> int:
    """Return the activations one forward keeps for backward (without recomputation by default).

    Exact per block for the reference model (`block_activation_bytes`); for other transformers an
    approximation from the config: per token and layer 7h + 3h_kv + 4i values with a gated MLP
    (LLaMA-style), 8h + 2i without, plus logits and the loss's log-softmax (b*s*V each).
    With `checkpointing` (each block recomputed in backward, Korthikanti et al. 2022 full
    recomputation): each block's input (b*s*h values) plus one block's activations.
    """
    d = _dims(model)
    b, s, h = batch, seq, d["hidden"]
    if isinstance(model, GPT):
        blocks = d["layers"] * block_activation_bytes(model.config, b, s, bytes_per_value=bytes_per_value)
    else:
        gated = any(name.endswith(("gate_proj", "gate_up_proj")) for name, _ in model.named_modules())
        kv_h = h * d["kv_heads"] // d["heads"]
        per_token = (7 * h + 3 * kv_h + 4 * d["inter"]) if gated else (8 * h + 2 * d["inter"])
        # Under autocast (2-byte values) transformers models keep the residual stream and the norms in fp32 and
        # save 16-bit copies of the linear inputs besides: traced, about 4.5 bytes per value, not 2 (small llama and
        # phi3 configs: 5152 and 4896 bytes per token and layer against 4376 and 4632 in fp32).
        blocks = d["layers"] * b * s * per_token * (bytes_per_value if bytes_per_value == 4 else 4.5)
        blocks = int(blocks)
    if checkpointing:
        blocks = d["layers"] * b * s * h * bytes_per_value + blocks // d["layers"]
    embeddings_and_head = 3 * b * s * h * bytes_per_value + head_logit_values(model) * b * s * d["vocab"] * bytes_per_value
    return blocks + embeddings_and_head + eager_attention_bytes(model, b, s, layers=1 if checkpointing else None)


def head_logit_values(model: torch.nn.Module) -> int:
    """Return how many (b, s, vocab) tensors the forward keeps for the loss: the logits and our GPT's log-softmax (2);
    transformers models keep the logits only (their loss's log-softmax is a temporary of the loss backward)."""
    return 2 if isinstance(model, GPT) else 1


def eager_attention_bytes(model: torch.nn.Module, batch: int, seq: int, *, layers: int | None = None) -> int:
    """Return the attention scores a transformers model with eager attention keeps (0 for SDPA and our GPT).

    Eager attention (transformers' default where SDPA cannot apply, e.g. Gemma-2's soft-capped scores)
    saves the fp32 softmax of each layer's (b, heads, s, s) scores, and with `attn_logit_softcapping`
    the tanh's output too; while one layer computes, its raw and masked scores are alive besides
    (2 more). Per the trace of a small Gemma-2 at 1024 tokens: 5.5 such tensors for 2 layers, here 6.
    """
    config = getattr(model, "config", None)
    if isinstance(model, GPT) or getattr(config, "_attn_implementation", None) != "eager":
        return 0
    d = _dims(model)
    scores = batch * d["heads"] * seq * seq * 4  # fp32: transformers' eager softmax runs in float32
    saved = 2 if getattr(config, "attn_logit_softcapping", None) else 1
    return (d["layers"] if layers is None else layers) * saved * scores + 2 * scores


def _recipe_params(model: torch.nn.Module, recipe: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Return (parameters, trainable parameters, parameter bytes) of `model` as `recipe` would leave it.

    Notebook 07: with `recipe.quantization` (phase 'all') every nn.Linear but the output layer counts
    `quantized_weight_bytes`; with `recipe.lora_rank` r, each Linear named in `recipe.lora_targets`
    gets two fp32 adapters (r x in, out x r: shape-only meta tensors), the only trainable parameters.
    """
    params = _unique(model.parameters())
    scheme = getattr(recipe, "quantization", None) if getattr(recipe, "quantization_phase", "all") == "all" else None
    rank = int(getattr(recipe, "lora_rank", 0) or 0)
    if scheme is None and rank == 0:
        return params, [p for p in params if p.requires_grad], param_bytes(params)
    quantized, adapters, q_bytes = set(), [], 0
    targets = tuple(getattr(recipe, "lora_targets", ()))
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if scheme is not None and "lm_head" not in name and id(mod.weight) not in quantized:
            quantized.add(id(mod.weight))
            q_bytes += quantized_weight_bytes(mod.weight.numel(), scheme, out_features=mod.out_features)
        if rank and name.rpartition(".")[2] in targets:
            adapters += [torch.empty(rank, mod.in_features, device="meta", requires_grad=True),
                         torch.empty(mod.out_features, rank, device="meta", requires_grad=True)]
    rest = [p for p in params if id(p) not in quantized]
    trainable = adapters if rank else [p for p in rest if p.requires_grad]
    rest_bytes = param_bytes(rest)
    if rank and getattr(recipe, "base_dtype", None) is not None:  # LoRA's frozen base stored in 16-bit: 2 bytes
        rest_bytes //= 2
    return params, trainable, q_bytes + rest_bytes + param_bytes(adapters)


def _matmul_outputs_per_token(block: torch.nn.Module, rank: int, targets: tuple[str, ...], *, four_bit: bool) -> int:
    """Return the values per token that the matmuls of one block output: each linear layer's out_features.

    Leaf modules with an `out_features` count (nn.Linear, bitsandbytes' 8-bit layers, `Int8Linear`, peft's
    lora_A and lora_B), transformers' Conv1D by its `nf`; with `rank` > 0 each Linear named in `targets`
    counts the adapters `Recipe.build` would add besides: lora_A's r and lora_B's out_features. A 4-bit
    layer (`four_bit`: the recipe quantizes to nf4/fp4; or a bitsandbytes Linear4bit) adds nothing of its
    own: bitsandbytes (0.50) computes it with its custom op `gemm_4bit`, not a matmul that
    `checkpointing.SAVE_OPS` saves, so its output is recomputed; its adapters still count.
    """
    total = 0
    for name, mod in block.named_modules():
        if next(mod.children(), None) is not None:
            continue  # a wrapper (peft's lora.Linear): its base layer and adapters count
        out = getattr(mod, "nf", None) if type(mod).__name__ == "Conv1D" else getattr(mod, "out_features", None)
        if not isinstance(out, int):
            continue
        adapter = ".lora_" in f".{name}"  # peft's lora_A.default, lora_B.default
        is_4bit = any(c.__name__ == "Linear4bit" for c in type(mod).__mro__)
        if adapter or not (is_4bit or (four_bit and isinstance(mod, torch.nn.Linear))):
            total += out
        if rank and isinstance(mod, torch.nn.Linear) and name.rpartition(".")[2] in targets:
            total += rank + out
    return total


def selective_saved_bytes(model: torch.nn.Module, batch: int, seq: int, recipe: Any, *, bytes_per_value: int) -> int:
    """Return the bytes selective checkpointing keeps inside one checkpointed block, besides its input.

    `checkpointing.SAVE_OPS`: the output of every matmul (one per linear layer, out_features values per
    token, LoRA's r and out_features per adapted layer) and of the attention kernel, at `bytes_per_value`:
    SDPA's output (heads x head_dim per token) and its fp32 log-sum-exp (heads per token); naive and
    eager attention's two batched matmuls instead, the (heads, s, s) scores and the output. Averaged
    over the model's block stacks (`checkpointing.find_block_stacks`; a one-layer model's list of one
    block), a block of each measured.
    """
    from colab_memopt.techniques.checkpointing import find_block_stacks

    d = _dims(model)
    config = model.config
    try:
        stacks = find_block_stacks(model)
    except ValueError:  # one layer (capacity's scaled models start there): a list of one block is no stack
        stacks = [m for m in model.modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) and next(m[0].children(), None) is not None][:1]
        if not stacks:
            raise
    rank = int(getattr(recipe, "lora_rank", 0) or 0)
    targets = tuple(getattr(recipe, "lora_targets", ()))
    four_bit = (getattr(recipe, "quantization", None) in ("nf4", "fp4")
                and getattr(recipe, "quantization_phase", "all") == "all")
    linear = sum(len(s) * _matmul_outputs_per_token(s[0], rank, targets, four_bit=four_bit)
                 for s in stacks) // sum(len(s) for s in stacks)
    if isinstance(model, GPT):
        attn_out, naive = d["hidden"], (getattr(recipe, "attention", None) or config.attention) == "naive"
    else:
        head_dim = getattr(config, "head_dim", None) or d["hidden"] // d["heads"]
        attn_out, naive = d["heads"] * head_dim, getattr(config, "_attn_implementation", None) == "eager"
    per_token = (linear + attn_out) * bytes_per_value
    per_token += d["heads"] * seq * bytes_per_value if naive else d["heads"] * 4  # the scores, else the log-sum-exp
    return batch * seq * per_token


def training_step_bytes(model: torch.nn.Module, batch: int, seq: int, recipe: Any) -> StepEstimate:
    """Return the analytic peak of one training step of `model` (built on any device, 'meta' too).

    Forward ends with parameters, optimizer state and all activations alive (gradients were freed
    by `zero_grad(set_to_none=True)`); backward trades activations for gradients; the optimizer step
    holds parameters, gradients, state and about one parameter tensor's worth of temporaries.
    The recipe's fields are applied by rule: pure bf16 halves weights, gradients and state; autocast
    stores activations at 2 bytes; checkpointing keeps each checkpointed block's input (s*b*h) plus
    one block ('offload': two inputs, the rest in host RAM; 'selective': each block's matmul and
    attention outputs too, `selective_saved_bytes`, and of one block only what those leave out);
    `loss_chunk_tokens` replaces the full logits by one chunk's (fp32) and their gradient; accumulation divides activations by the micro-batches; quantization stores the block
    linear weights by `quantized_weight_bytes`; LoRA trains r*(in+out) values per adapted layer only.
    The planner uses this where a step cannot be traced, and prints it beside every trace.
    """
    elem = 2 if getattr(recipe, "precision", "fp32") in ("bf16", "fp16") else 4
    params, trainable, p_bytes = _recipe_params(model, recipe)
    if elem == 2:  # pure bf16 / fp16: weights, gradients and optimizer state at 2 bytes
        p_bytes //= 2
    from colab_memopt.techniques.lowstate import LOW_STATE_OPTIMIZERS, state_bytes

    low_state = recipe.optimizer.removesuffix("_in_backward")
    if low_state == "badam":  # BAdam: one block trains at a time; the others are frozen
        from colab_memopt.techniques.lowstate import badam_blocks

        trainable = max(badam_blocks(model)[1], key=lambda block: sum(p.numel() for p in block))
    g_bytes = param_bytes(trainable) * elem // 4
    if low_state in LOW_STATE_OPTIMIZERS:  # exact per dtype: 8-bit and master-copy states do not halve in bf16
        o_bytes = state_bytes(low_state, trainable, rank=getattr(recipe, "optimizer_rank", None), model=model,
                              per_parameter=recipe.optimizer.endswith("_in_backward"), element_size=elem)
    elif recipe.optimizer == "adam_mini" and not getattr(recipe, "lora_rank", 0):
        o_bytes = optimizer_state_bytes(list(model.named_parameters()), "adam_mini", n_head=_dims(model)["heads"]) * elem // 4
    else:
        o_bytes = optimizer_state_bytes(trainable, recipe.optimizer)
        if recipe.optimizer != "adalomo":  # AdaLomo's state is fp32 whatever the weights
            o_bytes = o_bytes * elem // 4
    if getattr(recipe, "rounding_mode", None) == "kahan":  # one 16-bit compensation buffer per trainable weight
        o_bytes += param_bytes(trainable) // 2
    largest = max((p.numel() * elem for p in trainable), default=0)
    precision = getattr(recipe, "precision", "fp32")
    value_bytes = 2 if precision in ("bf16", "fp16", "bf16-autocast", "fp16-autocast") else 4
    micro = -(-batch // max(1, getattr(recipe, "accumulation_steps", 1)))
    act = activation_bytes(model, micro, seq, bytes_per_value=value_bytes)
    policy = getattr(recipe, "checkpointing", "none")
    recomputed = 0  # the one block checkpointing recomputes in backward: not alive yet when the loss backward starts
    if policy != "none" or getattr(recipe, "compression_checkpointing", False):
        d = _dims(model)
        per_block = (act - 3 * micro * seq * d["hidden"] * value_bytes
                     - head_logit_values(model) * micro * seq * d["vocab"] * value_bytes) // max(1, d["layers"])
        kept = d["layers"] // max(1, getattr(recipe, "checkpoint_interval", 1)) if policy == "every_n" else d["layers"]
        # 'offload' keeps the inputs in host RAM: on the device, the one recomputed and the one loaded ahead.
        # With checkpoint_interval N, a segment's N - 1 inner block inputs too, while backward recomputes it.
        inner = min(max(1, getattr(recipe, "checkpoint_interval", 1)), d["layers"]) - 1
        on_device = min(2, kept) + inner if policy == "offload" else kept
        recomputed = per_block
        kept_bytes = on_device * micro * seq * d["hidden"] * value_bytes
        if policy == "selective":  # each block keeps its matmul and attention outputs too, and recomputes the rest
            saved = selective_saved_bytes(model, micro, seq, recipe, bytes_per_value=value_bytes)
            kept_bytes += kept * saved
            recomputed = max(0, per_block - saved)
        act -= kept * per_block - (kept_bytes + recomputed)
    chunk = getattr(recipe, "loss_chunk_tokens", None)
    chunk = 128 if chunk == "auto" else chunk  # the planner's first plan of 'auto' (loss.DEFAULT_CHUNK_TOKENS)
    if chunk is not None:  # notebook 17: one chunk's fp32 logits and their gradient, plus the hidden states' gradient
        d = _dims(model)
        act += (2 * min(chunk, micro * seq) * d["vocab"] * 4 + micro * seq * d["hidden"] * value_bytes
                - head_logit_values(model) * micro * seq * d["vocab"] * value_bytes)
    if steps_in_backward(getattr(recipe, "optimizer", "")):
        g_bytes = largest  # each gradient is freed once its parameter steps
    stage = getattr(recipe, "zero_stage", 0)
    if stage:  # notebook 10, one process (fp32): what the DeepSpeed engine adds, measured (planner_accuracy.py --zero)
        from colab_memopt.techniques.zero import DEFAULT_BUCKET_ELEMENTS

        o_bytes += param_bytes(trainable)  # the fp32 master partition the inner AdamW steps, beside the weights
        # the gradients go to one flat reduce bucket of DEFAULT_BUCKET_ELEMENTS values (stage 3 keeps its partition too)
        g_bytes = DEFAULT_BUCKET_ELEMENTS * 4 + (g_bytes if stage == 3 else 0)
    # Notebook 10, ZeRO-Offload: the optimizer state (and with offload_param the weights, but the
    # gathered layer) live in host RAM; the planner adds their host bytes (zero_offload_bytes).
    if getattr(recipe, "offload_optimizer", False):
        o_bytes = 0
    if getattr(recipe, "offload_param", False):
        p_bytes = g_bytes = 2 * largest
    # 8-bit trainable weights (int8train): int8 matrices + fp32 group scales, the rest 16-bit
    if getattr(recipe, "weight_dtype", None) == "int8":
        from colab_memopt.techniques.int8train import int8_weight_bytes

        p_bytes, largest = int8_weight_bytes(model)
        g_bytes = 2 * largest  # one matrix's 16-bit gradient, and its dequantized weight beside it (temporaries)
    forward = {"parameters": p_bytes, "optimizer_state": o_bytes, "activations": act}
    backward = {"parameters": p_bytes, "optimizer_state": o_bytes, "gradients": g_bytes, "activations": act // 2, "temporaries": largest}
    if not isinstance(model, GPT) and chunk is None:
        # transformers' loss backward: every activation still alive, and the fp32 gradients of the log-softmax and of
        # the logits (b, s, V) beside them, before any weight gradient exists (the traces of small llama, phi3 and
        # gpt_neox configs peak there when the vocabulary is large against the width)
        loss_start = {"parameters": p_bytes, "optimizer_state": o_bytes, "activations": act - recomputed,
                      "temporaries": 2 * micro * seq * _dims(model)["vocab"] * 4}
        if sum(loss_start.values()) > sum(backward.values()):
            backward = loss_start
    optimizer = {"parameters": p_bytes, "optimizer_state": o_bytes, "gradients": g_bytes, "temporaries": 2 * largest}
    phases = {"forward": forward, "backward": backward, "optimizer": optimizer}
    totals = {p: sum(c.values()) for p, c in phases.items()}
    peak_phase = max(totals, key=totals.get)
    by_category = {c: phases[peak_phase].get(c, 0) for c in ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "other")}
    return StepEstimate(totals[peak_phase], by_category, totals, phases)


def quantized_weight_bytes(numel: int, scheme: str, *, out_features: int = 1, blocksize: int = 64) -> int:
    """Return the bytes of one weight matrix of `numel` values stored with `scheme`.

    'fp32' 4 B/value, 'fp16' 2; 'int8_tensor' 1 B/value + one fp32 scale; 'int8_channel' + one fp32
    scale per output row; 'bnb_int8' (LLM.int8, Dettmers et al. 2022): int8 + one fp32 scale per row;
    'nf4'/'fp4' (QLoRA, Dettmers et al. 2023): 4 bits/value + one fp32 absmax per `blocksize` values.
    """
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if scheme == "fp32":
        return 4 * numel
    if scheme == "fp16":
        return 2 * numel
    if scheme == "int8_tensor":
        return numel + 4
    if scheme in ("int8_channel", "bnb_int8"):
        return numel + 4 * out_features
    if scheme in ("nf4", "fp4"):
        return -(-numel // 2) + 4 * -(-numel // blocksize)
    raise ValueError(f"unknown scheme {scheme!r}; choose fp32, fp16, int8_tensor, int8_channel, bnb_int8, nf4 or fp4")


def qlora_model_state_bytes(n_params: float, *, lora_params: float, weight_bits: int = 4, blocksize: int = 64,
                            double_quant: bool = True) -> float:
    """Return the model-state bytes of QLoRA fine-tuning (Dettmers et al. 2023), activations excluded.

    Frozen base at `weight_bits` with one absmax per `blocksize` values (fp32, or 8-bit with a second
    level per 256 blocks under double quantization: 0.127 bits/param instead of 0.5); LoRA adapters in
    16-bit with 16-bit gradients and 8 B of fp32 Adam state each.
    """
    constants = (8 / blocksize + 32 / (blocksize * 256)) if double_quant else 32 / blocksize
    base = n_params * (weight_bits + constants) / 8
    return base + lora_params * (2 + 2 + 8)
# -- notebooks 11-12: monitoring, OOM diagnosis, data pipeline --------------------------------------
def training_peak_bytes(
    config: GPTConfig,
    batch: int,
    seq: int,
    *,
    optimizer: str = "adamw",
    attention: str | None = None,
    bytes_per_value: int = 4,
    checkpointing: bool = False,
    optimizer_bytes_per_param: float | None = None,
) -> int:
    """Return the paper estimate of one training step's peak for the reference model, in bytes.

    Model states (fp32 weights and gradients, optimizer state: `OPTIMIZER_STATE_BYTES`, or
    `optimizer_bytes_per_param` for e.g. 8-bit Adam's 2) plus activations: each block's
    `block_activation_bytes` (with `checkpointing`, only each block's input, s*b*h values, plus one
    block recomputed: Korthikanti et al. 2022, full recomputation), the embedding output and the
    output layer's logits, their log-softmax and its gradient (3*b*s*V values). An upper-side
    estimate: the real peak never holds all of these at once; notebook 12 compares it with a
    measurement.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATE_BYTES)}")
    if bytes_per_value not in (2, 4):
        raise ValueError(f"bytes_per_value must be 2 or 4, got {bytes_per_value}")
    n = config.n_params
    opt_bpp = OPTIMIZER_STATE_BYTES[optimizer] if optimizer_bytes_per_param is None else optimizer_bytes_per_param
    states = int(n * (4 + 4 + opt_bpp))
    block = block_activation_bytes(config, batch, seq, bytes_per_value=bytes_per_value, attention=attention)
    if checkpointing:
        blocks = config.n_layer * batch * seq * config.d_model * bytes_per_value + block
    else:
        blocks = config.n_layer * block
    head = 3 * batch * seq * config.vocab_size * bytes_per_value + batch * seq * config.d_model * bytes_per_value
    return states + blocks + head


def dataloader_prefetch_bytes(
    num_workers: int, prefetch_factor: int, batch_size: int, seq_len: int, bytes_per_token: int = 2
) -> int:
    """Return the host RAM of batches a DataLoader holds prefetched: workers x prefetch x batch x seq x bytes.

    PyTorch's DataLoader keeps `prefetch_factor` batches in flight per worker
    (https://pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader); the default counts
    2-byte tokens (ids below 65,536). Token ids as int64 take 8 bytes.
    """
    for name, value in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor),
                        ("batch_size", batch_size), ("seq_len", seq_len), ("bytes_per_token", bytes_per_token)):
        if not isinstance(value, int) or value < (0 if name == "num_workers" else 1):
            raise ValueError(f"{name} must be an integer >= {0 if name == 'num_workers' else 1}, got {value!r}")
    return num_workers * prefetch_factor * batch_size * seq_len * bytes_per_token
# -- notebook 13: semiseparable matrices (structured.py) ----------------------------------------------


def semiseparable_bytes(n: int, rank: int, *, band_bytes: int = 4, lowrank_bytes: int = 4) -> int:
    """Return the storage of tridiagonal + rank-r: (3N - 2) band values and 2 N r factor values.

    With r = ceil(log2 N) the saving against a dense N x N matrix is 1 - (3N + 2Nr) / N^2 at 4 bytes
    each: the "98.8% vs dense" (N = 2048, fp32) and "99.3% mixed precision" (fp16 factors) claims
    that notebook 13 checks.
    """
    if n < 2 or rank < 1:
        raise ValueError(f"n must be >= 2 and rank >= 1, got n={n}, rank={rank}")
    return (3 * n - 2) * band_bytes + 2 * n * rank * lowrank_bytes


def hierarchical_semiseparable_bytes(n: int, rank: int, num_levels: int, *, bytes_per_value: int = 4) -> int:
    """Return the storage of the multi-level form: 2 off-diagonal rank-r blocks per split, leaves tridiagonal + rank r.

    Each level stores about 2 N r values, the leaves N (3 + 2 r): O(N r L), so O(N log N) with
    r = log2 N and a fixed number of levels, O(N log^2 N) when the levels grow as log N.
    """
    if num_levels == 0:
        return semiseparable_bytes(n, min(rank, n), band_bytes=bytes_per_value, lowrank_bytes=bytes_per_value)
    m = n // 2
    r = min(rank, m, n - m)
    return (
        2 * (m * r + (n - m) * r) * bytes_per_value
        + hierarchical_semiseparable_bytes(m, rank, num_levels - 1, bytes_per_value=bytes_per_value)
        + hierarchical_semiseparable_bytes(n - m, rank, num_levels - 1, bytes_per_value=bytes_per_value)
    )


def max_trainable_params(device_bytes: int, bytes_per_param: float) -> int:
    """Return how many parameters fit in `device_bytes` at `bytes_per_param` (activations not counted)."""
    if device_bytes <= 0 or bytes_per_param <= 0:
        raise ValueError(f"device_bytes and bytes_per_param must be > 0, got {device_bytes}, {bytes_per_param}")
    return int(device_bytes // bytes_per_param)


# -- notebook 14: phase-aware training (phases.py) ----------------------------------------------------


def phase_device_bytes(
    n_params: int,
    phase: str,
    *,
    weight_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    predictor_bytes: int = 2,
    offload_optimizer: bool = True,
) -> int:
    """Return the model-state bytes on the device in a 'full' or 'predict' step (activations not counted).

    Full: weights + gradients + optimizer state (unless offloaded to the host) + the predictor's
    moving average of updates. Predict: weights + predictor; gradients are freed, the optimizer
    state is offloaded. Defaults: mixed-precision AdamW as the ZeRO paper counts it (2 + 2 + 12).
    """
    if phase not in ("full", "predict"):
        raise ValueError(f"phase must be 'full' or 'predict', got {phase!r}")
    if n_params < 1:
        raise ValueError(f"n_params must be >= 1, got {n_params}")
    per_param = weight_bytes + predictor_bytes
    if phase == "full":
        per_param += grad_bytes + (0 if offload_optimizer else optimizer_bytes)
    return n_params * per_param
def precision_state_bytes_per_param(precision: str, optimizer: str = "adamw", *, update_rounding: str | None = None) -> int:
    """Return the model-state bytes per parameter (weights + gradients + optimizer state) under `precision`.

    Autocast ('fp16-autocast', 'bf16-autocast') keeps fp32 weights, fp32 gradients and fp32 optimizer
    state: the same 16 B/param as fp32 with AdamW (its 16-bit weight copies are per-step temporaries).
    Pure 'bf16' stores all three in bf16: 2 + 2 + 4 = 8 B/param with AdamW (PyTorch keeps the state
    in the parameter's dtype). Source: PyTorch's autocast and AdamW implementations; cf. the 16-20
    B/param conventions in `MODEL_STATE_CONVENTIONS`, which add a 16-bit weight copy.
    Pure 'fp16' likewise (its optimizer state in bf16, `rounding.UpdateRounding`);
    `update_rounding='kahan'` adds the 2-byte compensation buffer (10 B/param with AdamW).
    """
    from colab_memopt.techniques.precision import PURE_PRECISIONS, check_precision

    check_precision(precision)
    fp32 = fp32_training_bytes_per_param(optimizer)
    if precision not in PURE_PRECISIONS:
        return fp32
    return fp32 // 2 + (2 if update_rounding == "kahan" else 0)


def attention_scores_bytes(seq: int, heads: int, *, batch: int = 1, bytes_per_value: int = 4) -> int:
    """Return the bytes of one materialised attention score matrix per layer: b*a*s^2 values.

    Naive attention keeps the softmax of it for backward (and briefly the scores and their gradient);
    memory-efficient kernels keep none of it. The literature's "8 GB per layer for 32 heads at 8192
    tokens" is this with batch 1 in fp32.
    """
    if seq < 1 or heads < 1 or batch < 1:
        raise ValueError(f"seq, heads and batch must be >= 1, got seq={seq}, heads={heads}, batch={batch}")
    return batch * heads * seq * seq * bytes_per_value


# -- notebooks 09-10: CPU offload and DeepSpeed ZeRO ------------------------------------------------


def zero_offload_bytes(n_params: int, *, zero_stage: int, offload_optimizer: bool, offload_param: bool = False,
                       largest_layer_params: int = 0, world_size: int = 1) -> dict[str, int]:
    """Return DeepSpeed's own estimate of model-state bytes on the device and in host RAM, per rank.

    Stage 1-2: `deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`
    (with optimizer offload about 24 B/param of host RAM at 1.5x buffers: fp32 master, m, v, grads;
    the device keeps the 2-byte weights); stage 3: `stage3.estimate_zero3_model_states_mem_needs`
    (`largest_layer_params` sizes the gathered layer). Without offload at stage 0 the device holds
    DeepSpeed's 16 B/param of mixed-precision AdamW and the host nothing.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if offload_param and zero_stage != 3:
        raise ValueError(f"offload_param needs zero_stage=3, got {zero_stage}")
    if zero_stage == 0:
        return {"device_bytes": 16 * n_params, "host_bytes": 0}
    largest = largest_layer_params or n_params // 10
    try:
        if zero_stage in (1, 2):
            with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
                from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            host, device = estimate_zero2_model_states_mem_needs(n_params, num_gpus_per_node=world_size, num_nodes=1,
                                                                 cpu_offload=offload_optimizer)
        else:
            with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
                from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            host, device, _ = estimate_zero3_model_states_mem_needs(n_params, largest, num_gpus_per_node=world_size,
                                                                    num_nodes=1, cpu_offload=offload_optimizer,
                                                                    cpu_offload_params=offload_param)
    except ImportError:  # Colab has no DeepSpeed: the same formulas, copied (tests pin them to DeepSpeed's)
        host, device = _deepspeed_estimate(n_params, zero_stage, offload_optimizer, offload_param, largest, world_size)
    return {"device_bytes": int(device), "host_bytes": int(host)}


def _deepspeed_estimate(n: int, stage: int, offload_optimizer: bool, offload_param: bool, largest: int,
                        gpus: int, buffer_factor: float = 1.5) -> tuple[int, int]:
    """Return (host, device) bytes by DeepSpeed 0.19's `estimate_zero{2,3}_model_states_mem_needs` (one node, zero_init)."""
    if stage in (1, 2):
        if offload_optimizer:
            return int(n * max(4 * gpus, 16) * buffer_factor), 2 * n
        return int(n * 4 * gpus * buffer_factor), 2 * n + int(18 * n / gpus)
    layer = 4 * largest
    if offload_optimizer:
        if offload_param:
            return int(n * 18 * buffer_factor), layer
        return int(n * 16 * buffer_factor), layer + int(2 * n / gpus)
    return int(largest * 4 * gpus * buffer_factor), layer + int(18 * n / gpus)


def layer_streaming_param_bytes(block_bytes: int, n_blocks: int, resident_bytes: int, *, max_active_layers: int,
                                prefetch_distance: int) -> int:
    """Return the device bytes of weights under layer streaming: resident weights plus active and prefetched blocks."""
    if n_blocks < 1 or max_active_layers < 1 or prefetch_distance < 0:
        raise ValueError(f"need n_blocks >= 1, max_active_layers >= 1, prefetch_distance >= 0; got "
                         f"{n_blocks}, {max_active_layers}, {prefetch_distance}")
    return resident_bytes + min(n_blocks, max_active_layers + prefetch_distance) * block_bytes


def model_state_bytes(model: torch.nn.Module, recipe: Any) -> int:
    """Return the exact model-state bytes left after a training step of `model` as `recipe.build` made it.

    Weights (in their stored dtypes), the gradients the step leaves alive (none for an optimizer that
    steps inside backward: '*_in_backward', LOMO, AdaLomo) and the optimizer state
    (`optimizer_state_bytes` of the weights as they are: pure 16-bit weights keep 16-bit state,
    `rounding.UpdateRounding` stores it in bf16), plus the Kahan compensation buffers (one per
    trainable 16-bit weight) under `recipe.rounding_mode == 'kahan'`.

    Example:
        >>> model, opt = recipe.build(build_model("small"))
        >>> model_state_bytes(model, recipe) / count_parameters(model)  # 16.0 for fp32 AdamW
    """
    params = _unique(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = 0 if steps_in_backward(recipe.optimizer) else sum(p.numel() * p.element_size() for p in trainable)
    if recipe.optimizer == "adam_mini":
        state = optimizer_state_bytes(list(model.named_parameters()), "adam_mini", n_head=_dims(model)["heads"])
    else:
        state = optimizer_state_bytes(trainable, recipe.optimizer)
    if getattr(recipe, "rounding_mode", None) == "kahan":
        state += sum(p.numel() * p.element_size() for p in trainable if p.dtype in (torch.float16, torch.bfloat16))
    if getattr(recipe, "weight_dtype", None) == "int8" and recipe.optimizer == "adalomo":  # int8train: fp32 rows + columns
        state += sum(4 * (p.shape[0] + p.shape[1]) for p in params if p.dtype == torch.int8)
    return weights + grads + state
