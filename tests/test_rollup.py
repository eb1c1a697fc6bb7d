import re

import pytest

from colab_memopt.tooling.project import colab_url
from colab_memopt.tooling.rollup import INDEX_END, INDEX_START, claims_markdown, index_markdown, measured_effect, notebook_title, update_readme
from colab_memopt.tooling.runner import NOTEBOOK_DIR

README = NOTEBOOK_DIR.parent / "README.md"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))

MERGED = {
    "device": "cpu", "torch": "2.x",
    "notebooks": {
        "02_mixed_precision": {
            "device": "cpu", "baseline": {"label": "fp32", "peak_bytes": 2**21, "step_seconds": 1.0},
            "optimized": {"label": "bf16", "peak_bytes": 2**20, "step_seconds": 1.5}, "saving_pct": 50.0, "time_ratio": 1.5,
            "claims": [{"claim": "halves | memory", "source": "s", "measured": "m", "verdict": "holds"}],
        },
        "01_will_it_fit": {
            "device": "cpu", "baseline": {"label": "b", "peak_bytes": 10}, "optimized": None, "saving_pct": None,
            "claims": [{"claim": "c", "source": "s", "measured": "x" * 300, "verdict": "does not hold"}],
        },
    },
}


def test_claims_table_has_every_claim_with_verdict_and_device():
    text = claims_markdown(MERGED)
    rows = [l for l in text.splitlines() if l.startswith("| 0")]
    assert len(rows) == 2
    assert "halves \\| memory" in rows[0] and "**holds**" in rows[0] and rows[0].endswith("| cpu |")
    assert "holds: 1" in text and "does not hold: 1" in text and "total 2" in text


def test_measured_effect_lines():
    # on a CPU the step-time ratio is noise as far as a GPU goes: the index leaves it out; a GPU's run keeps it
    assert measured_effect(MERGED["notebooks"]["02_mixed_precision"]) == "fp32 2.00 MiB -> bf16 1.00 MiB (50% less)"
    on_gpu = {**MERGED["notebooks"]["02_mixed_precision"], "device": "NVIDIA T4"}
    assert measured_effect(on_gpu) == "fp32 2.00 MiB -> bf16 1.00 MiB (50% less), step time x1.50"
    assert measured_effect(MERGED["notebooks"]["01_will_it_fit"]).endswith("...")
    assert "not run" in measured_effect(None)


def test_update_readme_needs_the_markers(tmp_path):
    p = tmp_path / "README.md"
    p.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_readme(p, "x")
    p.write_text(f"a\n{INDEX_START}\nold\n{INDEX_END}\nb")
    assert update_readme(p, f"{INDEX_START}\nnew\n{INDEX_END}") == f"a\n{INDEX_START}\nnew\n{INDEX_END}\nb"


def _readme_index() -> str:
    text = README.read_text()
    assert INDEX_START in text and INDEX_END in text, "README.md lost its notebook index markers"
    return text.split(INDEX_START, 1)[1].split(INDEX_END, 1)[0]


def test_readme_index_has_one_row_per_notebook_present():
    index = _readme_index()
    linked = re.findall(r"^\| \[[^\]]+\]\((notebooks/\d\d_[a-z0-9_]+\.ipynb)\)", index, re.M)
    assert sorted(linked) == [f"notebooks/{p.name}" for p in NOTEBOOKS], (
        "the README's notebook index does not match notebooks/: run `make run` and then `make readme`"
    )
    for path in NOTEBOOKS:
        row = next(l for l in index.splitlines() if f"](notebooks/{path.name})" in l)
        assert notebook_title(path) in row.replace("\\|", "|"), f"{path.name}: title changed, regenerate the index"
        assert colab_url(f"notebooks/{path.name}") in row


def test_generated_index_matches_the_notebooks():
    index = index_markdown(MERGED)
    assert index.startswith(INDEX_START) and index.endswith(INDEX_END)
    assert sum(1 for l in index.splitlines() if l.startswith("| [")) == len(NOTEBOOKS)


def test_runner_names_notebooks_by_stem_prefix_or_path():
    from colab_memopt.tooling.runner import notebook_paths

    by_stem = notebook_paths(["10_deepspeed_zero"])
    assert [p.stem for p in by_stem] == ["10_deepspeed_zero"]
    assert notebook_paths(["10"]) == by_stem == notebook_paths(["notebooks/10_deepspeed_zero.ipynb"])
    assert len(notebook_paths(None)) == len(notebook_paths([])) >= 16
    with pytest.raises(ValueError, match=r"no notebook matches \['99_nothing'\]"):
        notebook_paths(["99_nothing"])


