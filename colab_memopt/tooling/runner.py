"""Execute every notebook headless and gather their results (`make run`, and the notebook tests).

A tool for a checkout of the repository, not for an installed package: it runs the notebooks in the
checkout's notebooks/ folder with the CI parameters of its tests/ folder. From an installed package it
stops with one line that says so (`check_checkout`).

    python -m colab_memopt.tooling.runner [--out build] [--cpu-params tests/notebook_parameters.yaml] [NAMES...]

With a CUDA GPU present the notebooks run with their own (Colab-sized) defaults; without one, with
the CPU-sized parameters of the parameters file. Every run injects `results_dir`.

It writes under `--out` only (build/: the executed notebooks, results.json, claims.md), so a run
leaves the checkout as it was. The README's notebook index is refreshed on purpose, from those
results, by `make readme` (`python -m colab_memopt.tooling.rollup`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
CPU_PARAMS_FILE = REPO_ROOT / "tests" / "notebook_parameters.yaml"


def check_checkout(root: Path = REPO_ROOT) -> None:
    """Raise ValueError, naming what is missing, unless `root` is a checkout with notebooks/ and the CI parameters."""
    missing = [str(p) for p in (root / "notebooks", root / "tests" / "notebook_parameters.yaml") if not p.exists()]
    if missing:
        from colab_memopt.tooling.project import REPOSITORY_URL

        raise ValueError(
            f"the runner executes the notebooks of a checkout of the repository, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not there "
            f"(this package is installed, not checked out). Clone {REPOSITORY_URL} and run `make run` in it; to run one "
            "notebook, open it in Jupyter or Colab.")


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    """Return the notebooks to run: all of `notebooks/NN_*.ipynb`, or those named (stem, prefix or path)."""
    paths = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return paths
    names = [Path(n).stem if n.endswith(".ipynb") else n for n in names]  # notebooks/10_x.ipynb -> 10_x
    chosen = [p for p in paths if any(p.stem == n or p.stem.startswith(n) for n in names)]
    missing = [n for n in names if not any(p.stem == n or p.stem.startswith(n) for p in paths)]
    if missing:
        raise ValueError(f"no notebook matches {missing}; have {[p.stem for p in paths]}")
    return chosen


def load_cpu_parameters(path: Path = CPU_PARAMS_FILE) -> dict[str, dict[str, Any]]:
    """Return the CI parameters: notebook stem -> {parameter: value}; 'budget_seconds' is the runner's."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must map notebook names to parameters")
    return data


@dataclass
class NotebookRun:
    """One executed notebook."""

    name: str
    output: Path
    seconds: float
    parameters: dict[str, Any]


CELL_TIMEOUT_SECONDS = 1800  # a cell that runs longer is stopped with an error, never waited on forever


def check_cell_timeout(cell_timeout: Any) -> float:
    """Return `cell_timeout` if it is a finite number of seconds > 0 (nbclient reads 0 and negatives as "no limit")."""
    import math

    if isinstance(cell_timeout, bool) or not isinstance(cell_timeout, (int, float)) or not math.isfinite(cell_timeout) \
            or cell_timeout <= 0:
        raise ValueError(f"cell_timeout must be a finite number of seconds > 0 (0 or less would turn the hang "
                         f"protection off), got {cell_timeout!r}")
    return cell_timeout


CPU_CELL_TIMEOUT_FLOOR_SECONDS = 600


def cell_timeout_for(name: str, *, gpu: bool, cpu_params: dict[str, dict[str, Any]], cell_timeout: float) -> float:
    """Return the seconds one cell of notebook `name` may run: `cell_timeout`, and on the CPU at most three times
    the notebook's whole CI budget (at least 600 s), so that a kernel that went idle without replying (below) costs
    minutes, not half an hour."""
    budget = (cpu_params.get(name) or {}).get("budget_seconds") if not gpu else None
    if not budget:
        return cell_timeout
    return min(cell_timeout, max(CPU_CELL_TIMEOUT_FLOOR_SECONDS, 3 * budget))


def failure_line(name: str, exc: BaseException, output: Path) -> str:
    """Return one line saying which notebook failed, in which cell, with what, and where its output is."""
    cell = getattr(exc, "exec_count", None) or getattr(exc, "cell_index", None)
    what = f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', str(exc))}"
    where = f" in cell {cell}" if cell is not None else ""
    return f"notebook {name} failed{where}: {' '.join(what.split())[:300]}; its output: {output}"


def run_notebook(path: Path, out_dir: Path, results_dir: Path, parameters: dict[str, Any],
                 cell_timeout: float = CELL_TIMEOUT_SECONDS) -> NotebookRun:
    """Execute one notebook with papermill, writing the executed copy into `out_dir`.

    A cell that runs past `cell_timeout` seconds fails the notebook (papermill's `execution_timeout`):
    a lost kernel message, which left `make run` waiting forever once on this 2-core machine, is
    an error that names the notebook instead of a hang. (Reproduced: notebook 08 alone, 2 of 19 runs
    on a loaded 2-core machine, both in its panel cell: every iopub message of the cell reached
    papermill, its execute_result and the kernel's `idle` status included, but the shell channel's
    execute_reply never did, and papermill waits for that; the kernel sat idle. ipykernel 7.4.0,
    pyzmq 27.3.0, jupyter_client 8.10.0: the class of ipykernel#1529 and #1554.)
    """
    import papermill

    check_cell_timeout(cell_timeout)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {**parameters, "results_dir": str(results_dir)}
    output = out_dir / path.name
    start = time.perf_counter()
    papermill.execute_notebook(
        str(path),
        str(output),
        parameters=params,
        kernel_name="python3",
        cwd=str(path.parent),
        progress_bar=False,
        execution_timeout=cell_timeout,
    )
    return NotebookRun(path.stem, output, time.perf_counter() - start, params)


