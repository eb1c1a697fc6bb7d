"""The tools around the course: the command line, the notebooks' runner, their plots and panels, and the GPU check.

Holds: `cli` (`python -m colab_memopt ...`), `runner` and `rollup` (run every notebook headless, summarise),
`project` (the course's order and what derives from it), `plots` and `widgets` (the notebooks' figures and panels;
they import matplotlib and ipywidgets), `gpucheck`, `gpuplan`, `gpurecord` and `wheelhouse` (`python -m
colab_memopt.gpucheck`: everything on a CUDA GPU; the one call on a lent machine planned, what it ran recorded), and
`layers` (this package's layers, which `tests/test_layers.py` enforces).

May import: every layer below.
"""
