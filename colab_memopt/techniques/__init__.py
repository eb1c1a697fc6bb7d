"""The model, the data and the memory-saving techniques: one module each, each usable alone.

Holds: the course's reference model (`models`, `architectures` for the named Hugging Face shapes), its data
(`data`, `evaluation`), and one module per technique: `precision`, `checkpointing`, `accumulation`, `attention`,
`optimizers`, `lowstate`, `lomo`, `rounding`, `quantization`, `int8train`, `compression`, `offload`, `tiling`, `loss`,
`zero`, `structured`, `phases`, `batching`. A notebook's machinery is in the module with its technique's word.

May import: `colab_memopt.core`.
"""