def test_readme_refresh_refuses_partial_results_and_leaves_the_readme(tmp_path, capsys):
    import json

    from colab_memopt.tooling.rollup import main as rollup_main
    from colab_memopt.tooling.rollup import missing_notebooks

    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{INDEX_START}\nSTALE ROW\n{INDEX_END}\nb")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(MERGED))
    args = ["--results", str(results), "--claims", str(tmp_path / "claims.md"), "--readme", str(readme)]
    assert rollup_main(args) == 2
    assert "no results for" in capsys.readouterr().err and "STALE ROW" in readme.read_text()
    assert (tmp_path / "claims.md").exists()  # the claims of what ran are still written
    full = {**MERGED, "notebooks": {p.stem: MERGED["notebooks"]["02_mixed_precision"] for p in NOTEBOOKS}}
    assert missing_notebooks(full) == [] and missing_notebooks(MERGED) == [p.stem for p in NOTEBOOKS if p.stem not in MERGED["notebooks"]]
    results.write_text(json.dumps(full))
    assert rollup_main(args) == 0
    assert "STALE ROW" not in readme.read_text() and readme.read_text().startswith("a\n") and readme.read_text().endswith("\nb")


def test_make_run_writes_under_its_build_folder_only(tmp_path, monkeypatch):
    """The runner (make run) writes results, claims and executed notebooks under --out; never README.md."""
    import json

    import colab_memopt.tooling.runner as runner

    readme_before = README.read_text()
    stems = ["02_mixed_precision"]

    def fake_run(path, out_dir, results_dir, parameters, cell_timeout):  # the real papermill run records like this
        out_dir.mkdir(parents=True, exist_ok=True)
        results_dir.mkdir(parents=True, exist_ok=True)
        (results_dir / f"{path.stem}.json").write_text(json.dumps(MERGED["notebooks"]["02_mixed_precision"]))
        (out_dir / path.name).write_text("{}")
        return runner.NotebookRun(path.stem, out_dir / path.name, 0.1, parameters)

    monkeypatch.setattr(runner, "run_notebook", fake_run)
    monkeypatch.setattr(runner, "notebook_paths", lambda names=None: [NOTEBOOK_DIR / f"{s}.ipynb" for s in stems])
    assert runner.main(["--out", str(tmp_path / "build")]) == 0
    assert README.read_text() == readme_before
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["build/claims.md", "build/notebooks/02_mixed_precision.ipynb", "build/results.json",
                       "build/results/02_mixed_precision.json"]


def test_runner_never_waits_on_a_cell_forever(tmp_path, monkeypatch):
    import papermill

    import colab_memopt.tooling.runner as runner

    seen = {}
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **kw: seen.update(kw))
    runner.run_notebook(NOTEBOOKS[0], tmp_path, tmp_path / "results", {}, cell_timeout=12.5)
    assert seen["execution_timeout"] == 12.5
    runner.run_notebook(NOTEBOOKS[0], tmp_path, tmp_path / "results", {})
    assert seen["execution_timeout"] == runner.CELL_TIMEOUT_SECONDS


@pytest.mark.parametrize("failures, exit_code, runs", [(["timeout"], 0, 2), (["timeout", "timeout"], 1, 2),
                                                       (["error"], 1, 1)])