def prepare_notebook(path: Path, out_dir: Path, results_dir: Path, parameters: dict[str, Any]) -> Path:
    """Write a copy of a notebook with the parameters injected and nothing executed (papermill)."""
    import papermill

    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    papermill.execute_notebook(
        str(path), str(output), parameters={**parameters, "results_dir": str(results_dir)},
        kernel_name="python3", prepare_only=True, progress_bar=False,
    )
    return output


def parameters_for(name: str, *, gpu: bool, cpu_params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Return the parameters to inject into notebook `name`: none on a GPU, the CPU set otherwise."""
    if gpu:
        return {}
    params = dict(cpu_params.get(name) or {})
    params.pop("budget_seconds", None)
    return params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebooks to run (stem or number prefix); default all")
    parser.add_argument("--out", default=str(REPO_ROOT / "build"), help="build folder (default: build/)")
    parser.add_argument("--cpu-params", default=str(CPU_PARAMS_FILE), help="parameters used without a GPU")
    parser.add_argument("--cpu-sized", action="store_true", help="use the CPU parameters even on a GPU")
    parser.add_argument("--prepare-only", metavar="DIR", help="only write CPU-parameterised copies into DIR (for nbval)")
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT_SECONDS,
                        help=f"seconds a cell may run before the notebook fails (default {CELL_TIMEOUT_SECONDS}; on the "
                             "CPU at most 3x the notebook's budget, at least 600); a timed-out notebook runs once more")
    args = parser.parse_args(argv)
    try:
        check_checkout()
        check_cell_timeout(args.cell_timeout)
        out = Path(args.out).resolve()
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out must be a folder, got the file {args.out!r}")
        return _run(args, out)
    except (ValueError, OSError) as exc:  # the user's arguments or file system: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, out: Path) -> int:
    # Absolute (resolved in main): papermill runs each notebook in its own folder, where a relative path would point elsewhere.
    results_dir = out / "results"
    cpu_params = load_cpu_parameters(Path(args.cpu_params))
    paths = notebook_paths(args.names)
    if args.prepare_only:  # before torch and the report's imports (about 4 s, before any test starts)
        for path in paths:
            prepare_notebook(path, Path(args.prepare_only), results_dir, parameters_for(path.stem, gpu=False, cpu_params=cpu_params))
        print(f"prepared {len(paths)} notebook(s) with CI parameters in {args.prepare_only}")
        return 0

    import torch

    from colab_memopt.core.fileio import atomic_write_text, write_json
    from colab_memopt.core.report import merge_results, summary_table

    gpu = torch.cuda.is_available() and not args.cpu_sized
    print(f"running {len(paths)} notebook(s) on {'CUDA with Colab defaults' if gpu else 'the CPU with CI parameters'}")
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    failed = []
    for path in paths:
        print(f"  {path.stem}: running", flush=True)
        timeout = cell_timeout_for(path.stem, gpu=gpu, cpu_params=cpu_params, cell_timeout=args.cell_timeout)
        for attempt in (1, 2):
            try:
                run = run_notebook(path, out / "notebooks", results_dir, parameters_for(path.stem, gpu=gpu, cpu_params=cpu_params),
                                   cell_timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - papermill's execution error, a dead kernel, a timeout: name the notebook
                if attempt == 1 and isinstance(exc, TimeoutError):
                    # A kernel can send a cell's whole output and its idle status, but lose the execute_reply
                    # (notebook 08's panel cell, 2 of 19 runs here; run_notebook): a timeout is retried once, a
                    # real hang fails twice.
                    print(f"  {failure_line(path.stem, exc, out / 'notebooks' / path.name)}\n"
                          f"  {path.stem}: running it once more (a kernel can go idle without replying)", flush=True)
                    continue
                failed.append(failure_line(path.stem, exc, out / "notebooks" / path.name))
                print(f"  {failed[-1]}", file=sys.stderr, flush=True)
                break
            print(f"  {run.name}: {run.seconds:.1f} s -> {run.output.relative_to(out.parent) if out.is_relative_to(out.parent) else run.output}")
            break
    merged = merge_results(results_dir)
    write_json(out / "results.json", merged)
    print()
    print(summary_table(merged))
    print(f"\nwrote {out / 'results.json'}")
    from colab_memopt.tooling.rollup import claims_markdown

    atomic_write_text(out / "claims.md", claims_markdown(merged))
    print(f"wrote {out / 'claims.md'}")
    if not args.names:
        print("the README's notebook index is unchanged: `make readme` refreshes it from these results")
    if failed:
        print(f"{len(failed)} of {len(paths)} notebook(s) failed:", *failed, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
