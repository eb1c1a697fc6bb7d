"""Real architectures, built from their published dimensions with random weights (no download).

The dimensions are typed from each model's published `config.json`; only shapes matter here, so the
models are built on the `meta` device or under fake tensors for planning, or small ones for real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from colab_memopt.models import MODEL_SIZES, build_model


@dataclass(frozen=True)
class Architecture:
    """A transformers architecture: its class names and config values."""

    name: str
    family: str  # 'llama', 'qwen2', 'gpt2'
    config: dict[str, Any]
    source: str

    def build(self) -> nn.Module:
        """Return the model with random weights on the current default device."""
        import transformers

        config_cls, model_cls = _CLASSES[self.family]
        config = getattr(transformers, config_cls)(**self.config)
        return getattr(transformers, model_cls)(config)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.get("max_position_embeddings", self.config.get("n_positions", 1024)))


_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}


def _llama(hidden, inter, layers, heads, kv, vocab, tied, positions, **extra):
    return dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=positions, **extra
    )


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        Architecture("gpt2", "gpt2", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
                     "openai-community/gpt2 config.json"),
        Architecture("smollm2-135m", "llama", _llama(576, 1536, 30, 9, 3, 49152, True, 8192),
                     "HuggingFaceTB/SmolLM2-135M config.json"),
        Architecture("smollm2-360m", "llama", _llama(960, 2560, 32, 15, 5, 49152, True, 8192),
                     "HuggingFaceTB/SmolLM2-360M config.json"),
        Architecture("smollm2-1.7b", "llama", _llama(2048, 8192, 24, 32, 32, 49152, True, 8192),
                     "HuggingFaceTB/SmolLM2-1.7B config.json"),
        Architecture("qwen2.5-0.5b", "qwen2", _llama(896, 4864, 24, 14, 2, 151936, True, 32768),
                     "Qwen/Qwen2.5-0.5B config.json"),
        Architecture("qwen2.5-1.5b", "qwen2", _llama(1536, 8960, 28, 12, 2, 151936, True, 32768),
                     "Qwen/Qwen2.5-1.5B config.json"),
        Architecture("llama-3.2-1b", "llama", _llama(2048, 8192, 16, 32, 8, 128256, True, 131072),
                     "meta-llama/Llama-3.2-1B config.json"),
        Architecture("llama-3.2-3b", "llama", _llama(3072, 8192, 28, 24, 8, 128256, True, 131072),
                     "meta-llama/Llama-3.2-3B config.json"),
        Architecture("llama-3.1-8b", "llama", _llama(4096, 14336, 32, 32, 8, 128256, False, 131072),
                     "meta-llama/Llama-3.1-8B config.json"),
    ]
}


def model_names() -> list[str]:
    """Return every model name `model_factory` accepts: reference sizes, then real architectures."""
    return [*MODEL_SIZES, *ARCHITECTURES]


def model_factory(name: str, **overrides: Any) -> Callable[[], nn.Module]:
    """Return a zero-argument function that builds the named model with random weights.

    Reference sizes ('tiny' ... '1b') build `models.GPT` (overrides are config fields); real
    architectures ('llama-3.2-1b', 'qwen2.5-0.5b', ...) build the transformers model.
    """
    if name in MODEL_SIZES:
        return lambda: build_model(name, device="cpu", **overrides)
    if name in ARCHITECTURES:
        if overrides:
            raise ValueError(f"overrides apply to reference sizes only, got {sorted(overrides)} for {name!r}")
        return ARCHITECTURES[name].build
    raise ValueError(f"unknown model {name!r}; choose one of {model_names()}")


def max_seq_len(name: str) -> int:
    """Return the longest sequence the named model accepts."""
    if name in MODEL_SIZES:
        return MODEL_SIZES[name].seq_len
    if name in ARCHITECTURES:
        return ARCHITECTURES[name].max_seq_len
    raise ValueError(f"unknown model {name!r}; choose one of {model_names()}")