def test_runner_reruns_a_notebook_once_after_a_cell_timeout(failures, exit_code, runs, tmp_path, monkeypatch, capsys):
    # Notebook 08 hung in make run: its panel cell's output and idle status all arrived, its execute_reply never did
    # (2 of 19 runs here). A timeout is retried once; a real hang times out twice; other errors are not.
    import json

    from nbclient.exceptions import CellTimeoutError

    import colab_memopt.tooling.runner as runner

    stem = "08_activation_compression"
    calls = []

    def fake_run(path, out_dir, results_dir, parameters, cell_timeout):
        calls.append(cell_timeout)
        if len(calls) <= len(failures):
            if failures[len(calls) - 1] == "timeout":
                raise CellTimeoutError("A cell timed out while it was being executed, after 720 seconds.")
            raise RuntimeError("boom")
        results_dir.mkdir(parents=True, exist_ok=True)
        (results_dir / f"{path.stem}.json").write_text(json.dumps(MERGED["notebooks"]["02_mixed_precision"]))
        return runner.NotebookRun(path.stem, out_dir / path.name, 0.1, parameters)

    monkeypatch.setattr(runner, "run_notebook", fake_run)
    monkeypatch.setattr(runner, "notebook_paths", lambda names=None: [NOTEBOOK_DIR / f"{stem}.ipynb"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert runner.main(["--out", str(tmp_path / "build")]) == exit_code
    budget = runner.load_cpu_parameters()[stem]["budget_seconds"]
    assert calls == [min(runner.CELL_TIMEOUT_SECONDS, max(600, 3 * budget))] * runs
    out = capsys.readouterr()
    assert ("running it once more" in out.out) == (failures[0] == "timeout")
    assert runner.cell_timeout_for(stem, gpu=True, cpu_params=runner.load_cpu_parameters(), cell_timeout=1800) == 1800
    assert runner.cell_timeout_for(stem, gpu=False, cpu_params={}, cell_timeout=1800) == 1800


def test_runner_outside_a_checkout_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """Installed from a wheel (no notebooks/ beside the package) the runner names what is missing and stops."""
    from colab_memopt import runner

    with pytest.raises(ValueError, match="checkout of the repository.*notebooks.*make run"):
        runner.check_checkout(tmp_path)
    runner.check_checkout()  # this checkout has both
    monkeypatch.setattr(runner, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(runner.check_checkout, "__defaults__", (tmp_path,))
    assert runner.main(["--prepare-only", str(tmp_path / "out"), "00"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the runner executes the notebooks of a checkout") and err.count("\n") == 1


def test_readme_first_screen_is_for_a_learner():
    """'Start here' within the first 40 lines, with the generated badges of the whole Start here part."""
    from colab_memopt.tooling.project import FIRST_SCREEN
    from colab_memopt.tooling.rollup import START_HERE_END, START_HERE_START, start_here_markdown

    text = README.read_text()
    assert "## Start here" in "\n".join(text.splitlines()[:40])
    block = START_HERE_START + text.split(START_HERE_START, 1)[1].split(START_HERE_END, 1)[0] + START_HERE_END
    assert block == start_here_markdown(), "run `make readme`: the Start here badges are out of date"
    assert block.count("colab-badge.svg") == len(FIRST_SCREEN)
    index = index_markdown(MERGED)
    assert index.index("**Start here**") < index.index("**Going further**") < index.index("**Advanced and research**")


def _stems(markdown: str) -> list[str]:
    """Return the notebook stems `markdown` links to, in order, each once (a row may link one twice)."""
    seen: list[str] = []
    for stem in re.findall(r"(\d\d_[a-z0-9_]+)\.ipynb\)", markdown):
        if stem not in seen:
            seen.append(stem)
    return seen


def test_one_course_path_everywhere_with_19_on_it():
    """The README's Start here list and index, notebooks/README.md and the Next links give one path, 19 on it."""
    import json

    from colab_memopt.tooling.project import COURSE, COURSE_ORDER, FIRST_SCREEN, next_notebook
    from colab_memopt.tooling.rollup import START_HERE_END, START_HERE_START

    path = list(COURSE[0][1])
    assert COURSE[0][0] == "Start here" and list(FIRST_SCREEN) == path
    assert "19_your_trainer_on_a_free_t4" in path and path[0] == "00_where_the_memory_goes"
    text = README.read_text()
    first_screen = text.split(START_HERE_START, 1)[1].split(START_HERE_END, 1)[0]
    assert _stems(first_screen) == path, "README's Start here list"
    index_start = _readme_index().split("**Start here**", 1)[1].split("**Going further**", 1)[0]
    assert _stems(index_start) == path, "README index's Start here section"
    assert _stems(_readme_index()) == list(COURSE_ORDER), "README index's order"
    course = (NOTEBOOK_DIR / "README.md").read_text().split("**Start here**", 1)[1].split("**Going further**", 1)[0]
    assert _stems(course) == path, "notebooks/README.md's Start here list"
    for stem in path:  # each notebook's last cell links on along the path, and the last one into Going further
        last = "".join(json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())["cells"][-1]["source"])
        following = next_notebook(stem)
        assert _stems(last) == [following], f"{stem}'s Next link"
    assert next_notebook(path[-1]) == COURSE[1][1][0] and next_notebook(path[-1]) not in path


def test_the_readme_says_once_where_the_path_leaves_the_numbers():
    from colab_memopt.tooling.project import FIRST_SCREEN, order_note

    assert order_note(("00_a", "01_b", "02_c")) == ""
    assert "this path goes from 01 to 03 and from 03 to 02;" in order_note(("00_a", "01_b", "03_c", "02_d"))
    readme = " ".join(README.read_text().split())
    assert readme.count(order_note(FIRST_SCREEN)) == 1 and "from 04 to 06" in order_note(FIRST_SCREEN)
    # notebooks/README.md said the numbers were the reading order (newcomer review 4): both READMEs say the same
    notebooks_readme = " ".join((NOTEBOOK_DIR / "README.md").read_text().split())
    assert notebooks_readme.count(order_note(FIRST_SCREEN)) == 1
    assert not re.search(r"digits in reading order|numbered in reading order", notebooks_readme + readme)


def test_readme_index_says_what_each_notebook_teaches_and_figures_only_from_a_t4():
    """A CPU run's toy figures, a CI target's name and an emulating GPU's figures never reach the index."""
    from colab_memopt.tooling.project import TEACHES, teaches
    from colab_memopt.tooling.rollup import measured_on_t4

    assert sorted(TEACHES) == [p.stem for p in NOTEBOOKS]
    assert all(0 < len(line) <= 100 and line == line.strip() for line in TEACHES.values())
    with pytest.raises(ValueError, match="'99_nothing' has no line"):
        teaches("99_nothing")
    on_cpu = index_markdown(MERGED)
    assert teaches("02_mixed_precision") in on_cpu and "MiB" not in on_cpu and "small model" not in on_cpu
    t4_run = {"notebooks": {"02_mixed_precision": {**MERGED["notebooks"]["02_mixed_precision"], "device": "Tesla T4"}}}
    row = next(l for l in index_markdown(t4_run).splitlines() if "02_mixed_precision.ipynb)" in l)
    assert row.endswith(f"{teaches('02_mixed_precision')}. Measured on Tesla T4: fp32 2.00 MiB -> bf16 1.00 MiB "
                        "(50% less), step time x1.50 |")
    emulated = {"notebooks": {"02_mixed_precision": {**t4_run["notebooks"]["02_mixed_precision"],
                                                     "device": "NVIDIA H100 80GB HBM3 emulating t4"}}}
    assert "MiB" not in index_markdown(emulated)
    assert measured_on_t4("NVIDIA T4") and not measured_on_t4("cpu") and not measured_on_t4("small-t4")
    index = _readme_index()
    assert "small-t4" not in index and "MiB" not in index
    for path in NOTEBOOKS:
        row = next(l for l in index.splitlines() if f"](notebooks/{path.name})" in l)
        assert teaches(path.stem) in row, f"{path.name}: regenerate the index (`make readme`)"


def test_readme_is_for_users_and_ends_with_the_package():
    """Maintainer text (GPU checks, wheels, CI parameters, generation) lives in CONTRIBUTING.md, linked once."""
    text = re.sub(r"<!--.*?-->", "", README.read_text(), flags=re.S)  # the generated blocks' marker comments
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == ["Start here", "What sets it apart", "The notebooks", "Your own model",
                        "Presets and the recommender", "The package"]
    for maintainer in ("make test-gpu", "gpu-wheels", "gpucheck", "wheelhouse", "small-t4", "notebook_parameters",
                       "make readme", "rollup", "lent", "borrowed"):  # make run and make test: the first screen
        assert not re.search(rf"\b{re.escape(maintainer)}\b", text), f"README.md says {maintainer!r}: for CONTRIBUTING.md"
    links = [line for line in text.splitlines() if "CONTRIBUTING.md" in line]
    assert len(links) == 1 and "`make test`" in links[0], links
    contributing = (NOTEBOOK_DIR.parent / "CONTRIBUTING.md").read_text()
    for moved in ("make test-gpu", "make gpu-wheels", "gpucheck plan", "tests/notebook_parameters.yaml", "make readme",
                  "| module | what it holds |"):
        assert moved in contributing, f"CONTRIBUTING.md lost {moved!r}"
