"""How long the planning calls take, whole (imports included), each in a fresh process: issue 43's table.

    python benchmarks/planning_speed.py [--calls help plan_trainer_8b_qlora ...] [--whole plan_trainer_8b_qlora ...]
                                        [--sweep] [--repeat N] [--out FILE]

Writes benchmarks/results/planning_speed.json (rows of the calls run are replaced, the others kept). Each call runs in
its own Python process, as a user's first call does; the row records its wall seconds, its CPU seconds (user + system
of the child, `resource.getrusage(RUSAGE_CHILDREN)`), the 1-minute load average before and after, the progress lines
it printed on stderr, and the bytes it planned (the device need of its answer). The machine may be shared: the wall
time then says little, the CPU time is the figure to compare; the load average says how shared it was.

Again on 2026-11-29 at 16:58-17:24 UTC (tree 8af3972: the trace modes answer a fake tensor's `.device` themselves),
each call run three times in fresh processes (`--repeat 3`, the row is the median run; the fixed loop before a row
took 1.51-1.98 s, once 2.86 s):
- plan_trainer, 8B QLoRA: 9.2 s (8.8, 9.2, 9.2 s). The same call in the sweep at 17:21 took 10.4-11.0 s (the loop
  took 2.86 s just after it), and 9.6, 10.7 and 10.0 s re-run at 17:23 (target 10 s: met in the table's median, not
  in every run). About 6 s of it is not the plan: the user's own imports (4.3-4.9 s) and the
  interpreter's exit (1.1-1.5 s with the same imports and no plan). The plan is 2.8-3.1 s (1.8-2.0 s warm).
- The sweep of every built-in model (`--sweep`, rows sweep:KIND:MODEL; 4 x min(1,024, its longest sequence)):
  plan_trainer QLoRA 8.2-10.0 s (medians; 8B the slowest), plan_trainer full fine-tune 7.3-8.0 s, plan with its
  search 6.2-8.8 s.
- plan_trainer, 8B QLoRA at 1 x 40,960 tokens with `long_context`: 10.2 s (10.1-10.5 s): its tiled MLP and loss
  run 12,200 operations where the 4 x 1,024 step runs 7,300.
- fit_trainer drafts 11.2-12.3 s; doctor 6.2 s; recommend 16.1 s; context 8B QLoRA 33.4 s; each --help 0.07 s.

Again on 2026-11-29 at 15:42-15:43 UTC (tree 27d40d7; the loop 1.72 s before, 1.65 s after): planning traces also
skip MemTracker's per-module snapshots, which only measure_step reads.
- plan_trainer, 8B QLoRA: 9.1 s (the row); 9.2, 9.1 and 9.1 s in three more runs (target 10 s: met in each).

Again on 2026-11-29 at 15:16-15:19 UTC (tree eb5e33b; a fixed Python loop took 1.75 s before and 1.82 s after).
A plan_trainer step is traced without a ShapeEnv (its `.item()` is answered above the fake mode: 10% of the warm
plan); a planning call inside another no longer counts the frozen objects (`gc.get_freeze_count` walks each one).
- plan_trainer, 8B QLoRA: 9.5 s; 9.2, 9.5 and 9.6 s in three more runs (target 10 s: met in each, by
  0.4-0.8 s). Of it, the user's own imports are about 4.4 s and the interpreter's exit about 1.5 s.
- plan with its search, 8B QLoRA: 8.5 s; fit_trainer on notebook 19's draft 12.8 s, 8B QLoRA draft 13.1 s;
  recommend 17.9 s; doctor 6.5 s.

Again on 2026-11-29 at 12:23-12:26 UTC (tree 4db9972; a fixed Python loop took 1.61 s before and 1.72 s after).
Two changes: the largest-batch search reads the batch off the plan's own trace and one more where the two ran
different moments (the moments one ran alone bounded by their bytes there: tests/test_stack.py), and a plan keeps the
objects that were there before it out of the garbage collector's scans (`isolation.collector_spared`; the command
line also skips the interpreter's last full collection).
- plan with its search: 8B QLoRA 4 x 1,024 8.7 s; llama-3.2-1b QLoRA 4 x 512 8.4 s; smollm2-1.7b 8.0 s (were 11.3-11.8 s;
  target 10 s: met). Each traces 2 batches, not 3. At 11:25-11:30, three runs each: 8.3-9.2 s. The bytes equal the
  whole trace's (plan_1b_qlora@whole: 19.0 s).
- plan_trainer, 8B QLoRA: 10.2 s (the row); 9.2, 9.9 and 10.2 s at 11:25-11:30; 11.3, 10.0 and 9.4 s at 12:40 in a
  scratch file (target 10 s: at the line). Of a 9.7 s run: the user's own imports (`from trl import SFTConfig`, peft,
  transformers) 4.6 s, the plan 3.5 s (transformers.trainer's import 0.35 s, two shallow SFTTrainers built 0.7 s,
  their two traces 2.3 s), the interpreter's exit 1.6 s (1.3 s of it with the same imports and no plan).
- fit_trainer on notebook 19's draft 13.3 s; first drafts 12.5-13.0 s; doctor 6.4 s; recommend 18.5 s; context 8B
  QLoRA 39.2 s; long-context plan_trainer 11.6 s (22.2 s with every block traced, the same bytes); each --help
  0.07-0.10 s.

Again on 2026-11-29 at 09:55-09:57 UTC (tree 415f328; a fixed Python loop took 1.58-1.78 s):
- plan, 8B QLoRA 4 x 1,024: 11.5 s; llama-3.2-1b QLoRA 4 x 512: 11.8 s; smollm2-1.7b QLoRA 4 x 512: 11.3 s
  (target 10 s: not met). Each traces 3 batches (its own and two more); the plan alone, without its imports
  (3.4 s) and the interpreter's exit, is 6-7 s.
- plan_trainer, 8B QLoRA: 10.2 s (the row), then 10.5, 9.9 and 9.8 s (in a scratch file), then 10.2 and 9.9 s
  run in turn with the session's starting tree 517d8c9 (10.8 and 10.3 s): no slower; the machine was slower than
  at 08:54.

Again on 2026-11-29 at 09:34-09:38 UTC (tree a17b2a9; a fixed Python loop took 1.57 s before and 1.82 s
after: the machine slowed while the rows ran). A counted stack's largest-batch search now reads the batch off the
lines between its traces at two batches where both ran the same operations (tests/test_stack.py), and the rows for
`plan` with that search are new:
- plan, 8B QLoRA, 4 x 1,024 (does not fit; the search goes down): 11.3 s. plan, llama-3.2-1b QLoRA 4 x 512: 14.4 s;
  smollm2-1.7b QLoRA 4 x 512: 12.5 s (target 10 s: not met). There the traces at the two batches ran other
  operations: at 4 x 512 the tokens equal the hidden size (2,048), and autograd sums a LoRA layer's input
  gradients without the out-of-place add it runs at 3 or 5 x 512. So the search traced two more batches, as
  before; since 5128d7e it reads the lines off those two (3 traces instead of 4): 11.3 and 11.4 s.
  A sweep of `plan --batch 4 --seq 512 --target t4` over the built-in models (09:30-09:33, not rows): 4.3-7.5 s
  with the default recipe, 7.9-10.3 s with the QLoRA recipe above, but for those two (12.4 and 12.9 s).
- plan_trainer, 8B QLoRA: 9.0 s; the long-context row 11.7 s (21.5 s with every block traced, the same bytes).
- fit_trainer on notebook 19's draft 13.5 s; first drafts 12.9-13.8 s; doctor 8.2 s; recommend 21.1 s; context
  8B QLoRA 40.1 s; each --help 0.06-0.07 s.

Again on 2026-11-29 at 08:54-09:00 UTC (trees 55a69df and b27cd51, the same AMD EPYC, load 0.3-1.0; a
fixed Python loop took 1.50-1.71 s): plans of two-level offload (one offloaded copy per N blocks) and
plan_trainer's `long_context=` count the stack in units of N blocks; both traced every block before.
- context for 8B QLoRA: 36.7 and 38.5 s (was 85.7-91.9 s; target 90 s: met). The same five plans and answer (53,248
  tokens, 13.78 GiB); the three past the host's one-copy-per-block limit trace 6 and 10 blocks, not all 32.
- plan_trainer, 8B QLoRA: 8.7, 9.1, 9.2 and 9.5 s in four runs (target 10 s: met in each); the user's own imports
  (`from trl import SFTConfig`, peft's LoraConfig) are 4.2-4.7 s of it and the interpreter's exit about 1.3 s.
- plan_trainer, 8B QLoRA, 40,960 tokens with `long_context=cm.LongContext()` (a row of its own):
  10.2 and 10.8 s, 19.9 s with every block traced; the same 11,904,363,520 bytes.
- fit_trainer on notebook 19's draft 12.0 s; first drafts of 3B LoRA 12.0 s, 3B QLoRA 12.3 s, 8B QLoRA 12.6 s.
- doctor, 8B QLoRA recipe: 7.6 s; recommend for llama-3.2-3b: 19.6 s; each --help: 0.06 s.

Again on 2026-11-29 at 07:19-07:20 UTC (tree 893985d; a fixed Python loop took 1.67 s before and 1.97 s after):
fit_trainer no longer plans a smaller batch that the plan at the settings' own batch bounds over the limit.
- fit_trainer on notebook 19's draft: 14.7 s; first drafts of 3B LoRA 14.0 s, 3B QLoRA 16.4 s, 8B QLoRA 16.5 s, each
  in 4 plans (were 5 or 6; target 30 s: met).
- plan_trainer, 8B QLoRA: 11.8 s (the machine slowing while it ran; 9.5-11.0 s below).
- `python -m colab_memopt plan --model llama-3.1-8b --batch 4 --seq 1024 --target t4 --recipe lora_rank=16
  quantization=nf4 precision=fp16-autocast` (not a row): 9.7 s.

Again on 2026-11-29, 05:52-05:56 UTC (the same AMD EPYC, load 0.3-1.0; a fixed Python loop took 1.68 s before and
1.91 s after: the machine slowed by about 14% while the rows ran): a Trainer trace with gradient accumulation now runs
one micro-batch, the gradients made before it, where it ran two (the same figures, tests/test_trainer_speed.py), and
the tracker no longer keeps each step's graph alive (tree 4e3a8ae):
- plan_trainer, 8B QLoRA: 10.4 s (9.5 and 11.0 s in two more runs minutes apart; target 10 s: met in one of three;
  the user's own imports, `from trl import SFTConfig` and peft's LoraConfig, are about 7 s of it).
- fit_trainer on notebook 19's draft: 15.8 s (was 21.2 s); first drafts of 3B LoRA 18.1 s, 3B QLoRA 17.9 s, 8B QLoRA
  17.8 s (were 26.7, 25.9 and 22.4 s; target 30 s: met).
- doctor, 8B QLoRA recipe: 8.2 s (target 10 s: met).
- recommend for llama-3.2-3b: 21.9 s (was 35.2 s; target 30 s: met). Same answer, every 8th layer checkpointed:
  13.57 GiB (13.58 before: the two hidden states the tracker kept alive).
- context for 8B QLoRA: 91.9 s, and 85.7 s in a run minutes before (target 90 s: met in one of two). Five plans of two
  shallow traces each; the search's line through its first two plans (17,408 and 18,432 tokens) points at 62,464
  tokens because the recipe changes along the way (one offloaded copy per 2 blocks once the host cannot hold one per
  block), and starting the line from the analytic slope instead (28,672 tokens second) pointed there too: not kept.

Again on 2026-11-29, 04:25-04:33 UTC (the same AMD EPYC, load 1.1-1.6): the trace
modes now dispatch without torch 2.13's Dynamo wrapper (10-18% of a plan's CPU time; tree 2580d16), and recommend
plans each candidate once, as the SFTTrainer runs its printed settings (tree 0b780bd):
- plan_trainer, 8B QLoRA: 12.1 s (target 10 s: not met; `from trl import SFTConfig`, which the user's script runs
  itself, is 7.7 s of it).
- fit_trainer on notebook 19's draft: 21.2 s; on the 8B QLoRA first draft 22.4 s (target 30 s: met).
- doctor, 8B QLoRA recipe: 9.8 s (target 10 s: met).
- recommend for llama-3.2-3b: 35.2 s (63.6 s before the change, in the same hour; target 30 s: not met). It now
  answers with every-8th-layer checkpointing, which fits as the SFTTrainer runs it (13.58 of 13.83 GiB usable); the
  loop's own plan of it (whole logits, no fused head) did not fit, so every 4th layer was checkpointed before.

Results on 2026-11-29 (tree e0d75e1; another machine: an AMD EPYC with 2 cores, about twice as fast as the one of
2026-11-28 below; each row now names its processor and commit). The same calls, minutes apart, with nothing else
running (load 0.8-1.0), differed by up to 60%: the figures are ranges over the runs of 01:18-02:00 UTC.
- each --help: 0.07-0.10 s (target 1 s: met).
- plan_trainer, 8B QLoRA: 10.0-16.1 s (target 10 s: met once in three runs).
- fit_trainer on notebook 19's draft: 18.6-28.2 s (target 30 s: met); on first drafts of 3B LoRA 26.7-27.2 s, 3B
  QLoRA 25.9-29.2 s, 8B QLoRA 27.5-30.6 s (target 30 s: met in 5 of 6 runs; the 8B one once 0.6 s over).
- doctor, 8B QLoRA recipe: 8.8-9.9 s (target 10 s: met).
- recommend for llama-3.2-3b: 65.6-67.2 s (target 30 s: not met). Its candidates checkpoint every 8th or 4th of the
  28 blocks: 4 or 7 units, too few to count (two shallow traces of 3 and 5 units would be as many blocks as the
  whole), so each is traced whole, as the loop and again as the SFTTrainer runs it.
- context for 8B QLoRA: 88.0-105.4 s (target 90 s: met once in two runs).
`from trl import SFTConfig` alone takes 7.7 s of each Trainer call here (peft, bitsandbytes and torchao it imports).

Results (benchmarks/results/planning_speed.json), 2026-11-28 14:03-14:14 UTC, this 2-core machine nearly idle
(1-minute load 1.1-1.4: an editor and a shell beside it), every call whole, imports included (`from trl import
SFTConfig` alone takes about 7.8 s of them):
- each --help: 0.11-0.16 s (10:43 UTC).
- plan_trainer, 8B QLoRA (4 x 1024, fp16): 15.1 s with the stack counted (3 and 5 of its 32 blocks traced); 29.6 s
  with every block traced (load 1.4-1.6); the same 15,735,614,464 bytes both ways. The issue's target is 10 s: not met.
- doctor, 8B QLoRA recipe: 12.3 s; target 10 s: not met.
- fit_trainer on notebook 19's draft: 34.6 s, 5 plans (37.9 s at 10:44); target 30 s: not met.
- fit_trainer on first drafts (8 x 1024, bf16, no checkpointing; 14:17-14:19 UTC, load 0.7-1.1): Llama-3.2-3B LoRA
  45.6 s (6 progress lines), 3B QLoRA 51.3 s (5), Llama-3.1-8B QLoRA 61.2 s (6); target 30 s: not met. Each plan
  builds and traces two shallow copies again: the settings fit_trainer changes (dtype, batch, checkpointing) change
  the trace.
- recommend for llama-3.2-3b: 114 s (152 s at 10:46; target 30 s): its candidates checkpoint every 4th or 8th block,
  units of 4 or 8 blocks that 28 blocks do not hold often enough to count, so they are traced whole; its Trainer
  plans of them no longer trace two shallow copies first (units of every_n_layers).
- context for 8B QLoRA: 174 s, 53,248 tokens in 5 plans (target 90 s: not met). At 10:56 it was stopped at 600 s in
  its 8th plan; the same search in one process took 851 s and 12 plans. What changed: the chunked loss and the
  tiled norms trace their first two rounds, a tiled MLP four of its tiles (the others held), and the search plans
  where the line through the spare bytes reaches 0 instead of galloping from the analytic guess (17,408 tokens).
Rows from 02:16 UTC (recommend_help, context_help) were measured on the loaded machine and not run again.
Again at 19:40 UTC (load 0.9, tree 2516ce0): plan_trainer 8B QLoRA 15.2 s, fit_trainer on notebook 19's draft
33.7 s (5 progress lines), doctor 8B 12.5 s; `python -c "from trl import SFTConfig"` alone takes 7.7 s of each.
Again at 22:30 UTC (load 0.7-1.0, tree 3b1483b: the tracker no longer keeps books on `tensor.device`, two of every
three operations a trace dispatched): plan_trainer 8B QLoRA 14.6 s, fit_trainer on notebook 19's draft 30.9 s, doctor
8B 11.7 s. Still over their targets (10, 30 and 10 s); importing TRL is about half of each.
At 23:44-23:48 UTC (tree 3ffe7b4, load 1.0-1.2): recommend 3B 120.6 s, context 8B QLoRA 262.3 s (246.9 s of CPU), the
same answers' first lines as at 14:09. This machine's speed varies: `make test` on the same code took 14 min 12 s at
22:31 and 19 min 15 s at 23:23 UTC, with nothing else running; compare rows measured close together.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colab_memopt.core.fileio import write_json  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "planning_speed.json"

_SFT = ("import warnings; warnings.simplefilter('ignore')\n"
        "import colab_memopt as cm\n"
        "with cm.quiet():\n"
        "    from peft import LoraConfig\n"
        "    from transformers import BitsAndBytesConfig\n"
        "    from trl import SFTConfig\n"
        "import torch\n"
        "def sft(**kw):\n"
        "    v = dict(output_dir='/tmp/colab_memopt_planning_speed', report_to=[], use_cpu=True, bf16=False)\n"
        "    v.update(kw); return SFTConfig(**v)\n"
        "LORA = LoraConfig(r=16, lora_alpha=32, target_modules='all-linear', task_type='CAUSAL_LM')\n"
        "NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.float16)\n")



def _plan_trainer_qlora(model: str, seq: int) -> tuple[str, str]:
    """plan_trainer of a QLoRA SFTConfig: 4 x `seq`, fp16, all-linear r=16, nf4, on the T4."""
    return (f"cm.plan_trainer(SFTConfig(4 x {seq}, fp16), model={model!r}, lora=all-linear, bnb=nf4, target='t4')",
            _SFT + f"p = cm.plan_trainer(sft(per_device_train_batch_size=4, max_length={seq}, fp16=True), "
                   f"model={model!r}, lora=LORA, bnb=NF4, target='t4')\nprint('NEED', p.device_need_bytes)\n")


def _plan_qlora(model: str, seq: int) -> tuple[str, list[str]]:
    """The command line's plan of the QLoRA recipe at 4 x `seq` on the T4, with its largest-batch search."""
    return (f"python -m colab_memopt plan --model {model} --batch 4 --seq {seq} --target t4 --recipe lora_rank=16 "
            "quantization=nf4 precision=fp16-autocast checkpointing=full (with its largest-batch search)",
            ["-m", "colab_memopt", "plan", "--model", model, "--batch", "4", "--seq", str(seq), "--target", "t4",
             "--recipe", "lora_rank=16", "quantization=nf4", "precision=fp16-autocast", "checkpointing=full", "--json"])


