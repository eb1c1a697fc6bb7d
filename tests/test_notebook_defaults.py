"""Notebooks at their Colab defaults, checked on the CPU where the CPU reproduces what a GPU run found.

CI runs every notebook at CPU size (tests/notebook_parameters.yaml), so a default that only fails at
Colab size never ran before a GPU did (review cuda-run-1, #12-#16). Each test here runs a notebook's
own code (its parameters cell, then the cells or the statements of a cell it needs) at the defaults,
on fake tensors where the work is Colab-sized.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from types import SimpleNamespace

import pytest
import torch

import colab_memopt as cm
from colab_memopt.tooling.runner import NOTEBOOK_DIR

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def _cells(stem: str) -> dict[str, str]:
    """Return a notebook's code cells by id."""
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    return {c["id"]: "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"}


def _defaults(stem: str) -> dict:
    """Return the values of a notebook's `parameters` cell (its Colab defaults)."""
    nb = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    ns: dict = {}
    exec("".join(cell["source"]), ns)
    return {k: v for k, v in ns.items() if not k.startswith("__")}


def _free_names(stmt: ast.stmt) -> set[str]:
    """Return the names a statement reads that it does not bind itself."""
    loaded, stored = set(), set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name):
            (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
        elif isinstance(node, ast.arg):
            stored.add(node.arg)
    return loaded - stored


def _run(source: str, ns: dict, *, skip: frozenset[str] = frozenset(), stop: str | None = None) -> list[str]:
    """Execute the top-level statements of `source` whose inputs `ns` holds, in order, in `ns`.

    Function definitions always run; other statements run only when every name they read is bound and
    none is in `skip` (what the test leaves out: a reference run it does not need). Stops after the
    first statement whose text contains `stop`. Returns the text of the statements run.
    """
    done = []
    for stmt in ast.parse(source).body:
        text = ast.get_source_segment(source, stmt)
        unbound = _free_names(stmt) - set(ns) - set(dir(builtins))
        skipped = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)} & skip
        if isinstance(stmt, ast.FunctionDef) or not (unbound or skipped):
            exec(compile(ast.Module([stmt], []), "<notebook cell>", "exec"), ns)
            done.append(text)
        if stop is not None and stop in text:
            break
    return done


# -- #12 and its class: a model size too short for the notebook's seq_len ------------------------------------

SIZE_PARAMETER = re.compile(r"^(?:(\w+)_)?model_size$")
# (notebook, size parameter) whose model the notebook builds with more positions than the size has; the
# test named runs that code at the defaults.
WIDENED = {("03_activation_checkpointing", "claim_model_size"): "test_notebook_03_claim_model_takes_the_default_seq_len"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_default_model_sizes_take_the_default_seq_len(path):
    # `<x>_model_size` goes with `<x>_seq_len` where the notebook has one, else with `seq_len`.
    params = _defaults(path.stem)
    for name, size in params.items():
        match = SIZE_PARAMETER.match(name)
        if not match or not isinstance(size, str) or size not in cm.MODEL_SIZES:
            continue
        prefix = match.group(1)
        seq_name = f"{prefix}_seq_len" if prefix and f"{prefix}_seq_len" in params else "seq_len"
        if seq_name not in params:
            continue
        positions = cm.get_config(size).seq_len
        if positions >= params[seq_name]:
            continue
        assert (path.stem, name) in WIDENED, (
            f"{path.stem}: {name} = {size!r} has {positions} positions, but {seq_name} = {params[seq_name]}: the model "
            f"refuses the notebook's own sequences at its defaults")
        assert WIDENED[(path.stem, name)] in globals()


def test_notebook_03_claim_model_takes_the_default_seq_len(corpus):
    # Review cuda-run-1 #12: the claim model ('small', 128 positions) ran at seq_len 512 and raised at once.
    stem = "03_activation_checkpointing"
    params = _defaults(stem)
    assert cm.get_config(params["claim_model_size"]).seq_len < params["seq_len"]  # the case this test is about
    ns = {"cm": cm, "ckpt": cm.checkpointing, "dev": torch.device("cpu"), "corpus": corpus, **params}
    _run(_cells(stem)["cell-10"], ns, skip=frozenset({"reports"}))
    # Two of the claim's blocks: the positions, not the depth, are what failed.
    report = ns["measure_policy"]("none", layers=2, size=params["claim_model_size"])
    assert report.category_peaks["activations"] > 0


# -- #13: notebook 07's bound on the worst quantized value --------------------------------------------------

def test_notebook_07_quantization_check_allows_fp32_rounding():
    # Review cuda-run-1 #13: w / scale and q * scale in fp32 pass scale / 2 by up to 1e-5 of it (4 of these 10).
    from colab_memopt import quantization

    loop = next(s for s in ast.parse(_cells("07_weight_quantization")["cell-10"]).body if isinstance(s, ast.For))
    for seed in range(10):
        w = torch.randn(3072, 768, generator=torch.Generator().manual_seed(seed)) * 0.02
        exec(compile(ast.Module([loop], []), "<notebook 07>", "exec"),
             {"quantization": quantization, "w": w, "print": lambda *a, **k: None})


# -- #14: notebook 08's int8 saving at gpt2-small's vocabulary -----------------------------------------------

class _FakeCorpus:
    """Random token ids under fake tensors, shaped as the corpus gives them."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def batches(self, batch_size, seq_len, *, seed=0, device="cpu", split="train"):
        while True:
            yield torch.randint(0, self.vocab_size, (batch_size, seq_len), device=device)


def _fake_report(size: str, batch: int, seq_len: int, mode: str | None) -> cm.MemoryReport:
    """Return `measure_step`'s report of notebook 08's step, traced on fake tensors (no memory, no compute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True)):
        recipe = cm.Recipe(activation_compression=mode)
        model, opt = recipe.build(cm.build_model(size))
        step = cm.make_train_step(model, opt, _FakeCorpus(model.config.vocab_size), batch_size=batch,
                                  seq_len=seq_len, recipe=recipe)
        return cm.measure_step(step, model=model, optimizer=opt, label=str(mode), repeat=1)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_notebook_08_int8_assert_holds_at_colab_defaults():
    # Review cuda-run-1 #14: at gpt2-small, 8 x 512, half of the 4.57 GiB activation peak is logits and loss,
    # outside the blocks: int8 saves 34.4% of the peak (the old 40% threshold failed on every device).
    stem = "08_activation_compression"
    params = _defaults(stem)
    reports = {label: _fake_report(params["model_size"], params["batch_size"], params["seq_len"], mode)
               for label, mode in (("exact", None), ("int8_channel", "int8_channel"))}
    activation_peak = {k: r.category_peaks["activations"] for k, r in reports.items()}
    assert abs(activation_peak["exact"] / 2**30 - 4.574) < 0.001  # GiB, as the H100 measured
    ns = {"cm": cm, "reports": reports, "activation_peak": activation_peak, "base": activation_peak["exact"],
          "config": cm.get_config(params["model_size"]), "print": lambda *a, **k: None}
    ran = _run(_cells(stem)["cell-16"], ns, stop="assert int8")
    assert any(s.startswith("assert int8") for s in ran), ran
    assert 0.34 < ns["int8_saving"] < 0.35 and ns["int8_block_saving"] > 0.65


