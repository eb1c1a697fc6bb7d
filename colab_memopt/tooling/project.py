"""Where the project lives: the one place that names its repository (badges and the Colab install) and its course."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from colab_memopt.core.fileio import atomic_write_text

REPOSITORY = "colab-memopt/colab-memopt"
BRANCH = "main"
REPOSITORY_URL = f"https://github.com/{REPOSITORY}"


def colab_url(notebook_path: str) -> str:
    """Return the 'Open in Colab' URL of a notebook, from its path in the repository."""
    path = PurePosixPath(notebook_path)
    if path.suffix != ".ipynb" or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"notebook_path must be a relative path to an .ipynb file, got {notebook_path!r}")
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/{path}"


def colab_badge(notebook_path: str) -> str:
    """Return the Markdown of the 'Open in Colab' badge for a notebook."""
    return (
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"({colab_url(notebook_path)})"
    )


# Extras a notebook needs beyond `[colab]`: Colab does not preinstall DeepSpeed (notebook 10 imports it).
NOTEBOOK_EXTRAS = {"10_deepspeed_zero": ("colab", "zero"), "16_full_finetuning_on_a_t4": ("colab", "fullft")}
EXTRAS = ("notebooks", "quant", "zero", "fullft", "colab", "dev")


def notebook_extras(stem: str) -> tuple[str, ...]:
    """Return the extras notebook `stem` (e.g. '10_deepspeed_zero') installs on Colab."""
    return NOTEBOOK_EXTRAS.get(stem, ("colab",))


def install_command(extras: Sequence[str] = ("colab",)) -> str:
    """Return the pip command the notebooks' install cell runs on Colab (keeps Colab's torch).

    Example:
        >>> install_command(("colab", "zero"))  # notebook 10's cell
    """
    if isinstance(extras, str) or not extras:
        raise ValueError(f"extras must be a non-empty sequence of names from {EXTRAS}, got {extras!r}")
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown:
        raise ValueError(f"unknown extras {unknown}; allowed: {EXTRAS}")
    return f'pip install -q "colab-memopt[{",".join(extras)}] @ git+{REPOSITORY_URL}@{BRANCH}"'


# The course: the order a T4 user reads the notebooks in, named here once. The README's "Start here"
# list (FIRST_SCREEN), the README's index, notebooks/README.md and each notebook's "Next:" link are all
# generated from it. Numbers are the order the notebooks were written in; this is the order to learn in.
# Start here ends with the whole job (19: QLoRA through SFTTrainer, saved, merged, chatted with); its
# last notebook's Next leads on to the first of *Going further*.
COURSE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Start here", (
        "00_where_the_memory_goes",
        "01_will_it_fit",
        "02_mixed_precision",
        "03_activation_checkpointing",
        "04_gradient_accumulation",
        "06_lean_optimizers",
        "07_weight_quantization",
        "18_your_own_model",
        "19_your_trainer_on_a_free_t4",
    )),
    ("Going further", (
        "05_memory_efficient_attention",
        "17_long_context",
        "15_fit_the_biggest_model",
        "16_full_finetuning_on_a_t4",
        "11_memory_profiling_and_monitoring",
        "12_dynamic_batch_size_and_oom",
    )),
    ("Advanced and research", (
        "08_activation_compression",
        "09_cpu_offload",
        "10_deepspeed_zero",
        "13_semiseparable_matrices",
        "14_phase_aware_training",
    )),
)
COURSE_ORDER: tuple[str, ...] = tuple(stem for _, stems in COURSE for stem in stems)
# The README's first screen lists the whole "Start here" part, in its order, and nothing else.
FIRST_SCREEN: tuple[str, ...] = COURSE[0][1]

# What each notebook teaches, one short line: the README index's column (colab_memopt.tooling.rollup).
TEACHES: dict[str, str] = {
    "00_where_the_memory_goes": "What holds memory in a training step: weights, gradients, optimizer state, activations",
    "01_will_it_fit": "Plan a step's memory before loading anything, and check the plan against a measurement",
    "02_mixed_precision": "fp16 autocast with a GradScaler on a T4 (not bf16): what 16 bits shrink and what they keep",
    "03_activation_checkpointing": "Recompute activations in backward: much less memory for about a third more compute",
    "04_gradient_accumulation": "A large effective batch from small micro-batches, with the same gradient",
    "05_memory_efficient_attention": "Attention whose memory grows with the sequence, not its square (SDPA), on a T4",
    "06_lean_optimizers": "Optimizers that keep less state: 8-bit AdamW, Adafactor, Lion, Adam-mini, a fused step",
    "07_weight_quantization": "8- and 4-bit weights, and QLoRA: a frozen quantized base with LoRA adapters",
    "08_activation_compression": "Activations saved for backward in int8 or in host memory, with checkpointing",
    "09_cpu_offload": "Stream layers from host RAM, and park the optimizer state off the GPU",
    "10_deepspeed_zero": "What ZeRO's stages shard across GPUs, and what ZeRO-Offload does on one GPU",
    "11_memory_profiling_and_monitoring": "Watch memory while training: spikes, leaks, a Trainer callback, allocation history",
    "12_dynamic_batch_size_and_oom": "Find the largest batch, and survive an OOM without changing what the model learns",
    "13_semiseparable_matrices": "Research: a dense N x N operator stored as a band plus a low-rank part",
    "14_phase_aware_training": "Research: steps whose updates are predicted, not back-propagated, and what they free",
    "15_fit_the_biggest_model": "Presets and the recommender: the recipe that fits, and the largest model per mode",
    "16_full_finetuning_on_a_t4": "Full fine-tuning in little memory: 16-bit weights, LOMO, AdaLomo, 8-bit AdamW",
    "17_long_context": "Long sequences: offloaded checkpoints, the chunked loss, the longest context per model",
    "18_your_own_model": "Your model by its id: plan it from its config, check it, load it, fine-tune it on your text",
    "19_your_trainer_on_a_free_t4": "QLoRA of Llama-3.1-8B through SFTTrainer: plan, fit, guard, train, save, merge, chat",
}


def teaches(stem: str) -> str:
    """Return the one line that says what notebook `stem` teaches (the README index's column)."""
    if stem not in TEACHES:
        raise ValueError(f"{stem!r} has no line in project.TEACHES; notebooks with one: {', '.join(TEACHES)}")
    return TEACHES[stem]


def order_note(path: Sequence[str] = FIRST_SCREEN) -> str:
    """Return the one sentence that says where a reading path leaves the notebooks' numbers ('' if nowhere).

    Example: ('00_a', '01_b', '03_c') -> 'The numbers are the order the notebooks were written in, not
    the order to read them in: this path goes from 01 to 03; the others come after it, in *Going further*
    and *Advanced and research*.'
    """
    numbers = [int(stem[:2]) for stem in path]
    jumps = [f"from {a:02d} to {b:02d}" for a, b in zip(numbers, numbers[1:]) if b != a + 1]
    if not jumps:
        return ""
    listed = ", ".join(jumps[:-1]) + (" and " if len(jumps) > 1 else "") + jumps[-1]
    rest = " and ".join(f"*{part}*" for part, _ in COURSE[1:])
    return ("The numbers are the order the notebooks were written in, not the order to read them in: "
            f"this path goes {listed}; the others come after it, in {rest}.")


def course_part(stem: str) -> str:
    """Return the part of the course notebook `stem` belongs to ('Start here', 'Going further', ...)."""
    for part, stems in COURSE:
        if stem in stems:
            return part
    raise ValueError(f"{stem!r} is not in the course; known notebooks: {', '.join(COURSE_ORDER)}")


def next_notebook(stem: str) -> str | None:
    """Return the stem of the notebook to read after `stem`, or None after the last one."""
    course_part(stem)  # names the allowed stems when `stem` is unknown
    i = COURSE_ORDER.index(stem)
    return COURSE_ORDER[i + 1] if i + 1 < len(COURSE_ORDER) else None


# What the first cell of every notebook tells a Colab user before anything runs.
COLAB_RUNTIME_LINE = (
    "**On Colab:** *Runtime → Change runtime type → T4 GPU*, then *Runtime → Run all*. "
    "Without a GPU the notebook still runs, on two CPU cores, and far slower at these sizes."
)
# Notebook metadata that asks Colab for a T4 runtime when the notebook opens (as Unsloth's notebooks do).
COLAB_METADATA = {"accelerator": "GPU", "colab": {"gpuType": "T4", "provenance": []}}


def notebook_title(source: str) -> str:
    """Return a notebook's title from its first cell's Markdown ('# 02 · Mixed precision' -> '02 · Mixed precision')."""
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    if not first.startswith("# "):
        raise ValueError(f"a notebook's first cell must start with its '# ' title, got {first[:60]!r}")
    return first[2:].strip()


def _link(stem: str, titles: Mapping[str, str]) -> str:
    return f"[{titles[stem]}]({stem}.ipynb) ([open in Colab]({colab_url(f'notebooks/{stem}.ipynb')}))"


def next_cells(stem: str, titles: Mapping[str, str]) -> tuple[str, str]:
    """Return the Markdown of notebook `stem`'s two 'Next' cells: the lesson's end and the notebook's last cell."""
    following = next_notebook(stem)
    if following is None:
        where = f"the end of the course. The path through it is in the README's [Start here]({REPOSITORY_URL}#start-here)."
    else:
        part = course_part(following)
        where = _link(following, titles) + ("" if part == course_part(stem) else f", the first notebook of *{part}*")
    lesson_end = (
        f"## Next\n\n**Next:** {where}\n\n"
        "The appendix below checks what the literature claims against what this notebook measured."
    )
    return lesson_end, f"---\n\n**Next:** {where}"


def sync_notebook(nb: dict, stem: str, titles: Mapping[str, str]) -> dict:
    """Return notebook JSON `nb` with everything generated from this module brought up to date.

    That is the Colab metadata (a T4 runtime), the runtime line of the first cell, the badge, the
    install command and the two 'Next' cells (ids 'next-lesson' and 'next'), all from REPOSITORY,
    BRANCH, NOTEBOOK_EXTRAS and COURSE. `python -m colab_memopt.tooling.project sync` applies it to notebooks/.
    """
    nb = json.loads(json.dumps(nb))
    nb["metadata"].update(json.loads(json.dumps(COLAB_METADATA)))
    cells = nb["cells"]

    def text(cell: dict) -> str:
        return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]

    def put(cell: dict, value: str) -> None:
        cell["source"] = value.splitlines(keepends=True)

    first = [line for line in text(cells[0]).rstrip("\n").split("\n") if not line.startswith("**On Colab:**")]
    while first and not first[-1].strip():
        first.pop()
    put(cells[0], "\n".join(first) + "\n\n" + COLAB_RUNTIME_LINE)
    put(cells[1], colab_badge(f"notebooks/{stem}.ipynb"))
    pip = "!" + install_command(notebook_extras(stem))
    for cell in cells:
        if cell["cell_type"] == "code" and "!pip install" in text(cell) and "colab-memopt" in text(cell):
            put(cell, re.sub(r"!pip install -q \"colab-memopt\[[^\]]*\] @ [^\"]*\"", lambda _: pip, text(cell)))
    lesson_end, last = next_cells(stem, titles)
    for cell_id, value in (("next-lesson", lesson_end), ("next", last)):
        for cell in cells:
            if cell.get("id") == cell_id:
                put(cell, value)
    return nb


