"""Widget panels: a few controls that call one ordinary function.

The callback is a plain function that tests call directly. A panel shows a result for its default
values without a click: the one the notebook already computed above (`shown`), so displaying it repeats
no training, planning or loading; without `shown` it runs the callback once with the defaults. An exception or an
interrupt in the callback shows in the panel and is raised again: the cell fails, and a headless run
with it (ipywidgets' Output alone would print the traceback and carry on). After that it runs
only when the user asks: by default the panel has a Run button, and no control fires while it is
being dragged or typed into (`continuous_update=False`), so a slider never retrains the model for
every value it passes over and a text box never looks a model up per keystroke.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

PANEL_CLASS = "cm-panel"
OUTPUT_CLASS = "cm-panel-output"
RUN_CLASS = "cm-panel-run"
STALE_TEXT = "Settings changed: press Run to measure them."
SHOWN_TEXT = "The result computed above for these settings: change them and press Run."


def panel(callback: Callable[..., Any], controls: Mapping[str, Any], *, title: str = "",
          run_button: bool = True, shown: Any = None) -> Any:
    """Return a VBox of `controls` above an output area that shows `callback(**values)`.

    Args:
        callback: called with one keyword argument per control on every press of Run (or, with
            `run_button=False`, on every committed change); on start too, with the defaults, unless `shown`
            is given.
        controls: name -> ipywidgets control (its `value` is the default). Controls that can update while
            dragged or typed into get `continuous_update=False`.
        title: a line above the controls.
        run_button: add a Run button and run only when it is pressed (the default: panels here train,
            plan or load); False reruns on each committed change, for callbacks that take well under a second.
        shown: what the notebook already computed for the default values, shown on start instead of calling
            `callback` again: a function of no arguments that prints or draws it (cheaply), or a value (a
            string is printed, anything else displayed). It fails the panel as loudly as the callback does.

    Example:
        >>> import ipywidgets as ipw
        >>> panel(lambda lr: print(lr), {"lr": ipw.FloatLogSlider(value=1e-3, description="lr")})
    """
    import ipywidgets as widgets
    from ipywidgets.widgets.interaction import show_inline_matplotlib_plots

    if not controls:
        raise ValueError("panel needs at least one control")
    for name, control in controls.items():
        if not hasattr(control, "value"):
            raise TypeError(f"control {name!r} must be an ipywidgets control with a value, got {type(control).__name__}")
        if hasattr(control, "continuous_update"):
            control.continuous_update = False
        style = getattr(control, "style", None)
        if getattr(control, "description", "") and style is not None and hasattr(style, "description_width") \
                and not style.description_width:
            style.description_width = "initial"  # the whole label ('checkpointing'), not a clipped 'checkpoin...'

    out = widgets.Output()
    status = widgets.HTML("")

    def run(*_: Any, show: Callable[[], Any] | None = None) -> None:
        status.value = ""
        failed: list[BaseException] = []
        with out:
            out.clear_output(wait=True)
            try:
                if show is None:
                    callback(**{name: control.value for name, control in controls.items()})
                else:
                    show()
                show_inline_matplotlib_plots()
            except BaseException as exc:  # an interrupt too: a cell timeout's, or the user's
                failed.append(exc)
                raise  # the Output shows the traceback in the panel, and inside a kernel it stops there
        if failed:  # so raise it again: the cell (or the Run press) fails, and a headless run with it
            status.value = f"<b>{type(failed[0]).__name__}</b>: the run failed (traceback below)."
            raise failed[0]

    row = list(controls.values())
    if run_button:
        button = widgets.Button(description="Run", button_style="primary", tooltip="measure with these settings")
        button.add_class(RUN_CLASS)
        button.on_click(run)
        row.append(button)

        def stale(change: Mapping[str, Any]) -> None:
            if change.get("name") == "value":
                status.value = f"<i>{STALE_TEXT}</i>"

        for control in controls.values():
            control.observe(stale, names="value")
        box_children = [widgets.HBox(row, layout=widgets.Layout(flex_flow="row wrap")), status, out]
        box_run = button
    else:
        for control in controls.values():
            control.observe(run, names="value")
        box_children = [widgets.HBox(row, layout=widgets.Layout(flex_flow="row wrap")), out]
        box_run = None
    header = [widgets.HTML(f"<b>{title}</b>")] if title else []
    box = widgets.VBox([*header, *box_children])
    box.output = out  # for tests: the rendered result lives here
    box.run_button = box_run  # for tests: None without a Run button
    box.run = run  # for tests: what a press of Run does
    # For the browser test (tests/browser): CSS classes that find the panel and its output in the page.
    box.add_class(PANEL_CLASS)
    out.add_class(OUTPUT_CLASS)
    try:
        if shown is None:
            run()
        else:
            run(show=_shower(shown))
            if box_run is not None:
                status.value = f"<i>{SHOWN_TEXT}</i>"
    except BaseException:
        _display_in_kernel(box)  # the cell fails before it returns the panel: show the failed panel all the same
        raise
    return box


def _shower(shown: Any) -> Callable[[], Any]:
    """Return a function that shows `shown`: calls it, prints a string, displays anything else."""
    if callable(shown):
        return shown
    if isinstance(shown, str):
        return lambda: print(shown)

    def show() -> None:
        from IPython.display import display

        display(shown)

    return show


def _display_in_kernel(box: Any) -> None:
    """Display `box` where an IPython kernel runs (nothing elsewhere: a plain script or a test)."""
    from IPython import get_ipython
    from IPython.display import display

    if getattr(get_ipython(), "kernel", None) is not None:
        display(box)
