"""The first CUDA run's classes planned on the research notes' example, with plan_trainer as it is now.

    OMP_NUM_THREADS=1 python benchmarks/cuda_classes.py [--classes qlora_nockpt,qlora_prepared,...]

Writes benchmarks/results/cuda_classes.json. The example of the issue 41 research (cuda_classes.md): Llama-3.2-1B's
shape (`model="llama-3.2-1b"`), batch 2 x 1024, `LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
target_modules="all-linear")`, `TrainingArguments(fp16=True, optim="adamw_torch")`, fp16 load, nf4 with double
quantization and fp16 compute for QLoRA, target h100-80gb. One plan per class (each a few minutes on a shared
2-core CPU): what it records is the plan (peak of the traced tensors, the step's peak with the in-step lines, the
device need and each device line), to set beside the notes' figures of the plan before the CUDA paths and of the
CUDA path forced by hand. Nothing here is measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

CLASSES = ("qlora_nockpt", "qlora_prepared", "qlora_ckpt", "lora_fp16_ckpt", "full")


def settings(klass: str) -> dict[str, Any]:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, TrainingArguments

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float16)
    ckpt = klass in ("qlora_ckpt", "qlora_prepared", "lora_fp16_ckpt")
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), fp16=True, per_device_train_batch_size=2,
                             gradient_checkpointing=ckpt, report_to=[], use_cpu=True, optim="adamw_torch")
    out: dict[str, Any] = dict(trainer=args, model="llama-3.2-1b", lora=None if klass == "full" else lora,
                               dtype=torch.float32 if klass == "full" else torch.float16, target="h100-80gb",
                               seq_len=1024)
    if klass.startswith("qlora"):
        out["bnb"] = nf4
    if klass == "qlora_prepared":
        out["prepare_model_for_kbit_training"] = True
    return out


def one(klass: str) -> dict[str, Any]:
    import colab_memopt as cm

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = cm.plan_trainer(**settings(klass))
    return {"peak_bytes": p.peak_bytes, "step_peak_bytes": p.step_peak_bytes, "device_need_bytes": p.device_need_bytes,
            "by_phase": p.by_phase, "by_category": p.by_category,
            "device_costs": [(c.name, c.bytes) for c in p.device_costs],
            "cuda_notes": [w for w in p.warnings if w.startswith(("traced as CUDA", "prepare_model"))],
            "defaults": p.defaults, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", default=",".join(CLASSES))
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "cuda_classes.json"))
    a = parser.parse_args(argv)
    path = Path(a.json)
    out = json.loads(path.read_text()) if path.exists() else {"classes": {}}
    out.update(torch=torch.__version__, settings="see settings() in benchmarks/cuda_classes.py")
    for klass in a.classes.split(","):
        if klass not in CLASSES:
            raise SystemExit(f"--classes: {klass!r} is not one of {CLASSES}")
        out["classes"][klass] = one(klass)
        print(klass, out["classes"][klass]["peak_bytes"], out["classes"][klass]["step_peak_bytes"], flush=True)
        from colab_memopt.core.fileio import write_json

        write_json(path, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
