"""Every notebook, found by itself: checked against the notebook standard, then executed headless.

The standard is written down in notebooks/README.md. Execution uses the CI parameters of
tests/notebook_parameters.yaml (the only place CI shrinks the work) within each notebook's budget.
"""

from __future__ import annotations

import ast
import json
import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")  # absent on a lent GPU machine without the notebook wheels

from colab_memopt import project
from colab_memopt.tooling.project import colab_url, install_command, notebook_extras
from colab_memopt.tooling.runner import CPU_PARAMS_FILE, NOTEBOOK_DIR, load_cpu_parameters, notebook_paths

REPO = NOTEBOOK_DIR.parent
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CPU_PARAMS = load_cpu_parameters(CPU_PARAMS_FILE)

# The standard's sections, in order (headings may say more after these words).
SECTIONS = (
    "Parameters",
    "Preflight",
    "The idea",
    "Baseline",
    "Asserts",
    "Explore",
    "When not to use it",
    "Use it in your own training",
    "Further reading",
    "Next",
    "Appendix: claims checked",
)
# Names only the authors can look up: a notebook, the README or a printed claim cites public sources instead.
INTERNAL_REFERENCE = re.compile(r"source document|seed 00[0-9]|\bissue [0-9]{1,2}\b|NSQL|Ava MoE", re.I)
# The metrics each notebook must record (from the issues that specify them).
REQUIRED_METRICS = {
    "00_where_the_memory_goes": {
        "param_bytes_measured", "param_bytes_expected", "optimizer_state_bytes_measured",
        "optimizer_state_bytes_expected", "activation_bytes_measured",
    },
    "01_will_it_fit": {"max_rel_error_pct", "configs_checked"},
    "06_lean_optimizers": {"state_bytes_per_param", "peak_saving_pct_8bit", "peak_saving_pct_fused", "final_loss"},
    "07_weight_quantization": {"weight_saving_pct_int8", "weight_saving_pct_nf4", "peak_saving_pct_qlora", "loss_delta_pct_qlora"},
    "08_activation_compression": {
        "activation_saving_pct_int8", "grad_rel_error_int8", "activation_saving_pct_int8_plus_checkpointing",
    },
    "09_cpu_offload": {"device_param_saving_pct", "slowdown_x", "optimizer_offload_saving_pct"},
    "10_deepspeed_zero": {"rank_state_bytes", "max_formula_rel_error_pct", "world_size"},
    "11_memory_profiling_and_monitoring": {"profiling_overhead_pct", "leak_detected_at_step", "spikes_found"},
    "12_dynamic_batch_size_and_oom": {"max_batch_found", "recoveries", "samples_lost", "loss_max_abs_diff"},
    "13_semiseparable_matrices": {
        "reduction_vs_dense_pct", "rel_error_structured", "rel_error_random", "hierarchical_growth_exponent",
        "layer_memory_saving_pct_longest", "loss_attention", "loss_semiseparable",
    },
    "14_phase_aware_training": {
        "predict_phase_saving_pct", "predicted_step_share", "loss_full_training", "loss_phase_training",
        "compute_saving_pct",
    },
    "02_mixed_precision": {"activation_saving_pct", "final_loss_fp32", "final_loss_mixed"},
    "16_full_finetuning_on_a_t4": {
        "bytes_per_param", "final_loss", "loss_gap_pct", "logits_saving_pct_chunked", "capacity_full_params",
    },
    "03_activation_checkpointing": {
        "activation_saving_pct_full", "time_overhead_pct_full", "activation_saving_pct_selective",
    },
    "04_gradient_accumulation": {"peak_saving_pct", "max_grad_rel_diff"},
    "15_fit_the_biggest_model": {
        "largest_full_params_512", "largest_qlora_params_longest", "recommended_slowdown", "costs_device",
        "baseline_oom", "final_loss_recommended", "technique_ratios",
    },
    "18_your_own_model": {
        "planned_peak_bytes", "measured_peak_bytes", "plan_rel_error_pct", "findings", "final_loss", "host_peak_bytes_load",
    },
    "17_long_context": {"logits_saving_pct_chunked", "checkpoint_offload_saving_pct", "max_seq_len", "host_bytes_at_max"},
    "05_memory_efficient_attention": {
        "attention_saving_pct_longest", "longest_seq", "naive_growth_exponent", "sdpa_growth_exponent",
    },
    "19_your_trainer_on_a_free_t4": {
        "draft_need_bytes", "fitted_need_bytes", "planned_peak_bytes", "measured_peak_bytes", "plan_rel_error_pct",
    },
}
PARAM_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def _ids(paths):
    return [p.stem for p in paths]


