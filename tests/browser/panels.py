"""What the browser test does to each notebook's panel, and the code that drives JupyterLab to do it.

`PANELS` names, for every notebook with a `widgets.panel`, the control (or controls) the test changes before
it presses Run, and what the panel must show afterwards; `EXCLUDED` names notebooks left out, each with its reason. A notebook with a
panel in neither fails tests/browser/test_panels.py::test_every_panel_is_covered_or_excluded, so a new
notebook is covered by adding one line here.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

from colab_memopt.tooling.widgets import OUTPUT_CLASS, PANEL_CLASS, RUN_CLASS

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# What this closed network needs: no GPU, no sandbox (root in CI), no calls home, a fresh profile.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
)
TRACEBACK = "Traceback (most recent call last)"
KINDS = ("select", "toggle", "slider")


# An expected text: a string the notebook's own code prints, or a function of the notebook's CI parameters that
# returns it from the package code that prints it (so a changed printout changes the expectation with it).
Expected = Union[str, Callable[[dict[str, Any]], str]]


@dataclass(frozen=True)
class Change:
    """One control to change in a panel and what the panel must show after the change.

    Attributes:
        control: the control's description label as shown in the panel.
        kind: "select" (Dropdown), "toggle" (Checkbox) or "slider" (IntSlider, typed into its readout).
        value: the option to select or the number to type; unused for "toggle".
        plot: whether the panel draws a plot (its image must be there before and differ after).
        expect: text the panel's output must contain after the change ("" for none), or a function of the
            notebook's CI parameters that returns it (`resolved`).
        expect_gone: text the panel's output shows before the change and must not show after ("" for none),
            or such a function.
    """

    control: str
    kind: str
    value: str = ""
    plot: bool = False
    expect: Expected = ""
    expect_gone: Expected = ""

    def resolved(self, params: dict[str, Any]) -> Change:
        """Return this change with `expect` and `expect_gone` as strings, computed from `params` where they are
        functions."""
        text = {name: value(params) if callable(value) else value
                for name, value in (("expect", self.expect), ("expect_gone", self.expect_gone))}
        return replace(self, **text)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Change.kind {self.kind!r}: use one of {KINDS}")
        if self.kind == "slider" and not self.value.lstrip("-").isdigit():
            raise ValueError(f"Change.value {self.value!r}: a slider needs an integer to type into its readout")
        if self.kind == "select" and not self.value:
            raise ValueError("Change.value '': name the option to select")


# -- expected texts read from the code that prints them ---------------------------------------------------------------

def plan_last_line(params: dict[str, Any]) -> str:
    """The last line a plan prints (`Plan.__str__`): once it is there, the whole plan has arrived."""
    import colab_memopt as cm

    return str(cm.plan("tiny", 1, seq_len=16, method="analytic", find_max_batch=False)).splitlines()[-1]


def report_head(label: str) -> str:
    """The start of a step's report (`MemoryReport.__str__`) labelled `label`, up to its device."""
    import colab_memopt as cm

    marker = "<device>"
    return str(cm.MemoryReport(0, {}, {}, {}, {}, {}, 0.0, marker, "measured", label=label)).split(marker)[0]


def recommended(mode: str) -> str:
    """What a recommendation's first line says of a mode that fits (`Recommendation.__str__`)."""
    from colab_memopt.planning import recommender

    return f"{recommender._MODE_WORDS[mode]} fits"


