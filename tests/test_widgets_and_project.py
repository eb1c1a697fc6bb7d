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