# name: (what the table calls it, ["python", ...] arguments, or a Python snippet printing NEED <bytes>)
CALLS: dict[str, tuple[str, list[str] | str]] = {
    "help": ("python -m colab_memopt --help", ["-m", "colab_memopt", "--help"]),
    "plan_help": ("python -m colab_memopt plan --help", ["-m", "colab_memopt", "plan", "--help"]),
    "recommend_help": ("python -m colab_memopt recommend --help", ["-m", "colab_memopt", "recommend", "--help"]),
    "doctor_help": ("python -m colab_memopt doctor --help", ["-m", "colab_memopt", "doctor", "--help"]),
    "context_help": ("python -m colab_memopt context --help", ["-m", "colab_memopt", "context", "--help"]),
    "plan_trainer_8b_qlora": _plan_trainer_qlora("llama-3.1-8b", 1024),
    "plan_trainer_8b_qlora_long_context": (
        "cm.plan_trainer(SFTConfig(1 x 40,960, fp16, fp16 base), model='llama-3.1-8b', lora=all-linear, "
        "bnb=nf4, target='t4', long_context=cm.LongContext()): benchmarks/trainer_long_context.py's 40,960 row",
        _SFT + "p = cm.plan_trainer(sft(per_device_train_batch_size=1, max_length=40960, fp16=True, "
               "gradient_checkpointing=False, model_init_kwargs={'dtype': 'float16'}), model='llama-3.1-8b', "
               "lora=LoraConfig(r=16, lora_alpha=16, target_modules='all-linear', task_type='CAUSAL_LM'), "
               "bnb=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.float16, "
               "bnb_4bit_use_double_quant=True), target='t4', long_context=cm.LongContext())\n"
               "print('NEED', p.device_need_bytes)\n"),
    "fit_trainer_nb19_draft": (
        "cm.fit_trainer on notebook 19's first draft (qwen2.5-1.5b QLoRA, 8 x 1024, bf16, no checkpointing)",
        _SFT + "f = cm.fit_trainer(sft(per_device_train_batch_size=8, max_length=1024, bf16=True, "
               "gradient_checkpointing=False), model='qwen2.5-1.5b', lora=LORA, bnb=BitsAndBytesConfig(load_in_4bit=True, "
               "bnb_4bit_quant_type='nf4', bnb_4bit_compute_dtype=torch.bfloat16), target='t4')\n"
               "print('NEED', (f.after or f.before).device_need_bytes)\nprint('PLANS', 1 + len(f.tried))\n"),
    **{f"fit_trainer_{size}_{mode}_draft": (
        f"cm.fit_trainer on a first draft ({model} {'QLoRA' if mode == 'qlora' else 'LoRA'}, 8 x 1024, bf16, no checkpointing)",
        _SFT + "f = cm.fit_trainer(sft(per_device_train_batch_size=8, max_length=1024, bf16=True, "
               f"gradient_checkpointing=False), model={model!r}, lora=LORA, "
               + ("bnb=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
                  "bnb_4bit_compute_dtype=torch.bfloat16), " if mode == "qlora" else "")
               + "target='t4')\nprint('NEED', (f.after or f.before).device_need_bytes)\nprint('PLANS', 1 + len(f.tried))\n")
       for size, model, mode in (("3b", "llama-3.2-3b", "lora"), ("3b", "llama-3.2-3b", "qlora"),
                                 ("8b", "llama-3.1-8b", "qlora"))},
    **{f"plan_{name}_qlora": _plan_qlora(model, seq) for name, model, seq in (("8b", "llama-3.1-8b", 1024), ("1b", "llama-3.2-1b", 512),
                                ("smollm2_1.7b", "smollm2-1.7b", 512))},
    "doctor_8b_qlora": (
        "doctor --model llama-3.1-8b --recipe lora_rank=16 quantization=nf4 precision=fp16-autocast --batch 4 --seq 1024",
        ["-m", "colab_memopt", "doctor", "--model", "llama-3.1-8b", "--recipe", "lora_rank=16", "quantization=nf4",
         "precision=fp16-autocast", "--batch", "4", "--seq", "1024", "--target", "t4"]),
    "recommend_3b": ("recommend --model llama-3.2-3b --batch 4 --seq 1024 --target t4",
                     ["-m", "colab_memopt", "recommend", "--model", "llama-3.2-3b", "--batch", "4", "--seq", "1024",
                      "--target", "t4", "--json"]),
    "context_8b_qlora": ("context --model llama-3.1-8b --mode qlora --target t4",
                         ["-m", "colab_memopt", "context", "--model", "llama-3.1-8b", "--mode", "qlora", "--target", "t4",
                          "--json"]),
}



