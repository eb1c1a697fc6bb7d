"""Trained weights are sacred in every recipe: after a step, what a notebook does with a model works or refuses.

For every recipe that builds on the tiny model (one per field, `test_recipe.FIELD_SAMPLES`): build, take a step,
then read the weights, print them, `copy.deepcopy` the model, `state_dict` -> `torch.save` -> `torch.load` ->
compare (and load into a fresh model built the same way), evaluate and generate, and build again. Each action
either works, leaving the trained weights as they were, or refuses with an error that says what to do
(`REFUSALS`); nothing may kill the process. The layer-streaming recipes run in a child process, so that a
segfault fails their test instead of ending pytest. DeepSpeed's recipes need a process group and are checked
in tests/test_zero.py; `optimizer_state_offload` is refused by every recipe (tests/test_recipe.py).
"""

from __future__ import annotations

import copy
import io
import math
import os
import subprocess
import sys

import pytest
import torch

import colab_memopt as cm
from colab_memopt.techniques.evaluation import generate
from test_recipe import FIELD_MODELS, FIELD_SAMPLES, SELECTORS

RECIPES = {name: values for name, (values, _) in sorted(FIELD_SAMPLES.items())
           if not values.keys() & SELECTORS and name != "optimizer_state_offload"}
STREAMED = {name for name, values in RECIPES.items() if values.get("layer_offload_active")}
_MATERIALIZE = "opt.streamer.materialize()"
# (recipe, action) -> what the refusal must say; any other action must work
REFUSALS = {
    **{(name, action): _MATERIALIZE for name in STREAMED for action in ("read", "print", "deepcopy", "build again")},
    ("weight_dtype", "build again"): "already built with weight_dtype='int8'",
}
# what undoes a refused "build again", after which the actions work again (None: build on a fresh model)
UNDO = {name: lambda model, opt: opt.streamer.materialize() for name in STREAMED}
BATCH, SEQ = 2, 32


def _snapshot(model: torch.nn.Module, *, frozen_4bit: bool = False) -> dict[str, torch.Tensor]:
    """The model's state; without `frozen_4bit`, less the frozen 4-bit layers' packed weights and quantization state:
    bitsandbytes repacks those on a CPU with AVX512-bf16 at the first forward in eval mode (an inference layout whose
    absmax is bf16, not double-quantized), which moves the frozen base by bf16 rounding. No trained weight is there."""
    four_bit = () if frozen_4bit else tuple(f"{n}.weight" for n, m in model.named_modules()
                                            if type(m).__name__ == "Linear4bit")
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.startswith(four_bit or ("\0",))}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check(name: str) -> None:
    """Run every action on recipe `name` after a step; raise AssertionError naming the first that misbehaves."""
    corpus = cm.load_corpus()
    torch.manual_seed(0)
    recipe = cm.Recipe(**RECIPES[name])
    new_model = FIELD_MODELS.get(name, lambda: cm.build_model("tiny"))  # a field for Llama's RMSNorm: a tiny Llama
    model, opt = recipe.build(new_model())
    before = _snapshot(model)
    cm.make_train_step(model, opt, corpus, batch_size=BATCH, seq_len=SEQ, recipe=recipe)()
    trained = _snapshot(model)
    assert not _same(before, trained), f"{name}: the step changed no weight"

    def evaluate(m: torch.nn.Module) -> float:
        return cm.evaluate(recipe.forward_model(m), corpus, batch_size=BATCH, seq_len=SEQ, batches=1,
                           precision=recipe.forward_precision())

    def save_load() -> None:
        now = _snapshot(model, frozen_4bit=True)
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert _same({k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, now), "saved != the model's"
        assert _same(_snapshot(model), trained), "saved, the model's weights are not the trained ones"
        other = new_model()
        with torch.no_grad():  # other initial weights, built the same way
            for p in other.parameters():
                p.add_(1.0)
        fresh, _ = recipe.build(other)
        fresh.load_state_dict(loaded)
        assert _same(_snapshot(fresh, frozen_4bit=True), now), "a fresh model loaded from the saved state differs"
        assert evaluate(fresh) == evaluate(model), "the loaded model evaluates differently"

    def deepcopy() -> None:
        twin = copy.deepcopy(model)
        assert _same(_snapshot(twin), trained) and evaluate(twin) == evaluate(model)

    def build_again() -> None:
        again, opt2 = recipe.build(model)
        cm.make_train_step(again, opt2, corpus, batch_size=BATCH, seq_len=SEQ, recipe=recipe)()

    actions = {
        "read": lambda: all(math.isfinite(float(p.float().sum())) for p in model.parameters()) or 1 / 0,
        "print": lambda: [repr(model), *(repr(p) for p in model.parameters())],
        "deepcopy": deepcopy,
        "save and load": save_load,
        "evaluate": lambda: math.isfinite(evaluate(model)) or 1 / 0,
        "generate": lambda: generate(recipe.forward_model(model), "the", max_new_tokens=3,
                                        precision=recipe.forward_precision()),
    }

    def attempt(action: str, fn) -> bool:
        want = REFUSALS.get((name, action))
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an unexpected failure is the finding
            assert want is not None and want in str(exc), f"{name}: {action} failed: {type(exc).__name__}: {exc}"
            return False
        assert want is None, f"{name}: {action} worked where a refusal naming {want!r} was expected"
        return True

    for action, fn in actions.items():
        attempt(action, fn)
        assert _same(_snapshot(model), trained), f"{name}: {action} changed the trained weights"
    if not attempt("build again", build_again) and name in UNDO:
        UNDO[name](model, opt)  # the call the refusal named; then every action works on the trained weights
        assert _same(_snapshot(model), trained), f"{name}: undoing changed the trained weights"
        for action, fn in actions.items():
            fn()
        build_again()


@pytest.mark.parametrize("name", sorted(set(RECIPES) - STREAMED))
def test_trained_weights_survive_every_action_or_it_is_refused_by_name(name):
    check(name)


@pytest.mark.parametrize("name", sorted(STREAMED))
def test_streamed_recipes_refuse_by_name_and_never_kill_the_process(name):
    # a child process: reading a streamed parameter used to SIGSEGV (reliability probe 3, rows 345-391)
    tests = os.path.dirname(__file__)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"import test_recipe_weights as t; t.check({name!r})"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tests)
    assert done.returncode == 0, f"exit {done.returncode} (-11: segfault)\n{done.stderr[-3000:]}"
