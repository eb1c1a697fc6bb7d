"""The recipe and the training step: the techniques put together and run.

Holds: `recipe` (the `Recipe`: which techniques, built on a model in one pass), `presets` (named recipes),
`train` (the training step and loop that applies a recipe), `loading` (loading and saving models for a recipe:
shard by shard, int8, the trained weights, and what a 4-bit load holds) and `merge` (a LoRA adapter merged into its
base from the files, one tensor at a time).

May import: `colab_memopt.core` and `colab_memopt.techniques`.
"""