def _code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_notebooks_are_found():
    assert NOTEBOOKS, "no notebooks found in notebooks/"
    for path in NOTEBOOKS:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", path.name), f"{path.name}: name must be NN_topic.ipynb"


def test_parameters_file_names_real_notebooks_and_parameters():
    names = {p.stem for p in NOTEBOOKS}
    assert set(CPU_PARAMS) == names, "tests/notebook_parameters.yaml must have exactly one entry per notebook"
    for name, params in CPU_PARAMS.items():
        assert isinstance(params.get("budget_seconds"), (int, float)) and params["budget_seconds"] > 0, name
        nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
        declared = _parameters(nb)
        unknown = set(params) - {"budget_seconds"} - set(declared)
        assert not unknown, f"{name}: CI parameters {unknown} are not in the notebook's parameters cell"


def _parameters(nb) -> dict:
    cells = [c for c in _code(nb) if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "exactly one cell must be tagged 'parameters'"
    values = {}
    for node in ast.parse(cells[0].source).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name), (
            "the parameters cell holds plain assignments only"
        )
        # Plain values only: papermill injects after this cell, so a derived value would go stale.
        values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_follows_the_standard(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    rel = path.relative_to(REPO).as_posix()

    # Committed clean: no outputs, execution counts or widget state.
    assert "widgets" not in nb.metadata, "widget state in metadata"
    for cell in _code(nb):
        assert not cell.outputs and cell.execution_count is None, f"outputs committed in: {cell.source[:60]!r}"
    assert nb.metadata["kernelspec"]["name"] == "python3"

    # Title, then the badge generated from this path and the one repository URL.
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert f"({colab_url(rel)})" in nb.cells[1].source, "badge must point at this notebook's path"

    # The install cell installs only on Colab, before the first import of the package.
    sources = [c.source for c in _code(nb)]
    first_import = next(i for i, s in enumerate(sources) if re.search(r"^\s*(import|from) colab_memopt", s, re.M))
    install = next(i for i, s in enumerate(sources) if install_command(notebook_extras(path.stem)) in s)
    assert install < first_import and "google.colab" in sources[install]

    # Parameters: plain values, Colab defaults, results_dir None, device 'auto'.
    params = _parameters(nb)
    assert params.get("results_dir", "missing") is None and params.get("device") == "auto"
    assert all(PARAM_NAME.match(k) for k in params)

    # The standard's sections, in order.
    headings = [line[3:].strip() for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines() if line.startswith("## ")]
    positions = []
    for section in SECTIONS:
        found = [i for i, h in enumerate(headings) if h.lower().startswith(section.lower())]
        assert found, f"missing section '## {section}' (have {headings})"
        positions.append(found[0])
    assert positions == sorted(positions), f"sections out of order: {headings}"

    # The lesson ends before the appendix: the claims and the record come after the "Next" link, and the
    # notebook's last cell repeats that link (project.sync_notebook writes both).
    appendix = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Appendix: claims checked"))
    after = "\n".join(c.source for c in nb.cells[appendix:] if c.cell_type == "code")
    before = "\n".join(c.source for c in nb.cells[:appendix] if c.cell_type == "code")
    assert "cm.record(" in after and "cm.Claim(" in after, "claims and cm.record belong in the appendix"
    assert "cm.record(" not in before and "cm.Claim(" not in before, "the lesson comes first, the claims after it"
    assert nb.cells[-1].get("id") == "next" and "**Next:**" in nb.cells[-1].source

    code = "\n".join(sources)
    assert "cm.record(" in code and "widgets.panel(" in code and "\nassert " in "\n" + code
    assert "NBVAL_CHECK_OUTPUT" not in code, (
        "committed notebooks carry no outputs, so nbval has nothing to compare a checked cell with: assert instead"
    )
    for banned in ("max_memory_allocated", "reset_peak_memory_stats", 'to("cuda")', "to('cuda')", "if CI"):
        assert banned not in code, f"{banned!r}: measure through colab_memopt.core.measure, pick devices with device='auto'"


# What a notebook may show on stderr, each with why a learner sees it (newcomer review 4: torchao's, torch's, DeepSpeed's,
# bitsandbytes' and transformers' notes in every notebook). The libraries' notes go through cm.quiet(); what is
# left is listed here, and anything else fails the notebook's check below.
STDERR_ALLOWED: tuple[tuple[str, str], ...] = (
    (r"^\s*(\S.*: )?\s*\d+%\|[^|]*\| \d+/\d+ \[",
     "a progress bar (tqdm): loading weights, mapping a dataset, training; it shows that work is going on"),
    (r"FutureWarning: `(is_)?gradient_checkpointing(_kwargs|_enable)?` is deprecated and will be removed in v6",
     "transformers 5 renamed gradient_checkpointing to activation_checkpointing; the notebooks write the older "
     "name, the only one the transformers on Colab knows (5.x accepts it until v6), and peft calls the older one"),
    (r"^\s*(plan|plan_trainer|fit_trainer|recommend|doctor|context|longest sequence|largest batch): ",
     "the package's progress lines: a planning call that runs past 2 s says which plan or check it is on"),
    (r"UserWarning: Paged optimizers are not supported on CPU\. Falling back to non-paged",
     "bitsandbytes pages optimizer state on CUDA only: a run on a machine without a GPU says it falls back "
     "(not shown on Colab's T4)"),
)


def unexpected_stderr(records: list[dict]) -> list[str]:
    """Return the stderr lines (`[cell N] text`) that no entry of STDERR_ALLOWED explains. An indented line continues
    the line above it in the same cell (a warning's source line): it is allowed or reported with that line."""
    lines = []
    for record in records:
        above: bool | None = None  # whether the line above was allowed; None at the cell's first line
        for line in record["text"].splitlines():
            if not line.strip():
                continue
            own = any(re.search(pattern, line) for pattern, _ in STDERR_ALLOWED)
            if line[:1].isspace() and not own and above is not None:
                if not above:
                    lines[-1] += f" / {line.strip()[:200]}"
                continue
            above = own
            if not own:
                lines.append(f"[cell {record['cell']}] {line[:300]}")
    return lines


def test_the_stderr_allow_list_is_short_and_says_why():
    assert len(STDERR_ALLOWED) <= 5
    for pattern, why in STDERR_ALLOWED:
        re.compile(pattern)
        assert len(why.split()) >= 5, f"{pattern!r}: say why a learner sees it"
    # the lines newcomer review 4 found in every notebook are not allowed
    noise = [
        "Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
        "W1127 22:29:14.659000 10167 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass",
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'",
        "[2026-11-27 22:30:22,827] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "[transformers] `torch_dtype` is deprecated! Use `dtype` instead!",
        "You passed `model_init_kwargs` to the `SFTConfig`, but your model is already instantiated.",
        "UserWarning: Accessing the data pointer of FakeTensor is deprecated",
    ]
    assert unexpected_stderr([{"cell": 3, "text": "\n".join(noise)}]) == [f"[cell 3] {line}" for line in noise]
    bar = "Loading weights: 100%|██████████| 21/21 [00:00<00:00, 9841.38it/s]"
    assert unexpected_stderr([{"cell": 1, "text": bar + "\r" + bar.replace("100%", " 50%")}]) == []
    renamed = ("/x/transformers/training_args.py:1541: FutureWarning: `gradient_checkpointing` is deprecated and will "
               "be removed in v6. Use `activation_checkpointing` instead.\n  warnings.warn(f\"...\", FutureWarning)\n")
    other = "/x/peft/tuners/lora/model.py:12: UserWarning: something else\n  warnings.warn(\n"
    assert unexpected_stderr([{"cell": 2, "text": renamed}]) == []
    steps = ("fit_trainer: plan 1: your settings\nfit_trainer: plan 2: fp16=True, gradient_checkpointing=True,\n"
             "    gradient_checkpointing_kwargs={'use_reentrant': False}\n  largest batch: trace at batch 9\n")
    assert unexpected_stderr([{"cell": 5, "text": steps}]) == []
    assert unexpected_stderr([{"cell": 2, "text": renamed + other}, {"cell": 4, "text": "  indented first"}]) == [
        "[cell 2] /x/peft/tuners/lora/model.py:12: UserWarning: something else / warnings.warn(", "[cell 4]   indented first"]


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_shows_no_stderr_a_learner_cannot_act_on(path):
    """Every line the notebook's cells wrote to stderr in the nbval run is allowed by STDERR_ALLOWED
    (tests/nbval_budget.py records them in build/notebook_stderr.json)."""
    selection = os.environ.get("CM_NOTEBOOKS", "").split()
    if selection and path not in notebook_paths(selection):
        pytest.skip(f"not among NOTEBOOKS={' '.join(selection)}")
    stderr_file = REPO / "build" / "notebook_stderr.json"
    assert stderr_file.exists(), "run `make test` (or `make test-notebooks`): the notebooks have not been executed"
    records = json.loads(stderr_file.read_text())
    assert path.stem in records, f"{path.stem} was not executed"
    unexpected = unexpected_stderr(records[path.stem])
    assert not unexpected, f"{path.stem} wrote to stderr:\n" + "\n".join(unexpected[:20])


def test_no_cell_shows_a_stray_value():
    """A cell whose last line is `gc.collect()` shows the count it returns (notebook 19 showed `841`)."""
    for path in NOTEBOOKS:
        for cell in _code(nbformat.read(path, as_version=4)):
            source = re.sub(r"^(\s*)[!%].*$", r"\1pass", cell.source, flags=re.M)  # shell and magic lines
            body = ast.parse(source).body
            last = body[-1] if body else None
            assert not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                        and ast.unparse(last.value.func) == "gc.collect"), \
                f"{path.name}: a cell ends with {ast.unparse(last)}: its value is shown; assign it or move it up"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_ran_within_budget_and_recorded(path):
    """Check the nbval run of `make test` (each notebook executed once, with CI parameters)."""
    selection = os.environ.get("CM_NOTEBOOKS", "").split()  # `make test-notebooks NOTEBOOKS="10 13"` runs a few
    if selection and path not in notebook_paths(selection):
        pytest.skip(f"not among NOTEBOOKS={' '.join(selection)}")
    seconds_file = REPO / "build" / "notebook_seconds.json"
    assert seconds_file.exists(), "run `make test` (or `make test-notebooks`): the notebooks have not been executed"
    seconds = json.loads(seconds_file.read_text())
    assert path.stem in seconds, f"{path.stem} was not executed"
    budget = CPU_PARAMS[path.stem]["budget_seconds"]
    assert seconds[path.stem] <= budget, f"{path.stem} took {seconds[path.stem]:.0f} s, over its budget of {budget} s"
    record = REPO / "build" / "results" / f"{path.stem}.json"
    assert record.exists(), f"{path.stem} ran but recorded nothing: its cm.record(...) did not run"
    entry = json.loads(record.read_text())
    missing = REQUIRED_METRICS.get(path.stem, set()) - set(entry["metrics"])
    assert not missing, f"{path.stem} did not record {missing}"
    assert entry["claims"], f"{path.stem} checked no claims"
    assert entry["baseline"]["peak_bytes"] > 0


