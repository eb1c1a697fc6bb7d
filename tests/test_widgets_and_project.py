import pytest

from colab_memopt import project, widgets


def test_panel_runs_callback_with_defaults_then_on_change():
    import ipywidgets as ipw

    calls = []
    slider = ipw.IntSlider(value=3, min=1, max=10)
    box = widgets.panel(lambda n, name: calls.append((n, name)), {"n": slider, "name": ipw.Dropdown(options=["a", "b"], value="a")})
    assert calls == [(3, "a")]
    slider.value = 5
    assert calls[-1] == (5, "a")
    assert box.output is not None
    assert widgets.PANEL_CLASS in box._dom_classes and widgets.OUTPUT_CLASS in box.output._dom_classes
    with pytest.raises(ValueError, match="at least one control"):
        widgets.panel(lambda: None, {})


def test_colab_url_and_badge():
    url = project.colab_url("notebooks/00_where_the_memory_goes.ipynb")
    assert url == (f"https://colab.research.google.com/github/{project.REPOSITORY}/blob/{project.BRANCH}"
                   "/notebooks/00_where_the_memory_goes.ipynb")
    assert url in project.colab_badge("notebooks/00_where_the_memory_goes.ipynb")
    for bad in ("/abs/x.ipynb", "notebooks/x.py", "../x.ipynb"):
        with pytest.raises(ValueError, match="notebook_path"):
            project.colab_url(bad)
    assert project.REPOSITORY_URL in project.install_command()
