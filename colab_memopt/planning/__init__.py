"""What fits before a run, and what went wrong after one.

Holds: the planner (`planner`: a step traced on fake tensors, with its parts: `targets` the devices, `prediction`
the `Plan` and its printout, `faketrace` the trace, `quantized` bitsandbytes' layers, `untraced` the lines a trace
does not produce; `estimate`: the closed-form estimate; `costs`: step-time ratios), what searches over plans
(`recommender` and its `candidates`, `capacity`), the Hugging Face side (`hfconfig`: your `SFTConfig`/`LoraConfig`
as a recipe and back; `trainer`: `plan_trainer`, with `trainertrace` the Trainer and its step on fake tensors,
`cudapaths` what a CUDA target's step takes another path for, `kbitprep` peft's `prepare_model_for_kbit_training`
and `libdefaults` the libraries' defaults a plan assumed; `trainerfit`: `fit_trainer`; `guard`: `MemoryGuardCallback`; `chat`: chat data and the merge), and after a run
(`monitor`, `oom`, `doctor`). Data files sit beside the code that reads them (`results/`: the capacity and context
tables).

May import: `colab_memopt.core`, `colab_memopt.techniques` and `colab_memopt.training`.
"""