# -- #15: notebook 12 restores its micro-batch at the defaults ------------------------------------------------

@pytest.mark.filterwarnings("ignore")
def test_notebook_12_restores_the_micro_batch_at_colab_defaults():
    # Review cuda-run-1 #15: at budget 160 MiB micro-batch 32 sat at 96.4% of it, over the monitor's 95% critical
    # line: halved at step 1 and never restored. The cells run here as the notebook runs them (CPU, ~10-60 s).
    import matplotlib

    matplotlib.use("Agg")
    stem = "12_dynamic_batch_size_and_oom"
    cells = _cells(stem)
    ns = _defaults(stem)
    for cell in ("cell-06", "cell-08", "cell-10"):
        _run(cells[cell], ns)
    _run(cells["cell-12"], ns, skip=frozenset({"reference", "loss_max_abs_diff"}))
    ran = _run(cells["cell-20"], ns)
    assert sum(s.startswith("assert recovered.restores") for s in ran) == 1, ran
    assert ns["micro_start"] == 32 and ns["recovered"].micro_batch_sizes == [32, 32, 32, 16, 16, 16] + [32] * 6


# -- #16: notebook 16's LOMO bytes per parameter on CUDA ------------------------------------------------------

@pytest.mark.parametrize("device, measured, ok", [("cpu", 2.0, True), ("cpu", 2.0005, False), ("cuda", 2.0005, True),
                                                  ("cuda", 2.1, False)])
def test_notebook_16_lomo_check_is_exact_on_the_cpu_within_2pct_on_cuda(device, measured, ok):
    # Review cuda-run-1 #16: on the H100 LOMO printed 2.000 B/param but was not exactly 2.0; the check was exact on
    # every device. Its message names the resident bytes.
    cell = _cells("16_full_finetuning_on_a_t4")["af113ef7"]
    stmt = next(s for s in ast.parse(cell).body if ast.get_source_segment(cell, s).startswith('if "lomo" in results'))
    resident = {"parameters": 9_740_288, "gradients": 0, "optimizer_state": 0}
    ns = {"dev": torch.device(device), "bytes_per_param": {"lomo": measured, "adamw_fp32": 20.0},
          "results": {"lomo": (SimpleNamespace(resident_bytes=resident),)}}
    code = compile(ast.Module([stmt], []), "<notebook 16>", "exec")
    if ok:
        exec(code, ns)
    else:
        with pytest.raises(AssertionError, match="9740288"):
            exec(code, ns)
