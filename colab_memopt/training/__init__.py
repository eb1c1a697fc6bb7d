"""The recipe and the training step: the techniques put together and run.

Holds: `recipe` (the `Recipe`: which techniques, built on a model in one pass), `presets` (named recipes),
`train` (the training step and loop that applies a recipe) and `loading` (loading and saving models for a recipe:
shard by shard, int8, the trained weights).

May import: `colab_memopt.core` and `colab_memopt.techniques`.
"""
