from pathlib import Path

import pytest

from colab_memopt import project, widgets


def test_panel_runs_callback_with_defaults_then_on_run():
    import ipywidgets as ipw

    calls = []
    slider = ipw.IntSlider(value=3, min=1, max=10)
    text = ipw.Text(value="smollm2-135m")
    box = widgets.panel(lambda n, name, model: calls.append((n, name, model)),
                        {"n": slider, "name": ipw.Dropdown(options=["a", "b"], value="a"), "model": text})
    assert calls == [(3, "a", "smollm2-135m")]
    # Nothing fires while a slider is dragged or a box typed into; a change waits for Run.
    assert slider.continuous_update is False and text.continuous_update is False
    slider.value = 5
    text.value = "gpt2"
    assert len(calls) == 1, "a change must not rerun the callback before Run is pressed"
    box.run_button.click()
    assert calls[-1] == (5, "a", "gpt2") and len(calls) == 2
    assert box.output is not None and box.run_button is not None
    assert widgets.PANEL_CLASS in box._dom_classes and widgets.OUTPUT_CLASS in box.output._dom_classes
    assert widgets.RUN_CLASS in box.run_button._dom_classes
    with pytest.raises(ValueError, match="at least one control"):
        widgets.panel(lambda: None, {})
    with pytest.raises(TypeError, match="'n' must be an ipywidgets control"):
        widgets.panel(lambda n: None, {"n": 3})


def test_panel_without_run_button_reruns_on_each_committed_change():
    import ipywidgets as ipw

    calls = []
    slider = ipw.IntSlider(value=3, min=1, max=10)
    box = widgets.panel(lambda n: calls.append(n), {"n": slider}, run_button=False)
    assert box.run_button is None and slider.continuous_update is False
    slider.value = 5
    assert calls == [3, 5]


def test_panel_shows_the_result_computed_above_and_runs_the_callback_only_on_run(capsys):
    # review 3 finding 14: every panel reran its callback when displayed (07 another fine-tune, 19 another plan)
    import ipywidgets as ipw

    calls, shown = [], []
    slider = ipw.IntSlider(value=3, min=1, max=10)
    box = widgets.panel(lambda n: calls.append(n), {"n": slider}, shown=lambda: shown.append("above"))
    assert calls == [] and shown == ["above"], "displaying the panel must not rerun the callback"
    assert widgets.SHOWN_TEXT in box.children[1].value
    slider.value = 5
    assert calls == [], "a change waits for Run"
    box.run_button.click()
    assert calls == [5] and shown == ["above"] and box.children[1].value == ""
    # a value instead of a function: a string is printed into the panel's output
    text = widgets.panel(lambda n: calls.append(n), {"n": ipw.IntSlider(value=3)}, shown="peak 12 MiB")
    assert calls == [5] and text.output is not None


def test_a_failing_shown_result_fails_the_panel():
    import ipywidgets as ipw

    def broken():
        raise RuntimeError("nothing computed above")

    with pytest.raises(RuntimeError, match="nothing computed above"):
        widgets.panel(lambda n: None, {"n": ipw.IntSlider(value=3)}, shown=broken)


