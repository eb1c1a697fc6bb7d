"""The wheels a lent GPU machine lacks, for `make test-gpu` without a network (`make gpu-wheels`).

    python -m colab_memopt.tooling.wheelhouse [--dest build/wheelhouse] [--limit-mib 60] [--dry-run]

The GPU machines this project can borrow (one H100 or H200) have Python 3.12, torch, transformers, peft,
accelerate, matplotlib, pytest and many more (`IMAGE_PACKAGES`), no network, and receive at most 64 MiB
per command. This recipe:

1. takes what `make test-gpu` imports (`gpucheck.NEEDED`) and every dependency of it, from this
   environment's own package metadata (extras left out, markers read for Linux and Python 3.12);
2. leaves out what the machine's image already holds (`IMAGE_PACKAGES`), torch with its CUDA libraries
   (never carried: the image's torch is the one under test), and declared dependencies nothing here
   imports (`NOT_IMPORTED`: ipykernel's debugger, IPython's completion, the widgets' front-end files);
3. downloads each of the rest at the version installed here (requirements.txt's pins) for CPython 3.12
   on manylinux x86_64, without its dependencies (`pip download --no-deps --only-binary=:all:
   --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 ...`); DeepSpeed is an
   sdist, so it comes as one, with setuptools and wheel for its build (pip builds it in isolation);
4. splits the files into parts of at most `--limit-mib` MiB (60 by default: a call carries at most 64),
   each part installable on its own: a part holds whole packages with every lacking dependency they
   have (a dependency two parts need is in both), and `manifest.json` says which packages each part gives.
   Packages built from an sdist (DeepSpeed) come last, in parts of their own: part1 holds every wheel
   (56.7 MiB on 2026-11-26), which with the checkout is the one call's carry (`gpucheck plan`).

`python -m colab_memopt.gpucheck --only install --wheelhouse DIR/partN` then installs that part offline,
in one pip call, one package at a time if that fails (`gpucheck.install_missing`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
DEFAULT_LIMIT_MIB = 60
# The 'cuda' image of nvidia-h100-x1 and nvidia-h200 (the workplace's device kinds list, read on a machine
# running it on 2026-11-17): what a call finds installed. Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pyre-extensions
pygments pyparsing pyproject-hooks pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
NEVER_CARRIED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")  # the image's torch stack is what is tested
# Declared dependencies that nothing make test-gpu runs imports (installs are --no-deps): left out, 14 MiB saved,
# so that one part carries everything.
NOT_IMPORTED = {
    "debugpy": "ipykernel's debugger only (ipykernel/debugger.py imports it inside try/except ImportError)",
    "jedi": "IPython's tab completion, imported lazily (IPython/core/completer.py)",
    "parso": "jedi's parser",
    "widgetsnbextension": "the classic Notebook's widget front-end files",
    "jupyterlab-widgets": "JupyterLab's widget front-end files",
}
SDIST_ONLY = {"deepspeed"}  # no wheel on PyPI: built on the machine (its ops JIT-compile on first use there)
# An sdist's isolated build needs them in the same folder (--no-index); pinned here, since this venv need not hold them.
BUILD_TOOLS = {"setuptools": "80.9.0", "wheel": "0.45.1"}
# pip matches each manylinux_2_N tag exactly; the image's glibc is newer than all of these (Python 3.12.3's Ubuntu).
# bitsandbytes 0.50.2 ships manylinux_2_24 only.
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


from colab_memopt.core.fileio import atomic_write, write_json  # noqa: E402
from colab_memopt.tooling.gpucheck import normalize  # noqa: E402 - one definition, in the module that installs


def version(name: str) -> str:
    """Return the version carried of `name`: the one installed here (requirements.txt's pins), or a build tool's pin."""
    return BUILD_TOOLS[name] if name in BUILD_TOOLS else metadata.version(name)


def requirements_of(name: str) -> list[str]:
    """Return the normalized names `name` (installed here) depends on on Linux/CPython 3.12, extras left out."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(TARGET_ENV):
            out.append(normalize(req.name))
    return out


def lacking(needed: list[str], image: frozenset[str] = IMAGE_PACKAGES) -> dict[str, list[str]]:
    """Return {top-level package: the packages it needs that the image lacks, itself first}, by this environment's metadata.

    Raises LookupError naming a needed package that is not installed here (its version could not be pinned).
    """
    have = {normalize(n) for n in image}
    groups: dict[str, list[str]] = {}
    for top in needed:
        top = normalize(top)
        seen, todo, order = set(), [top], []
        while todo:
            name = todo.pop(0)
            if name in seen or name in have or name in NOT_IMPORTED or NEVER_CARRIED.match(name):
                continue
            seen.add(name)
            try:
                metadata.version(name)
            except metadata.PackageNotFoundError:
                raise LookupError(f"{name!r} (needed by {top!r}) is not installed here: install requirements.txt first, "
                                  "so that its version can be pinned") from None
            order.append(name)
            todo += requirements_of(name)
        if order:
            groups[top] = order
    if any(n in SDIST_ONLY for g in groups.values() for n in g):
        for group in groups.values():
            if any(n in SDIST_ONLY for n in group):
                group += [t for t in BUILD_TOOLS if t not in group]
    return groups


def download_command(name: str, dest: Path) -> list[str]:
    """Return the `pip download` command of one package at this environment's version, for the lent machine."""
    pin = f"{name}=={version(name)}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest)]
    if name in SDIST_ONLY:
        return cmd + ["--no-binary=:all:", pin]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + [pin]


def _file_of(name: str, folder: Path) -> Path | None:
    """Return the wheel or sdist of distribution `name` in `folder`, if there."""
    want = normalize(name).replace("-", "_")
    for path in sorted(folder.iterdir()):
        stem = path.name.split("-")[0]
        if normalize(stem).replace("-", "_") == want and path.suffix in (".whl", ".gz", ".zip"):
            return path
    return None


@dataclass
class Part:
    """One carry: a folder of files, its bytes, and the top-level packages it installs completely."""

    name: str
    packages: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    bytes: int = 0


def split(groups: dict[str, list[str]], sizes: dict[str, int], limit_bytes: int,
          apart: frozenset[str] | set[str] = frozenset()) -> list[Part]:
    """Return parts of at most `limit_bytes`: whole groups (a package and its lacking dependencies), the largest first.

    A dependency two groups share is counted (and later copied) in each part that holds one of them. The groups
    named in `apart` (those that build from an sdist) come after the others, in parts of their own, so that part1
    holds every wheel when they fit: the one call on a lent machine carries part1 (gpuplan.CARRY).
    Raises ValueError naming a group that alone exceeds the limit.
    """
    parts: list[Part] = []
    first_apart = None
    for top, group in sorted(groups.items(), key=lambda kv: (kv[0] in apart, -sum(sizes[n] for n in kv[1]))):
        if top in apart and first_apart is None:
            first_apart = len(parts)
        for part in parts[first_apart or 0:] if top in apart else parts:
            extra = sum(sizes[n] for n in group if n not in part.files)
            if part.bytes + extra <= limit_bytes:
                break
        else:
            part = Part(f"part{len(parts) + 1}")
            parts.append(part)
            extra = sum(sizes[n] for n in group)
        if part.bytes + extra > limit_bytes:
            raise ValueError(f"{top!r} and the packages it needs take {extra / MiB:.1f} MiB, over the "
                             f"{limit_bytes / MiB:.0f} MiB a part may hold: {group}")
        part.packages.append(top)
        part.files += [n for n in group if n not in part.files]
        part.bytes += extra
    return parts


def build(dest: Path, needed: list[str], limit_mib: float = DEFAULT_LIMIT_MIB, dry_run: bool = False) -> dict:
    """Download what the lent machine lacks into `dest/all`, split it into `dest/partN`; return (and write) the manifest."""
    groups = lacking(needed)
    names = sorted({n for g in groups.values() for n in g})
    everything = dest / "all"
    commands = [download_command(n, everything) for n in names]
    if dry_run:
        return {"groups": groups, "commands": [" ".join(c) for c in commands]}
    everything.mkdir(parents=True, exist_ok=True)
    failures = {}
    for name, cmd in zip(names, commands):
        if _file_of(name, everything) is None:
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                failures[name] = (run.stderr.strip().splitlines() or ["?"])[-1]
    if failures:
        raise RuntimeError("pip download failed for " + "; ".join(f"{n}: {e}" for n, e in failures.items()))
    files = {n: _file_of(n, everything) for n in names}
    sizes = {n: f.stat().st_size for n, f in files.items()}
    parts = split(groups, sizes, int(limit_mib * MiB), {t for t, g in groups.items() if any(n in SDIST_ONLY for n in g)})
    for part in parts:
        folder = dest / part.name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for n in part.files:
            atomic_write(folder / files[n].name, lambda tmp, src=files[n]: shutil.copy2(src, tmp))
        part.files = sorted(files[n].name for n in part.files)
        write_json(folder / "manifest.json", asdict(part))
    manifest = {"limit_mib": limit_mib, "python": "3.12", "platforms": list(PLATFORMS),
                "groups": groups, "versions": {n: version(n) for n in names},
                "parts": [asdict(p) for p in parts]}
    write_json(dest / "manifest.json", manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    from colab_memopt.tooling.gpucheck import NEEDED

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=str(REPO_ROOT / "build" / "wheelhouse"))
    parser.add_argument("--limit-mib", type=float, default=DEFAULT_LIMIT_MIB, help="the most one part may hold (MiB)")
    parser.add_argument("--dry-run", action="store_true", help="print the packages and pip commands, download nothing")
    args = parser.parse_args(argv)
    if not 0 < args.limit_mib <= 64:
        parser.error(f"--limit-mib must be in (0, 64] (a call carries at most 64 MiB), got {args.limit_mib}")
    manifest = build(Path(args.dest), sorted(set(NEEDED.values())), args.limit_mib, args.dry_run)
    if args.dry_run:
        print(json.dumps(manifest, indent=2))
        return 0
    for part in manifest["parts"]:
        print(f"{args.dest}/{part['name']}: {part['bytes'] / MiB:5.1f} MiB, {len(part['files'])} files: {', '.join(part['packages'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