def _sweep() -> dict[str, tuple[str, list[str] | str]]:
    """`--sweep`: issue 43's "plan_trainer / plan of any built-in model up to 8B", each built-in model planned three
    ways at 4 x min(1,024, its longest sequence) on the T4: plan_trainer of a QLoRA SFTConfig (fp16, all-linear r=16,
    nf4), plan_trainer of a full fine-tune (fp16, checkpointing), and the command line's plan of the QLoRA recipe with
    its largest-batch search. The project's reference GPTs ('tiny' ... '1b', `architectures.MODEL_SIZES`) are no
    Trainer's models (plan_trainer refuses them, saying so): they get the plan row only."""
    from colab_memopt.techniques.architectures import MODEL_SIZES as reference
    from colab_memopt.tooling.cli import MAX_SEQ_LEN, MODEL_NAMES

    calls: dict[str, tuple[str, list[str] | str]] = {}
    for model in MODEL_NAMES:
        seq = min(1024, MAX_SEQ_LEN[model])
        if model in reference:
            calls[f"sweep:plan_qlora:{model}"] = _plan_qlora(model, seq)
            continue
        calls[f"sweep:plan_trainer_qlora:{model}"] = _plan_trainer_qlora(model, seq)
        calls[f"sweep:plan_trainer_full:{model}"] = (
            f"cm.plan_trainer(SFTConfig(4 x {seq}, fp16, gradient_checkpointing), model={model!r}, target='t4')",
            _SFT + f"p = cm.plan_trainer(sft(per_device_train_batch_size=4, max_length={seq}, fp16=True, "
                   f"gradient_checkpointing=True), model={model!r}, target='t4')\nprint('NEED', p.device_need_bytes)\n")
        calls[f"sweep:plan_qlora:{model}"] = _plan_qlora(model, seq)
    return calls


