"""What is saved loads as it was trained (issue 44, reliability probe 4): each recipe's `save_trained` output
reloads through this package's loaders and through transformers' / peft's `from_pretrained` with the trained
logits; bad arguments are named; a save killed part-way keeps the earlier save loadable."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel

import colab_memopt as cm
from colab_memopt import loading
from colab_memopt.techniques.architectures import small_config

IDS = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small random llama (vocab 128, 2 layers, grouped-query attention) saved with save_pretrained in fp32."""
    return loading.save_random_model(small_config("llama", vocab_size=128), tmp_path_factory.mktemp("base"))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits.float()


def _train(loaded: cm.LoadedModel) -> None:
    """One real training step on a repeated batch (the trainable weights move)."""
    model, opt = loaded.model, loaded.optimizer
    model.train()
    if hasattr(opt, "fused_backward"):  # int8 weights: updated inside backward
        opt.fused_backward(model(IDS, labels=IDS).loss, opt.lomo_lr)
    else:
        model(IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("recipe, dtype", [
    (cm.Recipe(lr=1e-2), torch.float32),
    (cm.Recipe(precision="bf16", optimizer="sgd", lr=0.5), torch.bfloat16),
    (cm.Recipe(precision="fp16", optimizer="sgd", lr=0.5), torch.float16),
], ids=["full-fp32", "full-bf16", "full-fp16"])
def test_a_full_fine_tune_reloads_with_its_trained_logits(base, tmp_path, recipe, dtype):
    loaded = cm.load_model(str(base), recipe, "cpu")
    _train(loaded)
    trained = _logits(loaded.model)
    assert not torch.equal(trained, _logits(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)))
    loading.save_trained(loaded.model, tmp_path / "out", recipe)
    again = cm.load_model(str(tmp_path / "out"), recipe, "cpu")  # the package's loader, in the recipe's dtype
    assert torch.equal(_logits(again.model), trained)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # the config's dtype: what was trained
    assert next(hf.parameters()).dtype == dtype and torch.equal(_logits(hf), trained)


@pytest.mark.parametrize("recipe", [cm.Recipe(lora_rank=4, lr=1e-2), cm.Recipe(lora_rank=4, quantization="nf4", lr=1e-2)],
                         ids=["lora", "qlora"])
def test_lora_adapters_reload_through_peft_and_load_model_with_their_trained_logits(base, tmp_path, recipe):
    """The review's last-found row: save_trained's tensor names lacked peft's `base_model.model.`, so
    PeftModel.from_pretrained warned "Found missing adapter keys" and returned the base with fresh adapters."""
    loaded = cm.load_model(str(base), recipe, "cpu")
    _train(loaded)
    trained = _logits(loaded.model)
    files = loading.save_trained(loaded.model, tmp_path / "adapter", recipe)
    assert sorted(p.name for p in files) == ["adapter_config.json", "adapter_model.safetensors"]
    again = cm.load_model(str(base), recipe, "cpu", adapter=tmp_path / "adapter")
    assert torch.equal(_logits(again.model), trained)
    fresh = cm.load_model(str(base), recipe, "cpu")  # the same base, its adapters fresh: what the bug returned
    peft_base = fresh.model if recipe.quantization else transformers.AutoModelForCausalLM.from_pretrained(base)
    if recipe.quantization:  # peft's own loader onto the recipe's 4-bit base, with the adapters removed
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in peft_base.modules():
            if isinstance(m, BaseTunerLayer):
                m.delete_adapter("default")
        del peft_base.peft_config
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "Found missing adapter keys" is a UserWarning
        peft_model = PeftModel.from_pretrained(peft_base, tmp_path / "adapter")
    assert torch.equal(_logits(peft_model), trained)


def test_int8_weights_reload_as_trained_through_from_pretrained_and_load_int8(base, tmp_path):
    """The review's row: int8 weights saved as qweight/scale beside an ordinary config.json loaded as random weights
    through from_pretrained (no error) and were refused by load_int8."""
    recipe = cm.Recipe(weight_dtype="int8", optimizer="adalomo", precision="bf16", lr=1e-2)
    loaded = cm.load_model(str(base), recipe, "cpu")
    before = loaded.model.lm_head.qweight.clone()
    _train(loaded)
    assert not torch.equal(before, loaded.model.lm_head.qweight)
    trained = _logits(loaded.model)
    loading.save_trained(loaded.model, tmp_path / "int8", recipe)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "int8")  # bf16, the usual names
    assert next(hf.parameters()).dtype == torch.bfloat16 and torch.equal(_logits(hf), trained)
    # load_int8 quantizes the 16-bit weights again: the grid of a group whose largest value is not at +-127 after
    # training moves, so the logits differ by int8 rounding, far less than a random model's
    again = cm.load_int8(tmp_path / "int8", dtype=torch.bfloat16, device="cpu")
    diff = (_logits(again) - trained).abs().max().item()
    random_diff = (_logits(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16))
                   - trained).abs().max().item()
    assert diff < 0.1 * random_diff, (diff, random_diff)


