"""The recipe and the training step: the techniques put together and run.

Holds: `recipe` (the `Recipe`: which techniques, built on a model in one pass), `presets` (named recipes),
`train` (the training step and loop that applies a recipe), `loading` (`load_model`: a model loaded for a recipe,
shard by shard), `loadplan` (what a load needs before it runs, a 4-bit one included), `checkpoints` (a checkpoint's
files read safely), `int8load` (`load_int8`: one tensor at a time to int8), `saving` (the trained weights saved so
they load back as trained) and `merge` (a LoRA adapter merged into its base from the files, one tensor at a time).

May import: `colab_memopt.core` and `colab_memopt.techniques`.
"""