@pytest.fixture
def ipython_shell():
    """An IPython shell in this process: ipywidgets' Output then behaves as in a kernel (it prints an exception's
    traceback into itself and swallows the exception)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    yield shell
    InteractiveShell.clear_instance()


@pytest.mark.parametrize("error", [RuntimeError("broken on purpose"), KeyboardInterrupt()])
def test_a_failing_callback_fails_the_panel_and_shows_in_it(error, ipython_shell, monkeypatch):
    # Hardening 3: an interrupt (a cell timeout's) in notebook 08's display-time run was swallowed by the Output
    # and the notebook recorded as passed. The panel now raises it again: at display time and on Run.
    import ipywidgets as ipw

    shown = []
    monkeypatch.setattr(ipython_shell, "showtraceback", lambda *a, **k: shown.append(a))
    fail = {"now": True}

    def callback(n):
        if fail["now"]:
            raise error
        print(n)

    with pytest.raises(type(error)):
        widgets.panel(callback, {"n": ipw.IntSlider(value=3)})
    assert len(shown) == 1, "the Output shows the traceback in the panel"
    fail["now"] = False
    box = widgets.panel(callback, {"n": ipw.IntSlider(value=3)})
    fail["now"] = True
    with pytest.raises(type(error)):
        box.run()
    assert len(shown) == 2 and "the run failed" in box.children[1].value
    fail["now"] = False
    box.run()
    assert box.children[1].value == ""


HEADLESS_FAILURES = {
    # The callback raises at display time.
    "raises": ("    raise RuntimeError('broken on purpose')\n", "RuntimeError: broken on purpose"),
    # The kernel is interrupted inside the callback, as nbval's cell timeout (or the user's Interrupt) does.
    "interrupted": ("    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n", "KeyboardInterrupt"),
}


@pytest.mark.notebook
@pytest.mark.parametrize("kind", sorted(HEADLESS_FAILURES))
def test_a_failing_panel_fails_the_headless_run(kind, tmp_path):
    # Before the panel raised again, both notebooks ran to their last cell and the runner recorded them as passed.
    nbformat = pytest.importorskip("nbformat")
    from colab_memopt.tooling.runner import failure_line, run_notebook

    body, expected = HEADLESS_FAILURES[kind]
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("results_dir = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "import os, signal, time\nimport ipywidgets as ipw\nfrom colab_memopt import widgets\n\n\n"
            f"def explore(n):\n{body}\n\n"
            'panel = widgets.panel(explore, {"n": ipw.IntSlider(value=3, description="n")})\npanel'),
        nbformat.v4.new_code_cell("print('after the panel')"),
    ]
    path = tmp_path / f"99_{kind}.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(Exception) as failed:
        run_notebook(path, tmp_path / "out", tmp_path / "results", {}, cell_timeout=120)
    line = failure_line(path.stem, failed.value, tmp_path / "out" / path.name)
    assert expected in line and "failed in cell 3" in line, line  # 3: papermill injects the parameters as cell 2


def test_colab_url_and_badge():
    url = project.colab_url("notebooks/00_where_the_memory_goes.ipynb")
    assert url == (f"https://colab.research.google.com/github/{project.REPOSITORY}/blob/{project.BRANCH}"
                   "/notebooks/00_where_the_memory_goes.ipynb")
    assert url in project.colab_badge("notebooks/00_where_the_memory_goes.ipynb")
    for bad in ("/abs/x.ipynb", "notebooks/x.py", "../x.ipynb"):
        with pytest.raises(ValueError, match="notebook_path"):
            project.colab_url(bad)
    assert project.REPOSITORY_URL in project.install_command()


def test_install_command_extras_and_notebook_10_installs_deepspeed():
    # Colab has no DeepSpeed: notebook 10's cell must install the 'zero' extra (review A1).
    assert project.notebook_extras("10_deepspeed_zero") == ("colab", "zero")
    assert '"colab-memopt[colab,zero] @' in project.install_command(project.notebook_extras("10_deepspeed_zero"))
    assert project.notebook_extras("00_where_the_memory_goes") == ("colab",)
    for bad in ((), "colab", ("colab", "gpu")):
        with pytest.raises(ValueError, match="extras"):
            project.install_command(bad)


def test_pyproject_keeps_colabs_ipywidgets_and_extras_exist():
    # Colab ships ipywidgets 7.7 and its frontend did not render 8.x (review A8): accept 7.6+.
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    assert set(project.EXTRAS) == set(extras)
    for name in ("colab", "notebooks"):
        assert "ipywidgets>=7.6" in extras[name], extras[name]


def test_one_repository_location_behind_pyproject_badges_and_install_cells():
    """pyproject's URL, the badges and the Colab install command all name project.REPOSITORY."""
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    assert meta["urls"]["Repository"] == project.REPOSITORY_URL
    assert project.REPOSITORY_URL == f"https://github.com/{project.REPOSITORY}"
    assert f"git+{project.REPOSITORY_URL}@{project.BRANCH}" in project.install_command()
    assert f"/github/{project.REPOSITORY}/blob/{project.BRANCH}/" in project.colab_badge("notebooks/00_x.ipynb")