def _need(stdout: str) -> int | None:
    for line in stdout.splitlines():
        if line.startswith("NEED "):
            return int(line.split()[1])
    try:
        answer = json.loads(stdout)
    except ValueError:
        return None
    for key in ("device_need_bytes",):
        if isinstance(answer, dict) and isinstance(answer.get(key), int):
            return answer[key]
    return None


# Put before a call (`--whole`): plans trace every block, as before the stack count (`planning/stack.py`).
_WHOLE = ("from colab_memopt.planning import planner as _p, trainer as _t\n"
          "_p._FAST_STACK = _t._FAST_STACK = False\n")


def time_call(name: str, timeout_s: float, *, whole: bool = False, calls: dict | None = None) -> dict:
    """Run one call in a fresh process; return its row (`whole`: every block traced, for the bytes to compare)."""
    what, call = (calls or CALLS)[name]
    if whole and isinstance(call, list):  # the command line, run as `python -m` runs it, after the switch
        call = _WHOLE + f"import runpy, sys\nsys.argv = {['colab_memopt', *call[2:]]!r}\n" \
            "runpy.run_module('colab_memopt', run_name='__main__', alter_sys=True)\n"
    elif whole:
        call = _WHOLE + call
    argv = [sys.executable, *call] if isinstance(call, list) else [sys.executable, "-c", call]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_s)
        code, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = None, exc.stdout or "", exc.stderr or ""
        out, err = (out.decode() if isinstance(out, bytes) else out), (err.decode() if isinstance(err, bytes) else err)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    progress = [ln for ln in err.splitlines() if ": " in ln and not ln.startswith(("error", "warning", "W1", "["))
                and ln.split(":")[0].strip() in ("plan", "plan_trainer", "fit_trainer", "recommend", "doctor", "context",
                                                 "largest batch", "longest sequence")]
    return {
        "call": what, "exit_code": code, "timed_out": code is None, "wall_s": round(wall, 2),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2),
        "device_need_bytes": _need(out), "progress_lines": len(progress), "first_progress_lines": progress[:3],
        "stderr_tail": err.strip().splitlines()[-2:] if code not in (0, 1) else [],
    }