def test_generated_parts_of_every_notebook_are_up_to_date():
    """Badge, install command, T4 runtime request and Next links all come from colab_memopt/tooling/project.py."""
    notebooks = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in NOTEBOOKS}
    titles = {stem: project.notebook_title("".join(nb["cells"][0]["source"])) for stem, nb in notebooks.items()}
    stale = [stem for stem, nb in notebooks.items() if project.sync_notebook(nb, stem, titles) != nb]
    assert not stale, f"run `python -m colab_memopt.tooling.project sync`: out of date in {stale}"
    readme = (NOTEBOOK_DIR / "README.md").read_text(encoding="utf-8")
    assert project.course_markdown(titles) in readme, "run `python -m colab_memopt.tooling.project sync`: notebooks/README.md's course list"
    for stem, nb in notebooks.items():
        assert nb["metadata"]["colab"]["gpuType"] == "T4" and nb["metadata"]["accelerator"] == "GPU", stem
        assert project.COLAB_RUNTIME_LINE in "".join(nb["cells"][0]["source"]), stem


def test_course_path_holds_every_notebook_once_and_links_follow_it():
    assert sorted(project.COURSE_ORDER) == sorted(p.stem for p in NOTEBOOKS)
    assert len(set(project.COURSE_ORDER)) == len(project.COURSE_ORDER)
    assert project.COURSE[0][0] == "Start here" and project.COURSE_ORDER[0] == "00_where_the_memory_goes"
    for stem, following in zip(project.COURSE_ORDER, project.COURSE_ORDER[1:]):
        nb = nbformat.read(NOTEBOOK_DIR / f"{stem}.ipynb", as_version=4)
        assert f"]({following}.ipynb)" in nb.cells[-1].source, f"{stem}'s Next link must lead to {following}"
    with pytest.raises(ValueError, match="not in the course"):
        project.next_notebook("99_nothing")