COURSE_START = "<!-- course:start (generated by python -m colab_memopt.tooling.project sync; do not edit) -->"
COURSE_END = "<!-- course:end -->"


def course_markdown(titles: Mapping[str, str]) -> str:
    """Return the course path as Markdown for notebooks/README.md: each part, its notebooks in order, linked, then
    the README's sentence on where the path leaves the numbers (`order_note`)."""
    import textwrap

    lines = [COURSE_START]
    n = 0
    for part, stems in COURSE:
        lines += ["", f"**{part}**", ""]
        for stem in stems:
            n += 1
            lines.append(f"{n}. [{titles.get(stem, stem)}]({stem}.ipynb)")
    note = order_note(FIRST_SCREEN)
    return "\n".join(lines + ([""] + textwrap.fill(note, 100, break_on_hyphens=False).splitlines() if note else [])
                     + ["", COURSE_END])


def replace_block(text: str, start: str, end: str, block: str, where: Any = "README.md") -> str:
    """Return `text` with the block between the markers `start` and `end` replaced by `block` (markers included)."""
    if start not in text or end not in text:
        raise ValueError(f"{where} has no markers {start!r} ... {end!r}")
    if text.index(end) < text.index(start):
        raise ValueError(f"{where}: the end marker {end!r} comes before its start marker")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + block + tail