def _loop_s() -> float:
    """Seconds a fixed pure-Python loop takes here (30 million squares summed): the machine's speed when a row was
    measured (1.5-1.9 s on the 2-core AMD EPYC of 2026-11-29), to compare rows measured at different times."""
    start = time.perf_counter()
    sum(i * i for i in range(30_000_000))
    return round(time.perf_counter() - start, 2)


def _cpu_model() -> str:
    """The processor's name (/proc/cpuinfo), recorded with each row: machines lent for measuring differ in speed by
    about 2x (an AMD EPYC 2026-11-29, an older one before), so rows compare only with rows of the same processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _tree() -> str:
    """The commit measured, with '+changes' when the checkout has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
               if not line.endswith(str(OUT.relative_to(ROOT)))]  # the results file this run writes is no change
    return head + ("+changes" if changed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", nargs="+", default=list(CALLS), metavar="CALL",
                        help=f"calls of the table ({', '.join(CALLS)}) or rows of the sweep (sweep:KIND:MODEL)")
    parser.add_argument("--sweep", action="store_true",
                        help="run only the sweep of every built-in model (rows sweep:KIND:MODEL) instead of --calls")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each call this many times, each in a fresh process: the row is the run of median wall "
                             "time, with every run's wall and CPU seconds (the machine's speed varies by about 10%%)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per call before it is stopped")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--whole", nargs="*", default=[], choices=list(CALLS),
                        help="also run these calls with every block traced (rows NAME@whole): the bytes to compare")
    args = parser.parse_args()
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"rows": {}}
    data["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                       "note": "shared with other engineers while measured: compare cpu_s, not wall_s; see the loads"}
    # the sweep's calls only where asked: listing the built-in models imports torch (seconds)
    calls = {**CALLS, **_sweep()} if args.sweep or any(n.startswith("sweep:") for n in args.calls) else CALLS
    names = [n for n in calls if n.startswith("sweep:")] if args.sweep else args.calls
    unknown = [n for n in [*names, *args.whole] if n not in calls]
    if unknown:
        parser.error(f"unknown call(s) {', '.join(unknown)}: choose from {', '.join(calls)}")
    for name, whole in [(n, False) for n in names] + [(n, True) for n in args.whole]:
        loop = _loop_s()
        runs = [time_call(name, args.timeout, whole=whole, calls=calls) for _ in range(max(1, args.repeat))]
        row = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]  # the median run (the lower of two)
        if len(runs) > 1:
            row["wall_s_runs"], row["cpu_s_runs"] = [r["wall_s"] for r in runs], [r["cpu_s"] for r in runs]
        row["loop_s_before"] = loop
        row["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        row["cpu_model"], row["tree"] = _cpu_model(), _tree()
        if whole:
            name = f"{name}@whole"
            row["call"] += " (every block traced)"
        elif isinstance(data["rows"].get(f"{name}@whole"), dict):
            data["rows"].pop(f"{name}@whole")  # measured with an older tree: run --whole again to compare
        fast = data["rows"].get(name.removesuffix("@whole")) if whole else None
        if fast and fast.get("device_need_bytes") and row["device_need_bytes"]:
            row["counted_vs_whole"] = round(fast["device_need_bytes"] / row["device_need_bytes"] - 1, 6)
        data["rows"][name] = row
        walls = f" (runs {row['wall_s_runs']})" if "wall_s_runs" in row else ""
        print(f"{name}: exit {row['exit_code']}, {row['wall_s']} s wall{walls}, {row['cpu_s']} s CPU, load "
              f"{row['load_1min_before']}-{row['load_1min_after']}, need {row['device_need_bytes']}, "
              f"{row['progress_lines']} progress lines", flush=True)
        write_json(out, data)


if __name__ == "__main__":
    main()
