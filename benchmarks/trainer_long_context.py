"""How long a context an 8B QLoRA `SFTTrainer` run takes on a T4, planned by trace with settings a Trainer user writes.

    python benchmarks/trainer_long_context.py SEQ:INTERVAL [SEQ:INTERVAL ...]

Plans (`cm.plan_trainer`, target 't4', 14.56 GiB, Colab's host RAM) Llama-3.1-8B's shape (random weights on fake
tensors) loaded in 4 bits (nf4, fp16 compute, double quantization) with LoRA r=16 on all linear layers, batch 1,
fp16=True, TRL's loss as installed, `gradient_checkpointing=False` and `cm.LongContext(checkpoint_interval=INTERVAL)`
(offloaded layer inputs, MLP and RMSNorm by tiles of 4,096 tokens, K/V repeated before SDPA), for each SEQ:INTERVAL.
Writes benchmarks/results/trainer_long_context.json (one row per length: fits, device need and limit, host need and
limit, by category, planning seconds on this CPU). One process per row is not needed: rows run in turn.

Results (2026-11-29, this 2-core machine; every row planned again by the same tree). The plans now trace two
shallow copies (3 and 5 blocks; 6 and 10 with interval 2) and count the rest of the 32: 4.0-5.0 s a row with
interval 1 and 8.8-10.2 s with interval 2, where tracing every block took 14.5-16.7 s, with the same bytes to the
byte (tests/test_stack.py holds them equal). An earlier stop's table held two rows planned before plans stopped
holding the (1, 1, T, T) causal mask and SDPA's 16-bit copy of it that the run never makes (faketrace's
`_fake_safe_transformers`: 5.0 GB at 40,960 tokens), so 36,864 tokens seemed not to fit where 40,960 did. All rows:
- 32,768 tokens, interval 1: fits, 11.63 GB of the device's 14.85 usable, 9.25 GB of host RAM's 12.07.
- 36,864, interval 1: fits, 11.77 GB and 10.33 GB (before: 16.03 GB, the mask counted).
- 40,960, interval 1: fits, 11.90 GB and 11.41 GB (issue 45's goal).
- 40,960, interval 2: fits, 11.90 GB and 6.04 GB (before: 17.91 GB, the mask counted). The device's peak is the same
  as with interval 1: backward's traced peak is 11.62 GB both ways (forward's 9.05 and 9.39 GB), so it comes
  outside the blocks' recomputation, the one thing the interval changes on the device.
- 49,152, interval 2: fits, 12.18 GB and 7.12 GB; 65,536, interval 2: fits, 13.70 GB and 9.27 GB.
- 81,920, interval 2: does not fit, 15.32 GB of device memory.
Plans, not measurements: no GPU has run these lengths. TRL's fused LM head is planned on its CPU path, which scores
every position; its Triton kernels on CUDA score only the trained ones, so the plan is the most the loss can hold.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

import colab_memopt as cm

OUT = Path(__file__).resolve().parent / "results" / "trainer_long_context.json"


def plan_row(seq: int, interval: int) -> dict:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig

    args = SFTConfig(output_dir="/tmp/colab_memopt_long_context", per_device_train_batch_size=1, max_length=seq,
                     use_cpu=True, gradient_checkpointing=False, fp16=True, report_to=[],
                     model_init_kwargs={"dtype": "float16"})
    lora = LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16,
                             bnb_4bit_use_double_quant=True)
    start = time.perf_counter()
    p = cm.plan_trainer(args, model="llama-3.1-8b", lora=lora, bnb=bnb, target="t4",
                        long_context=cm.LongContext(checkpoint_interval=interval))
    return {"seq_len": seq, "checkpoint_interval": interval, "fits": p.fits, "fits_device": p.fits_device,
            "fits_host": p.fits_host, "device_need_bytes": p.device_need_bytes,
            "device_limit_bytes": p.device_limit_bytes, "host_need_bytes": p.host_need_bytes,
            "host_limit_bytes": p.host_limit_bytes, "by_category": p.by_category,
            "host_costs": {c.name: c.bytes for c in p.host_costs}, "plan_seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> None:
    for spec in argv:
        seq, interval = (int(x) for x in spec.split(":"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = plan_row(seq, interval)
        print(json.dumps({k: v for k, v in row.items() if k != "by_category"}))
        rows = json.loads(OUT.read_text())["rows"] if OUT.exists() else []  # read now: another run may have written
        rows = [r for r in rows if (r["seq_len"], r["checkpoint_interval"]) != (seq, interval)] + [row]
        rows.sort(key=lambda r: (r["seq_len"], r["checkpoint_interval"]))
        OUT.write_text(json.dumps({"machine": "2-core shared CPU, fake tensors", "target": "t4", "rows": rows},
                                  indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
