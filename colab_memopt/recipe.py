"""The recipe: which memory-saving techniques a training step applies.

One dataclass, read by the training step (`train.make_train_step`), by `recipe.build` (which
prepares the model and optimizer) and by the planner (`plan`), so a measurement and a prediction of
the same recipe run the same code. Each technique notebook adds its fields here, each with its
allowed values checked in `validate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from colab_memopt.train import OPTIMIZERS, make_optimizer


@dataclass(frozen=True)
class Recipe:
    """Techniques applied to a training step. The defaults are plain fp32 training with AdamW.

    Attributes:
        optimizer: an optimizer name known to `train.make_optimizer`.
        lr: learning rate (> 0).
        attention: None keeps the model's attention; 'sdpa', 'naive' or 'semiseparable' (notebook 13:
            causal semiseparable sequence mixing, parameter-free so it swaps in place) sets it
            (reference model only).
    """

    optimizer: str = "adamw"
    lr: float = 1e-3
    attention: str | None = None
    # notebook 14 (phases.py): None trains ordinarily; a strategy name ('none', 'cpu', 'pinned_cpu',
    # 'int8', 'drop') trains phase-aware (full and predicted steps) with that optimizer-state offload.
    phase_offload: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value is not allowed."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"recipe.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"recipe.lr must be > 0, got {self.lr}")
        if self.attention not in (None, "sdpa", "naive", "semiseparable"):
            raise ValueError(
                f"recipe.attention must be None, 'sdpa', 'naive' or 'semiseparable', got {self.attention!r}"
            )

        from colab_memopt.phases import OFFLOAD_STRATEGIES

        if self.phase_offload is not None and self.phase_offload not in OFFLOAD_STRATEGIES:
            raise ValueError(
                f"recipe.phase_offload must be None or one of {OFFLOAD_STRATEGIES}, got {self.phase_offload!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Recipe:
        """Return a recipe from a dict, rejecting unknown fields by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown recipe field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def with_(self, **changes: Any) -> Recipe:
        """Return a copy with fields changed (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as a plain dict."""
        return asdict(self)

    def build(self, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Apply the recipe's model-side techniques and return (model, optimizer)."""
        if self.attention is not None:
            if not hasattr(model, "blocks"):
                raise ValueError("recipe.attention applies to the reference model only; leave it None")
            for block in model.blocks:
                block.attn.attention = self.attention
        return model, make_optimizer(self.optimizer, [p for p in model.parameters() if p.requires_grad], lr=self.lr)