def test_no_internal_references_in_notebooks_readmes_or_the_package():
    """A reader can look up every source: no unpublished documents, seeds, tracker numbers or internal names."""
    texts = {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8") for p in NOTEBOOKS}
    texts.update({name: (REPO / name).read_text(encoding="utf-8") for name in ("README.md", "CONTRIBUTING.md", "notebooks/README.md")})
    # the package: everything it can print (claims, plans, advice) and every docstring and comment
    texts.update({p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8") for p in sorted((REPO / "colab_memopt").rglob("*.py"))})
    found = {name: sorted(set(m.group(0) for m in INTERNAL_REFERENCE.finditer(text))) for name, text in texts.items()}
    found = {name: hits for name, hits in found.items() if hits}
    assert not found, f"internal references a reader cannot look up: {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_panel_waits_for_the_user(path):
    """Panels train, plan or look models up: none reruns on every value a slider or text box passes over."""
    code = "\n".join(c.source for c in _code(nbformat.read(path, as_version=4)))
    assert "widgets.panel(" in code
    # widgets.panel sets continuous_update=False and adds a Run button; nothing may wire a control around it
    for banned in ("continuous_update=True", "run_button=False", "interactive_output(", "interact(", ".observe("):
        assert banned not in code, f"{banned!r}: use widgets.panel, which waits for Run (tests/test_widgets_and_project.py)"


def _use_it(nb) -> list:
    """Return the cells of a notebook's 'Use it in your own training' section: its Markdown and the code below."""
    cells, inside = [], False
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            inside = cell.source.startswith("## Use it in your own training")
        if inside:
            cells.append(cell)
    return cells


USE_IT = {p.stem: _use_it(nbformat.read(p, as_version=4)) for p in NOTEBOOKS}


def test_every_notebook_has_a_use_it_section():
    assert all(USE_IT.values()), [stem for stem, cells in USE_IT.items() if not cells]


def test_use_it_teaches_the_checkpointing_flag_every_transformers_knows():
    """`gradient_checkpointing=True` with `use_reentrant=False`, in every notebook: transformers 4.x knows only
    that name, and 5.x takes it as the older name of `activation_checkpointing` (until v6)."""
    newer_name = re.compile(r"\bactivation_checkpointing(?:_kwargs)?\s*=|\.activation_checkpointing_enable\(")
    for stem, cells in USE_IT.items():
        for cell in cells:
            assert not newer_name.search(cell.source), f"{stem}: write gradient_checkpointing=True, as 03 teaches"
            if re.search(r"\bgradient_checkpointing\s*=\s*True", cell.source):
                assert re.search(r"gradient_checkpointing_kwargs\s*=\s*\{\"use_reentrant\": False", cell.source), stem
    assert "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False})" in "\n".join(
        c.source for c in USE_IT["03_activation_checkpointing"])


def test_what_decides_the_default_optimizer_is_said_as_the_installed_transformers_does():
    """transformers 5.23 picks optim="adamw_torch_fused" for torch 2.8 or newer (tests/test_trainer_snippets.py
    checks it): a notebook saying which default applies names the torch version, as 06 does."""
    for stem, cells in USE_IT.items():
        for cell in cells:
            if cell.cell_type == "markdown" and "adamw_torch_fused" in cell.source and re.search(r"default|picks", cell.source):
                assert re.search(r"torch (is )?2\.8", cell.source), f"{stem}: say that torch >= 2.8 makes it the default"


def test_use_it_text_says_what_its_cell_passes():
    """A 'Use it' text that names find_max_batch names the value its code below passes (notebook 12 said True)."""
    for stem, cells in USE_IT.items():
        text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
        code = "\n".join(c.source for c in cells if c.cell_type == "code")
        for value in set(re.findall(r"find_max_batch=(True|False)", code)):
            if "find_max_batch" in text:
                assert f"find_max_batch={value}" in text, f"{stem}: its code passes find_max_batch={value}"


def test_accelerates_retry_is_described_as_accelerate_does_it():
    """accelerate's find_executable_batch_size (behind auto_find_batch_size) retries with 0.9 x the batch."""
    memory = pytest.importorskip("accelerate.utils.memory")
    import inspect

    assert "batch_size * 0.9" in inspect.getsource(memory.find_executable_batch_size)
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            for part in re.split(r"[.;()]", cell.source):
                if re.search(r"find_executable_batch_size|auto_find_batch_size|common tools", part):
                    assert "halv" not in part.lower(), f"{path.stem}: accelerate multiplies by 0.9: {part.strip()!r}"


def test_notebooks_do_not_hedge_on_the_package_version():
    """Every version a reader can install has what a notebook uses: no 'where your colab_memopt has ...'."""
    for path in NOTEBOOKS:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"[Ww]here your `?colab_memopt`? has", text), path.stem


LINK = re.compile(r"\]\(https?://[^)\s]+\)|https?://\S+")


def further_reading_entries(source: str) -> list[str]:
    """Return the entries of a '## Further reading' list: each '- ' line with its continuation lines."""
    entries: list[str] = []
    for line in source.splitlines()[1:]:
        if line.startswith("- "):
            entries.append(line)
        elif line.strip() and entries:
            entries[-1] += " " + line.strip()
    return entries


def test_further_reading_entries_are_found_with_their_continuations():
    entries = further_reading_entries("## Further reading\n\n- A, [*B*](https://arxiv.org/abs/1)\n  (2020).\n- C (2021).\n")
    assert entries == ["- A, [*B*](https://arxiv.org/abs/1) (2020).", "- C (2021)."]
    assert [bool(LINK.search(e)) for e in entries] == [True, False]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_every_further_reading_entry_has_a_public_link(path):
    """A reader can open every source the closing list names: a paper's arXiv/DOI page, a doc page, a repository."""
    nb = nbformat.read(path, as_version=4)
    closing = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## Further reading")]
    assert len(closing) == 1, f"{path.name}: one closing '## Further reading' cell, found {len(closing)}"
    entries = further_reading_entries(closing[0])
    assert entries, f"{path.name}: the Further reading list is empty"
    unlinked = [e for e in entries if not LINK.search(e)]
    assert not unlinked, f"{path.name}: entries without a link: {unlinked}"


def test_notebooks_11_and_19_say_which_trainer_callback_to_use_when_in_the_same_words():
    """review 3 finding 14: two Trainer callbacks for similar jobs, and no word on which to use when."""
    paragraphs = []
    for stem in ("11_memory_profiling_and_monitoring", "19_your_trainer_on_a_free_t4"):
        text = "\n".join(c.source for c in nbformat.read(NOTEBOOK_DIR / f"{stem}.ipynb", as_version=4).cells)
        start = text.find("**Which Trainer callback, when.**")
        assert start >= 0, f"{stem} does not say which Trainer callback to use when"
        paragraphs.append(text[start:text.find("\n\n", start)])
    assert paragraphs[0] == paragraphs[1]
    assert "MemoryGuardCallback" in paragraphs[0] and "monitor.trainer_callback" in paragraphs[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_panel_shows_what_was_computed_above_instead_of_rerunning_it(path):
    """review 3 finding 14: Run all repeated each panel's work on display (07 fine-tuned again, 19 planned again)."""
    code = "\n".join(c.source for c in _code(nbformat.read(path, as_version=4)))
    call = code[code.index("widgets.panel("):]
    call = call[:call.index("\npanel")]
    assert "\n    shown=" in call, f"{path.name}: pass widgets.panel(..., shown=...) the result computed above for the defaults"


def test_links_to_this_repository_resolve_to_files_that_exist():
    """Every link into this repository (a GitHub blob/tree link, or a relative link in a README) names a file or folder
    that exists: a moved module breaks no link."""
    texts = {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8") for p in NOTEBOOKS}
    texts.update({name: (REPO / name).read_text(encoding="utf-8") for name in ("README.md", "CONTRIBUTING.md", "notebooks/README.md")})
    blob = re.compile(r"github\.com/colab-memopt/colab-memopt/(?:blob|tree)/main/([^\s)\"'#\\]+)")
    relative = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s#]+)")
    missing = []
    for name, text in texts.items():
        base = (REPO / name).parent
        for target in blob.findall(text):
            if not (REPO / target).exists():
                missing.append(f"{name}: {target}")
        if name.endswith(".md"):
            for target in relative.findall(text):
                if not (base / target).exists():
                    missing.append(f"{name}: {target}")
    assert not missing, missing


def _markdown_lines(path) -> list[str]:
    nb = json.loads(path.read_text())
    return [line for c in nb["cells"] if c["cell_type"] == "markdown" for line in "".join(c["source"]).splitlines()]


def test_the_cuda_context_figure_in_the_lessons_is_the_measured_one_the_planner_uses():
    """Issue 46: a figure in a lesson's text is read from the run or says where it was measured. Notebooks 00, 01
    and 11 said the CUDA context takes "0.5-2 GB" while every plan adds the 133-147 MiB measured on a T4: the text
    gives the measured range the planner cites (read from the T4 target), older reports only beside it."""
    from colab_memopt.planning.targets import get_target

    measured = re.search(r"\d+-\d+ MiB", get_target("t4").context_source).group()
    said = [(path.name, line) for path in NOTEBOOKS for line in _markdown_lines(path)
            if "CUDA context" in line and re.search(r"\d\s?(GB|GiB|MiB)\b", line)]
    assert said, "no lesson gives the CUDA context's size: this test looks at nothing"
    wrong = [(name, line) for name, line in said if measured not in line]
    assert not wrong, wrong


def test_timings_in_the_lessons_text_say_where_they_were_measured():
    """Issue 46: "about 5 s for a 1B-parameter model" (01) and "about 45 s here" (10) were typed-in times with no
    machine or date; a time in a lesson's text is printed by the run or names where and when it was measured."""
    timing = re.compile(r"about \d+(\.\d+)? (s|seconds|minutes)\b")
    bare = [(path.name, line) for path in NOTEBOOKS for line in _markdown_lines(path)
            if timing.search(line) and not re.search(r"on a [\w-]+ (CPU|GPU|machine)|\b20\d\d\b|T4", line)]
    assert not bare, bare