# notebook stem -> the change (or changes, set together before one press of Run) the browser test makes.
# Pick a change that is cheap at the CI parameters. Texts the package prints are read from its code (the functions
# above), never typed in here: a changed printout changes the expectation with it (four panels' did, and their
# typed-in expectations failed outside CI).
PANELS: dict[str, Change | tuple[Change, ...]] = {
    "00_where_the_memory_goes": Change("optimizer", "select", "sgd", plot=True, expect="sgd", expect_gone="optimizer_state"),
    # the settings a T4 user asks about: precision, mode, checkpointing and optimizer, in one plan (the plan's last
    # line is printed after the plan, so the whole plan has arrived before the check reads it)
    "01_will_it_fit": (Change("precision", "select", "fp16-autocast"), Change("mode", "select", "qlora", expect=plan_last_line),
                       Change("checkpointing", "select", "full"),
                       Change("optimizer", "select", "sgd", expect="qlora · fp16-autocast · checkpointing full · sgd",
                              expect_gone="optimizer_state")),
    "02_mixed_precision": Change("precision", "select", "bf16", plot=True, expect="bf16"),
    "03_activation_checkpointing": Change("policy", "select", "selective", plot=True, expect="selective"),
    "04_gradient_accumulation": Change("steps", "slider", "4", plot=True, expect="4 steps"),
    "05_memory_efficient_attention": Change("attention", "select", "naive", expect="naive"),
    "06_lean_optimizers": Change("optimizer", "select", "sgd_momentum", plot=True, expect="sgd_momentum"),
    # the panel first shows the report measured above (labelled "qlora_nf4"), then the one its callback labels
    "07_weight_quantization": Change("base", "select", "fp4", plot=True,
                                     expect=lambda p: report_head(f"fp4 r{p['lora_rank']}"),
                                     expect_gone=lambda p: report_head("qlora_nf4")),
    "08_activation_compression": Change("checkpoint blocks", "toggle", plot=True, expect="+ckpt"),
    "09_cpu_offload": Change("prefetch", "slider", "0", plot=True, expect="prefetch 0", expect_gone="prefetch 1"),
    "10_deepspeed_zero": Change("stage", "select", "1"),
    "11_memory_profiling_and_monitoring": Change("leak", "toggle", plot=True),
    "12_dynamic_batch_size_and_oom": Change("pressure MiB", "slider", "0", expect="recoveries 0"),
    "13_semiseparable_matrices": Change("factors", "select", "float16", expect="float16 factors"),
    "14_phase_aware_training": Change("phase", "select", "full", plot=True),
    # mode auto, fastest (the default) picks full fine-tuning; the least memory is QLoRA's
    "15_fit_the_biggest_model": Change("objective", "select", "least_memory", expect=lambda p: recommended("qlora"),
                                       expect_gone=lambda p: recommended("full")),
    "16_full_finetuning_on_a_t4": Change("method", "select", "adamw_16bit_kahan", plot=True, expect="adamw_16bit_kahan at lr",
                                         expect_gone="lomo at lr"),
    "17_long_context": Change("chunked loss", "toggle", plot=True, expect="chosen"),
    "18_your_own_model": Change("mode", "select", "full", expect=lambda p: recommended("full"),
                                expect_gone=lambda p: recommended(p["mode"])),
    "19_your_trainer_on_a_free_t4": Change("optim", "select", "adafactor", expect="optim='adafactor'"),
}
# notebook stem -> why its panel is not driven in the browser.
EXCLUDED: dict[str, str] = {}


def chromium_missing_reason() -> str:
    """Return why the browser test cannot run here, or "" when Chromium and Playwright are installed."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (run `make test-browser`, which installs Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python playwright package is not installed (run `make test-browser`)"
    return ""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """Stop a process started in its own session: SIGTERM to its group, then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Lab:
    url: str
    token: str
    root: Path

    def tree_path(self, path: Path) -> str:
        return path.resolve().relative_to(self.root.resolve()).as_posix()


@contextlib.contextmanager
def jupyter_lab(root: Path, *, start_timeout_s: float = 120) -> Iterator[Lab]:
    """Run JupyterLab from this Python's environment on a free localhost port with a token; stop it after."""
    import secrets

    port, token = free_port(), secrets.token_hex(16)
    home = Path(tempfile.mkdtemp(prefix="cm-lab-"))
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # let ipykernel pick the inline backend
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"))
    # No news or update checks from the page on a closed network.
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"checkForUpdates": false, "fetchNews": "false"}')
    # Attach and paint every cell: the default ('contentVisibility') may skip painting a redrawn plot, and
    # screenshots of the panel must show what was drawn.
    notebook_settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
    if os.geteuid() == 0:  # CI machines run as root
        cmd.append("--allow-root")
    log = (home / "lab.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({proc.returncode}):\n{(home / 'lab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"JupyterLab did not answer on {url} within {start_timeout_s:.0f} s")
            time.sleep(0.5)
        yield Lab(url, token, root)
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """Yield a Playwright browser context of headless Debian Chromium with a fresh profile; close both after."""
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="cm-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=str(CHROMIUM), headless=True, args=list(CHROMIUM_FLAGS),
                viewport={"width": 1400, "height": 1000}, timeout=120_000,
            )
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


_OPEN_AND_RUN = """async ([path, timeoutMs]) => {
  const app = window.jupyterapp;
  await app.restored;
  const nb = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await nb.context.ready;
  await nb.sessionContext.ready;
  const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error('run-all timed out')), timeoutMs));
  const ok = await Promise.race([app.commands.execute('notebook:run-all-cells'), timeout]);
  return ok;
}"""
_KERNEL_IDLE = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  const kernel = nb && nb.sessionContext.session && nb.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}"""
_PANEL_STATE = """(el) => {
  const out = el.querySelector('.%s');
  const img = out ? out.querySelector('img') : null;
  return {text: out ? out.innerText : '', image: img ? img.src : ''};
}""" % OUTPUT_CLASS
_FIRST_CELL_ERROR = """() => {
  const nb = window.jupyterapp.shell.currentWidget;
  for (const cell of nb.content.widgets) {
    const outputs = cell.model.outputs;
    if (!outputs) continue;
    for (let i = 0; i < outputs.length; i++) {
      const o = outputs.get(i).toJSON();
      if (o.output_type === 'error') return o.ename + ': ' + o.evalue;
    }
  }
  return '';
}"""


@dataclass
class PanelResult:
    before_text: str
    after_text: str
    before_image_sha: str
    after_image_sha: str
    run_seconds: float
    change_seconds: float


def _sha(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:12] if src else ""


def _panel_state(panel) -> dict:  # noqa: ANN001 - a Playwright locator
    return panel.evaluate(_PANEL_STATE)


def _save_plot(src: str, path: Path) -> None:
    """Write the panel's plot as the kernel sent it (a data: URL of a PNG), next to the screenshot."""
    head, _, data = src.partition(",")
    if head.startswith("data:image/png;base64"):
        path.write_bytes(base64.b64decode(data))


