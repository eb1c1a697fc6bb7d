"""Widget panels: a few controls that call one ordinary function.

The callback is a plain function that tests call directly. `panel` runs it once with the default
values, so a headless run (papermill, CI) gets the full result without a click.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

PANEL_CLASS = "cm-panel"
OUTPUT_CLASS = "cm-panel-output"


def panel(callback: Callable[..., Any], controls: Mapping[str, Any], *, title: str = "") -> Any:
    """Return a VBox of `controls` above an output area that shows `callback(**values)`.

    Args:
        callback: called with one keyword argument per control, on start and on every change.
        controls: name -> ipywidgets control (its `value` is the default).
        title: a line above the controls.
    """
    import ipywidgets as widgets

    if not controls:
        raise ValueError("panel needs at least one control")
    out = widgets.interactive_output(callback, dict(controls))
    header = [widgets.HTML(f"<b>{title}</b>")] if title else []
    box = widgets.VBox([*header, widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap")), out])
    box.output = out  # for tests: the rendered result lives here
    # For the browser test (tests/browser): CSS classes that find the panel and its output in the page.
    box.add_class(PANEL_CLASS)
    out.add_class(OUTPUT_CLASS)
    return box