def sync_course_readme(readme: Path, titles: Mapping[str, str]) -> bool:
    """Rewrite the course block of `readme` (notebooks/README.md) between its markers; return whether it changed."""
    text = readme.read_text(encoding="utf-8")
    new = replace_block(text, COURSE_START, COURSE_END, course_markdown(titles), readme)
    if new != text:
        atomic_write_text(readme, new)
    return new != text


def sync_notebooks(notebook_dir: Path) -> list[str]:
    """Rewrite the generated parts of every notebook in `notebook_dir` and the course list of its README.md;
    return the names of the files that changed."""
    paths = sorted(Path(notebook_dir).glob("[0-9][0-9]_*.ipynb"))
    notebooks = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in paths}
    titles = {stem: notebook_title("".join(nb["cells"][0]["source"])) for stem, nb in notebooks.items()}
    changed = []
    readme = Path(notebook_dir) / "README.md"
    if readme.exists() and sync_course_readme(readme, titles):
        changed.append(readme.name)
    for path in paths:
        synced = sync_notebook(notebooks[path.stem], path.stem, titles)
        out = json.dumps(synced, indent=1, ensure_ascii=False) + "\n"
        if out != path.read_text(encoding="utf-8"):
            atomic_write_text(path, out)
            changed.append(path.name)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m colab_memopt.tooling.project", description=(
        "Rewrite the notebooks' generated parts (badge, Colab install, T4 runtime, Next links) from this module."))
    parser.add_argument("command", choices=["sync"])
    parser.add_argument("--notebooks", default="notebooks", help="the folder of NN_topic.ipynb notebooks (default: notebooks)")
    args = parser.parse_args(argv)
    if not Path(args.notebooks).is_dir():
        parser.error(f"--notebooks {args.notebooks!r} is not a folder")
    changed = sync_notebooks(Path(args.notebooks))
    print(f"rewrote {len(changed)} file(s)" + (": " + ", ".join(changed) if changed else ": all were up to date"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