def _screenshot(panel, path: Path) -> None:  # noqa: ANN001 - a Playwright locator
    """Screenshot the panel once its images are decoded and painted."""
    panel.scroll_into_view_if_needed()
    panel.evaluate("""async (el) => {
      // Swap each image for a freshly decoded copy: under load Chromium may keep a half-painted decode.
      await Promise.all([...el.querySelectorAll('img')].map(async (img) => {
        const copy = img.cloneNode();
        await copy.decode().catch(() => null);
        img.replaceWith(copy);
      }));
      await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
    }""")
    # Under load the compositor paints a large image in tiles: wait until two shots agree (at most ~10 s).
    shot = panel.screenshot()
    for _ in range(20):
        panel.page.wait_for_timeout(500)
        again = panel.screenshot()
        if again == shot:
            break
        shot = again
    path.write_bytes(shot)


def changes_of(entry: Change | tuple[Change, ...], params: dict[str, Any] | None = None) -> tuple[Change, ...]:
    """Return a PANELS entry as a tuple of changes; with `params` (the notebook's CI parameters), their expected
    texts computed (`Change.resolved`)."""
    changes = entry if isinstance(entry, tuple) else (entry,)
    return changes if params is None else tuple(c.resolved(params) for c in changes)


def _change(panel, entry: Change | tuple[Change, ...]) -> None:  # noqa: ANN001 - a Playwright locator
    """Set every control of `entry`, then press the panel's Run button (as a person would)."""
    for change in changes_of(entry):
        _set(panel, change)
    run = panel.locator(f".{RUN_CLASS}")
    if run.count():
        run.first.click()


def _set(panel, change: Change) -> None:  # noqa: ANN001 - a Playwright locator
    if change.kind == "select":
        control = panel.locator(".widget-dropdown").filter(has=panel.page.get_by_text(change.control, exact=True))
        control.locator("select").select_option(label=change.value)
    elif change.kind == "toggle":
        panel.locator(".widget-checkbox").filter(has_text=change.control).locator("input[type=checkbox]").click()
    elif change.kind == "slider":
        control = panel.locator(".widget-slider").filter(has=panel.page.get_by_text(change.control, exact=True))
        readout = control.locator(".widget-readout")
        readout.click()
        readout.press("Control+A")
        readout.type(change.value)
        readout.press("Enter")
    else:
        raise ValueError(f"change kind {change.kind!r}: use 'select', 'toggle' or 'slider'")