def test_fp16_int8_weights_save_as_fp16(base, tmp_path):
    """The T4's dtype: int8 weights computing in fp16 (loss scale 2^16) save as fp16 weights."""
    recipe = cm.Recipe(weight_dtype="int8", optimizer="lomo", precision="fp16", lr=1e-3)
    model = cm.load_int8(base, dtype=torch.float16, device="cpu")
    model, opt = recipe.build(model)
    assert opt.loss_scale == 2.0**16
    opt.fused_backward(model(IDS, labels=IDS).loss, opt.lomo_lr)
    trained = _logits(model)
    loading.save_trained(model, tmp_path / "fp16", recipe)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp16")
    assert next(hf.parameters()).dtype == torch.float16 and torch.equal(_logits(hf), trained)


def test_bad_arguments_are_named_before_anything_is_written(base, tmp_path):
    plain = transformers.AutoModelForCausalLM.from_pretrained(base)
    # peft's AttributeError ('LlamaForCausalLM' object has no attribute 'peft_config') came first
    with pytest.raises(ValueError, match="the recipe has lora_rank > 0 but the model holds no LoRA adapters"):
        loading.save_trained(plain, tmp_path / "a", cm.Recipe(lora_rank=4))
    with pytest.raises(TypeError, match="recipe must be the Recipe the model was trained with .*got NoneType None"):
        loading.save_trained(plain, tmp_path / "a", None)
    with pytest.raises(ValueError, match="the recipe has lora_rank > 0"):  # a dict is read as a Recipe
        loading.save_trained(plain, tmp_path / "a", {"lora_rank": 4})
    assert loading.save_trained(plain, tmp_path / "d", {"precision": "fp32"})  # a dict, as load_model takes
    with pytest.raises(ValueError, match=r"GPT has no save_pretrained .*torch.save\(model.state_dict\(\), 'model.pt'\)"):
        loading.save_trained(cm.build_model("tiny"), tmp_path / "g", cm.Recipe())
    with pytest.raises(TypeError, match="folder must be a path .*got int 5"):
        loading.save_trained(plain, 5, cm.Recipe())
    assert not (tmp_path / "a").exists() and not (tmp_path / "g").exists()
    with pytest.raises(ValueError, match=r"adapter='.*' has rank r=4, the recipe lora_rank=8: give lora_rank=4"):
        adapted = cm.load_model(str(base), cm.Recipe(lora_rank=4), "cpu")
        loading.save_trained(adapted.model, tmp_path / "r4", adapted.recipe)
        cm.load_model(str(base), cm.Recipe(lora_rank=8), "cpu", adapter=tmp_path / "r4")
    with pytest.raises(ValueError, match="holds no adapter_config.json"):
        cm.load_model(str(base), cm.Recipe(lora_rank=4), "cpu", adapter=tmp_path)


def test_a_resave_keeps_other_files_and_drops_the_earlier_saves_shards(base, tmp_path):
    loaded = cm.load_model(str(base), cm.Recipe(), "cpu")
    out = tmp_path / "out"
    loaded.model.save_pretrained(out, max_shard_size="100KB")  # an earlier sharded save
    (out / "tokenizer.json").write_text("{}")
    assert (out / "model.safetensors.index.json").exists()
    loading.save_trained(loaded.model, out, cm.Recipe())  # one file now
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")], names
    assert torch.equal(_logits(transformers.AutoModelForCausalLM.from_pretrained(out)), _logits(loaded.model))


def _save_until_killed(model: torch.nn.Module, out: Path, recipe: cm.Recipe, pipe: int) -> None:
    """In a forked child: change the trainable weights and save them, again and again; one byte per finished save.

    No progress bars here: tqdm's write lock is a multiprocessing lock shared with the parent across the fork, and a
    child killed while holding it (a save's bar) would leave the parent's next from_pretrained waiting on it forever.
    """
    transformers.utils.logging.disable_progress_bar()
    try:
        while True:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(0.01)
            loading.save_trained(model, out, recipe)
            os.write(pipe, b"s")
    finally:
        os._exit(0)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_save_killed_at_random_moments_keeps_the_earlier_save_loadable(base, tmp_path, kind):
    """The review's data-loss row: SIGKILLed while saving LoRA adapters in a loop, 2 of 15 kills left
    adapter_config.json empty (peft writes it in place), and the earlier save was gone with it. Here a forked
    process saves in a loop and is killed at a random moment, 15 times; the folder loads after every kill."""
    import random
    import signal
    import time

    recipe = cm.Recipe(lora_rank=4) if kind == "lora" else cm.Recipe()
    model = cm.load_model(str(base), recipe, "cpu").model
    out = tmp_path / "out"
    rng = random.Random(1)
    saves = 0
    for attempt in range(15):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _save_until_killed(model, out, recipe, write)
        os.close(write)
        assert os.read(read, 1) == b"s"  # one save done: kill it during the next ones
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        saves += 1 + sum(len(chunk) for chunk in iter(lambda: os.read(read, 4096), b""))
        os.close(read)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # peft's "Found missing adapter keys"
            if kind == "lora":
                PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), out)
            else:
                transformers.AutoModelForCausalLM.from_pretrained(out)
    assert saves > 15  # the kills landed among saves (the test can fail)
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert all(n.endswith(".partial") for n in leftovers), leftovers  # staging folders, swept by a later save