def check_panel(context, lab: Lab, notebook: Path, change: Change | tuple[Change, ...], screenshots: Path, *,  # noqa: ANN001
                run_timeout_s: float, change_timeout_s: float) -> PanelResult:
    """Open `notebook` in JupyterLab, run all cells, check its panel renders and redraws after `change`.

    Raises AssertionError naming what failed: a cell error, no rendered panel (the text fallback), an empty
    output, an output that does not change, a missing or unchanged plot, or a traceback in the panel.
    """
    stem = notebook.stem
    changes = changes_of(change)
    unresolved = [c.control for c in changes if callable(c.expect) or callable(c.expect_gone)]
    assert not unresolved, f"{stem}: resolve the expected texts of {unresolved} first (changes_of(entry, params))"
    plot = any(c.plot for c in changes)
    expects = [c.expect for c in changes if c.expect]
    gones = [c.expect_gone for c in changes if c.expect_gone]
    controls = ", ".join(repr(c.control) for c in changes)
    page = context.new_page()
    try:
        page.goto(f"{lab.url}/lab?reset&token={lab.token}", timeout=120_000)
        page.wait_for_function("() => window.jupyterapp !== undefined", timeout=120_000)
        start = time.monotonic()
        ok = page.evaluate(_OPEN_AND_RUN, [lab.tree_path(notebook), int(run_timeout_s * 1000)])
        run_seconds = time.monotonic() - start
        error = page.evaluate(_FIRST_CELL_ERROR)
        assert ok and not error, f"{stem}: running all cells failed in JupyterLab: {error or 'run-all returned false'}"
        panels = page.locator(f".{PANEL_CLASS}")
        if panels.count() == 0:
            fallback = page.get_by_text("VBox(children=").count()
            raise AssertionError(f"{stem}: no rendered panel (.{PANEL_CLASS}) in the page"
                                 + (" - the widget shows as its text fallback" if fallback else ""))
        assert panels.count() == 1, f"{stem}: expected one panel, found {panels.count()}"
        panel = panels.first
        panel.scroll_into_view_if_needed()
        page.wait_for_function(_KERNEL_IDLE, timeout=60_000)
        with contextlib.suppress(Exception):  # the output (and plot) arrive after the cell: asserted just below
            page.wait_for_function("([el, plot]) => { const out = el.querySelector('.%s');"
                                   " if (!out || !out.innerText.trim()) return false; if (!plot) return true;"
                                   " const img = out.querySelector('img');"
                                   " return !!img && img.complete && img.naturalWidth > 0; }" % OUTPUT_CLASS,
                                   arg=[panel.element_handle(), plot], timeout=60_000)
        before = _panel_state(panel)
        screenshots.mkdir(parents=True, exist_ok=True)
        _screenshot(panel, screenshots / f"{stem}_before.png")
        _save_plot(before["image"], screenshots / f"{stem}_before_plot.png")
        assert before["text"].strip(), f"{stem}: the panel's output is empty before any change"
        assert TRACEBACK not in before["text"], f"{stem}: the panel shows an error before any change:\n{before['text'][-1500:]}"
        if plot:
            assert before["image"], f"{stem}: the panel draws no plot image before the change"

        start = time.monotonic()
        _change(panel, change)
        # Redrawn: the output differs from before and the kernel is idle again (the callback has finished).
        handle = panel.element_handle()
        try:
            page.wait_for_function(
                """([el, beforeText, plot, expects]) => {
                    const out = el.querySelector('.%s');
                    const nb = window.jupyterapp.shell.currentWidget;
                    const kernel = nb.sessionContext.session.kernel;
                    if (!out || !out.innerText.trim() || out.innerText === beforeText || kernel.status !== 'idle') return false;
                    // stdout from a widget callback can land after the kernel reports idle (ipykernel flushes it
                    // on a timer) and after stderr: wait for the expected text itself where there is one.
                    if (out.innerText.includes(%s)) return true;  // a failed callback: reported below
                    if (!expects.every((e) => out.innerText.includes(e))) return false;
                    if (!plot) return true;
                    const img = out.querySelector('img');  // drawn and decoded, so the screenshot shows it
                    return !!img && img.complete && img.naturalWidth > 0;
                }""" % (OUTPUT_CLASS, json.dumps(TRACEBACK)),
                arg=[handle, before["text"], plot, expects], timeout=change_timeout_s * 1000, polling=250,
            )
        except Exception as exc:  # Playwright's TimeoutError
            _screenshot(panel, screenshots / f"{stem}_after.png")
            now = _panel_state(panel)["text"]
            raise AssertionError(f"{stem}: the panel's output did not change within {change_timeout_s:.0f} s "
                                 f"after setting {controls} and pressing Run" + (" (or drew no plot)" if plot else "")
                                 + (f" (or never showed {expects})" if expects else "")
                                 + f"; it shows:\n{now[-1500:]}") from exc
        page.wait_for_timeout(500)  # let the last display messages land
        page.wait_for_function(_KERNEL_IDLE, timeout=60_000)
        change_seconds = time.monotonic() - start
        after = _panel_state(panel)
        _screenshot(panel, screenshots / f"{stem}_after.png")
        _save_plot(after["image"], screenshots / f"{stem}_after_plot.png")
        assert TRACEBACK not in after["text"], f"{stem}: the callback failed after the change:\n{after['text'][-1500:]}"
        for expect in expects:
            assert expect in after["text"], f"{stem}: expected {expect!r} in the output after the change:\n{after['text'][-1500:]}"
        for gone in gones:
            assert gone in before["text"], f"{stem}: expected {gone!r} in the output before the change"
            assert gone not in after["text"], f"{stem}: {gone!r} still in the output after the change:\n{after['text'][-1500:]}"
        if plot:
            assert after["image"], f"{stem}: the panel's plot is gone after the change"
            assert after["image"] != before["image"], f"{stem}: the panel's plot did not change after setting {controls}"
        return PanelResult(before["text"], after["text"], _sha(before["image"]), _sha(after["image"]),
                           run_seconds, change_seconds)
    finally:
        with contextlib.suppress(Exception):
            page.evaluate("async () => { const nb = window.jupyterapp.shell.currentWidget; "
                          "if (nb && nb.sessionContext) await nb.sessionContext.shutdown(); }")
        page.close()
