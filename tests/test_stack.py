"""Trace what repeats once (`colab_memopt.planning.stack`): a deep model's plan from two shallow traces, the rest of
its blocks counted, equals the trace of every block, for each family the package builds and each mode, on the
recipe path (`cm.plan`) and on the Trainer path (`cm.plan_trainer`); where the blocks do not repeat, every block is
traced and the plan says so in its progress."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import colab_memopt as cm
from colab_memopt.planning import planner, stack
from colab_memopt.planning import trainer as trainer_mod
from colab_memopt.planning import faketrace
from colab_memopt.planning.faketrace import shape_model
from colab_memopt.techniques.models import GPTConfig, build_model

# Nine blocks: the two shallow traces (3 and 5 blocks) are fewer than the whole, as the fast path needs. Thirteen
# where every second block is checkpointed: units of two blocks, traced at 5 and 9 blocks.
DEPTH = 9
DEPTH_BY_TWO = 13


def _hf_config(family: str, depth: int = DEPTH) -> object:
    import transformers

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=depth, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=depth, n_head=4, n_positions=256)
    raise ValueError(family)


def _reference(depth: int = DEPTH) -> nn.Module:
    return build_model(GPTConfig(n_layer=depth, d_model=64, n_head=4, seq_len=128, vocab_size=512), device=None)


def _model(family: str, depth: int = DEPTH) -> object:
    return (lambda: _reference(depth)) if family == "reference" else _hf_config(family, depth)


# A device small enough that the largest batch is a few sequences (a tiny model on a T4 takes thousands).
SMALL_GPU = cm.Target(name="small-gpu", device_bytes=40 * 2**20, host_bytes=2**34, cuda_context_bytes=0,
                      compute_capability=(7, 5))


# What each mode turns on, as a Recipe's fields (LoRA targets from each family's own names).
MODES = {
    "full fp32": {},
    "fp16 autocast, checkpointing": {"precision": "fp16-autocast", "checkpointing": "full"},
    "every 2nd block checkpointed": {"checkpointing": "every_n", "checkpoint_interval": 2, "precision": "bf16-autocast"},
    "QLoRA nf4, checkpointing": {"lora_rank": 8, "quantization": "nf4", "precision": "fp16-autocast", "checkpointing": "full"},
    "tiled MLP, chunked loss": {"mlp_tile_tokens": 32, "loss_chunk_tokens": 32, "checkpointing": "full"},
    "accumulation 4, 8-bit AdamW": {"accumulation_steps": 4, "optimizer": "adamw8bit"},
    "LOMO in bf16": {"optimizer": "lomo", "precision": "bf16"},
    "offloaded checkpoints, tiled, chunked": {"checkpointing": "offload", "mlp_tile_tokens": 32, "loss_chunk_tokens": 32,
                                              "precision": "fp16-autocast"},
    "one offloaded copy per 2 blocks": {"checkpointing": "offload", "checkpoint_interval": 2, "mlp_tile_tokens": 32,
                                        "loss_chunk_tokens": 32, "precision": "fp16-autocast", "lora_rank": 8,
                                        "quantization": "nf4"},
}
# Each family with every mode would be many minutes: every mode on llama (the flagship's family), and each other
# family with one mode that changes its step (LoRA on a 16-bit base and an int8 base are QLoRA's path with other layers).
CASES = ([("llama", mode) for mode in MODES]
         + [("reference", "every 2nd block checkpointed"), ("qwen2", "QLoRA nf4, checkpointing"), ("gpt2", "full fp32")])


def _figures(p: cm.Plan) -> tuple:
    return (p.peak_bytes, p.by_category, p.by_phase, p.by_phase_category, [(c.name, c.bytes) for c in p.device_costs],
            [(c.name, c.bytes) for c in p.host_costs if c.name != "this process"], p.max_batch,  # (its RSS, measured)
            p.warnings)


def _both(monkeypatch: pytest.MonkeyPatch, module: object, run: object) -> tuple[tuple, tuple]:
    out = []
    for fast in (False, True):
        monkeypatch.setattr(module, "_FAST_STACK", fast)
        faketrace.clear_trace_cache()
        out.append(_figures(run()))
    return out[0], out[1]


def _lora_targets(family: str) -> tuple[str, ...]:
    return {"gpt2": ("c_attn", "c_proj"), "reference": ("qkv", "proj")}.get(family, ("q_proj", "v_proj"))


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_the_counted_stack_plans_what_the_whole_trace_plans(monkeypatch: pytest.MonkeyPatch, family: str,
                                                             mode: str) -> None:
    recipe = dict(MODES[mode])
    if recipe.get("lora_rank"):
        recipe["lora_targets"] = _lora_targets(family)
    depth, traced = (DEPTH_BY_TWO, "5 and 9") if recipe.get("checkpoint_interval") == 2 else (DEPTH, "3 and 5")
    said: list[str] = []
    monkeypatch.setattr(planner, "say", said.append)
    batch = max(2, recipe.get("accumulation_steps", 1))
    whole, counted = _both(monkeypatch, planner, lambda: cm.plan(_model(family, depth), batch, seq_len=64, recipe=recipe,
                                                                target="t4", find_max_batch=False, method="trace"))
    assert any(f"{depth} blocks alike: tracing {traced}" in line for line in said), said
    assert counted == whole  # every figure, to the byte (the issue asks for 0.1%)


def test_the_largest_batch_search_counts_the_stack_too(monkeypatch: pytest.MonkeyPatch) -> None:
    whole, counted = _both(monkeypatch, planner, lambda: cm.plan(_model("llama"), 2, seq_len=64, target=SMALL_GPU,
                                                                recipe={"precision": "fp16-autocast"}))
    assert whole[6] > 2 and counted == whole  # (6: the largest batch)


def _sft(**kwargs: object) -> object:
    from trl import SFTConfig

    return SFTConfig(output_dir="/tmp/colab-memopt-stack", max_length=64, use_cpu=True, report_to=[], **kwargs)


def _trainer_cases() -> dict[str, dict[str, object]]:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    return {
        "QLoRA, fp16, checkpointing": dict(
            args=_sft(per_device_train_batch_size=2, fp16=True, gradient_checkpointing=True),
            lora=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"),
            bnb=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)),
        "full, fp16, accumulation 4": dict(args=_sft(per_device_train_batch_size=1, gradient_accumulation_steps=4, fp16=True),
                                           lora=None, bnb=None),
    }


@pytest.mark.parametrize("case", ["QLoRA, fp16, checkpointing", "full, fp16, accumulation 4"])
def test_plan_trainer_counts_the_stack_as_its_whole_trace(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    c = _trainer_cases()[case]
    said: list[str] = []
    monkeypatch.setattr(trainer_mod, "say", said.append)
    whole, counted = _both(monkeypatch, trainer_mod, lambda: cm.plan_trainer(
        c["args"], model=_hf_config("llama"), lora=c["lora"], bnb=c["bnb"],
        prepare_model_for_kbit_training=case.startswith("QLoRA"),  # its float32 norms, counted per block too
        target=SMALL_GPU if case.startswith("QLoRA") else "t4", find_max_batch=case.startswith("QLoRA")))
    assert any(f"{DEPTH} blocks alike" in line for line in said), said
    assert counted == whole


def test_plan_trainer_counts_every_nth_layer_checkpointed_in_units_of_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' `every_n_layers` checkpoints layers 0, n, 2n, ...: the blocks repeat in units of n, counted so
    (two shallow copies of 5 and 9 blocks, not copies whose blocks are checkpointed otherwise than the whole's)."""
    from peft import LoraConfig

    from colab_memopt.planning.hfconfig import trainer_checkpointing_keys

    if "every_n_layers" not in trainer_checkpointing_keys():
        pytest.skip("this transformers' Trainer checkpoints every layer or none")
    args = _sft(per_device_train_batch_size=2, fp16=True, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2})
    said: list[str] = []
    monkeypatch.setattr(trainer_mod, "say", said.append)
    whole, counted = _both(monkeypatch, trainer_mod, lambda: cm.plan_trainer(
        args, model=_hf_config("llama", DEPTH_BY_TWO), lora=LoraConfig(r=8, target_modules="all-linear",
                                                                      task_type="CAUSAL_LM"),
        target="t4", find_max_batch=False))
    assert any(f"{DEPTH_BY_TWO} blocks alike: tracing 5 and 9" in line for line in said), said
    assert not any("do not repeat" in line for line in said), said
    assert counted == whole


@pytest.mark.parametrize("interval", [1, 2])
def test_plan_trainer_counts_the_stack_with_long_context(monkeypatch: pytest.MonkeyPatch, interval: int) -> None:
    """`cm.long_context`'s offloaded layer inputs repeat in units of its `checkpoint_interval` (one host copy per
    unit, two-level checkpoints inside): the counted plan, its host line of offloaded inputs included, is the whole
    trace's."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    depth = DEPTH if interval == 1 else DEPTH_BY_TWO
    said: list[str] = []
    monkeypatch.setattr(trainer_mod, "say", said.append)
    whole, counted = _both(monkeypatch, trainer_mod, lambda: cm.plan_trainer(
        _sft(per_device_train_batch_size=1, fp16=True, gradient_checkpointing=False), model=_hf_config("llama", depth),
        lora=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"),
        bnb=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16),
        target="t4", find_max_batch=False,
        long_context=cm.LongContext(checkpoint_interval=interval, mlp_tile_tokens=32, norm_tile_tokens=32)))
    assert any(f"{depth} blocks alike: tracing {'3 and 5' if interval == 1 else '5 and 9'}" in line for line in said), said
    assert not any("do not repeat" in line for line in said), said
    offloaded = dict(counted[5])["offloaded checkpoints"]
    assert offloaded > 0
    assert counted == whole


def test_plans_of_one_architecture_at_other_depths_reuse_its_shallow_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capacity's search plans one architecture at many depths: their shallow copies (3 and 5 blocks) are one model,
    traced once; each depth's plan equals its own trace of every block. A factory of the same model (as capacity
    gives it) reuses them the same way, and plans the same bytes."""
    from transformers import LlamaForCausalLM

    built = []
    monkeypatch.setattr(planner, "_Tracer", lambda *a, **k: built.append(a[0]) or faketrace._Tracer(*a, **k))
    recipe = {"precision": "fp16-autocast", "checkpointing": "full"}
    depths = (9, 12)

    def plans(models: list) -> list:
        return [_figures(cm.plan(m, 2, seq_len=64, recipe=recipe, target="t4", find_max_batch=False)) for m in models]

    counted = {}
    for family, models in (("config", [_hf_config("llama", d) for d in depths]),
                           ("factory", [lambda d=d: LlamaForCausalLM(_hf_config("llama", d)) for d in depths])):
        faketrace.clear_trace_cache()
        built.clear()
        counted[family] = plans(models)
        assert len(built) == 2, (family, len(built))  # the two shallow copies, for both depths
    assert counted["factory"] == counted["config"]
    monkeypatch.setattr(planner, "_FAST_STACK", False)
    assert plans([_hf_config("llama", d) for d in depths]) == counted["config"]
    assert faketrace._SHALLOW_TRACERS
    faketrace.clear_trace_cache()
    assert not faketrace._SHALLOW_TRACERS


def test_blocks_that_differ_are_traced_every_one() -> None:
    model = _reference
    built = shape_model(model)
    assert stack.structural_period(built) == 1

    def uneven() -> nn.Module:  # every block but the fourth has a wider MLP: no period repeats
        net = _reference()
        net.blocks[3].mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        return net

    with pytest.raises(stack.NotRepeating, match="not alike"):
        stack.structural_period(shape_model(uneven))
    assert cm.plan(uneven, 2, seq_len=64, find_max_batch=False, method="trace").method == "trace"


def test_a_recipe_that_treats_the_blocks_unalike_is_traced_whole() -> None:
    for fields, why in (({"layer_offload_active": 2}, "layer offload"),
                        ({"checkpointing": "offload", "offload_keep_blocks": 2}, "split")):
        with pytest.raises(stack.NotRepeating, match=why):
            stack.recipe_period(cm.Recipe(**fields))
    assert stack.recipe_period(cm.Recipe(checkpointing="every_n", checkpoint_interval=3)) == 3
    assert stack.recipe_period(cm.Recipe(checkpointing="offload", checkpoint_interval=2)) == 2  # two-level offload


def test_the_shape_carries_a_count_affine_in_the_depth_and_refuses_one_that_is_not() -> None:
    shape = stack.StackShape(32)
    assert (shape.depth(3), shape.depth(5)) == (3, 5) and shape.worth_it
    assert shape.extrapolate(300, 500) == 3200  # 100 per block
    with pytest.raises(stack.NotRepeating):
        shape.extrapolate(300, 501)
    assert not stack.StackShape(7).worth_it  # 3 + 5 blocks traced: more than the whole
    two = stack.StackShape(33, period=2)  # units of two blocks, the last unit one block
    assert (two.n_units, two.last_unit_blocks, two.depth(3), two.depth(5)) == (17, 1, 5, 9)


def test_a_stack_whose_traces_do_not_repeat_is_traced_whole_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise stack.NotRepeating("a pass through the blocks went to unit 4 where unit 3 of 5 was next")

    run = lambda: cm.plan(_model("gpt2"), 2, seq_len=64, target="t4", find_max_batch=False, method="trace")  # noqa: E731
    monkeypatch.setattr(planner, "_FAST_STACK", False)
    whole = _figures(run())
    said: list[str] = []
    monkeypatch.setattr(stack, "say", said.append, raising=False)
    monkeypatch.setattr(stack, "extrapolate", refuse)
    monkeypatch.setattr(planner, "_FAST_STACK", True)
    faketrace.clear_trace_cache()
    p = run()
    assert _figures(p) == whole
    assert any("do not repeat" in line and f"tracing all {DEPTH}" in line for line in said), said
    assert not any("the rest counted" in n for n in p.notes)


def test_a_shallow_copy_unlike_the_models_first_blocks_is_refused() -> None:
    from colab_memopt.techniques import architectures

    spec = architectures.resolve_model(_hf_config("llama"))
    meta = shape_model(spec.build)
    shape = stack.shape_of(meta)
    stack.check_shallow(spec, meta, shape)  # a copy of 3 or 5 blocks is the model's first 3 or 5
    wider = _hf_config("llama")
    wider.intermediate_size = 192  # a config whose copies would build other blocks than the model has
    with pytest.raises(stack.NotRepeating, match="not the model's first 3 blocks"):
        stack.check_shallow(architectures.resolve_model(wider), meta, shape)


def test_a_factorys_model_cut_to_a_few_blocks_keeps_its_own_config_object() -> None:
    """A model from a factory is built whole and cut: its transformers config is the same object, with fewer layers
    and its attention implementation as built (a copy of it had none, and transformers said so on stderr)."""
    config = _hf_config("llama")

    def factory() -> nn.Module:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        return get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["q_proj"]))

    from colab_memopt.techniques import architectures

    whole = factory()
    cut = stack.shallow_factory(architectures.resolve_model(factory), 3)()
    base = cut.get_base_model()
    assert len(stack.block_stack(cut)[2]) == 3 and base.config.num_hidden_layers == 3
    assert all(m.config is base.config for m in base.modules() if hasattr(m, "config") and not callable(m.config))
    assert base.config._attn_implementation == whole.get_base_model().config._attn_implementation is not None
    reference = stack.shallow_factory(architectures.resolve_model(_reference), 3)()
    assert reference.config.n_layer == 3 and len(reference.blocks) == 3


_LORA_CKPT = {"lora_rank": 8, "lora_targets": ("q_proj", "v_proj"), "precision": "fp16-autocast", "checkpointing": "full"}


def _max_batch_both_ways(monkeypatch: pytest.MonkeyPatch, recipe: dict,
                         seq_len: int = 64) -> tuple[dict[bool, int], list[str]]:
    """Return the largest batch on SMALL_GPU by the traced search (False) and read off the lines (True), and what the
    second said. The margin is the tiny model's (its bytes per sequence are kilobytes, a T4 plan's megabytes)."""
    monkeypatch.setattr(planner, "_LINE_MARGIN_BYTES", 4096)
    said: list[str] = []
    monkeypatch.setattr(planner, "say", said.append)
    found = {}
    faketrace.clear_trace_cache()
    planner._SHALLOW_TRACERS.clear()
    for lines in (True, False):  # the traced search second: it reuses the traces made (the same bytes), adds the rest
        monkeypatch.setattr(planner, "_LINES_SEARCH", lines)
        found[lines] = cm.plan(_model("llama"), 2, seq_len=seq_len, recipe=recipe, target=SMALL_GPU).max_batch
        if lines:
            monkeypatch.setattr(planner, "say", lambda _: None)
    return found, said


@pytest.mark.parametrize("recipe", [{"precision": "fp16-autocast"}, _LORA_CKPT], ids=["fp16", "LoRA"])
def test_the_largest_batch_read_off_two_traces_is_the_traced_searchs(monkeypatch: pytest.MonkeyPatch,
                                                                     recipe: dict) -> None:
    """A counted stack's largest batch, read off the lines between its traces at two batches (every moment's bytes
    linear in the batch), is the batch the traced search confirms with a trace on each side of the boundary."""
    found, said = _max_batch_both_ways(monkeypatch, recipe)
    assert any("linear in the batch between the traces" in line for line in said), said
    assert sum("trace at batch" in line for line in said) == 1, said  # the one other batch traced
    assert found[True] == found[False] > 2


def test_lines_near_the_limit_leave_the_batch_to_traces() -> None:
    """Where the boundary's batch, or the next, comes within the margin of the limit, the lines give no answer."""
    import types

    def at(per_sample: int):
        return lambda n: types.SimpleNamespace(peak_bytes=n * per_sample, by_phase={"forward": n * per_sample})

    mib = 2**20
    assert planner._max_batch_from_lines(at(10 * mib), [], 95 * mib, 1, None) == 9
    assert planner._max_batch_from_lines(at(10 * mib), [], 91 * mib, 1, None) is None  # 9: 1 MiB under
    assert planner._max_batch_from_lines(at(10 * mib), [], 99 * mib, 1, None) is None  # 10: 1 MiB over
    assert planner._max_batch_from_lines(at(10 * mib), [], 95 * mib, 1, 8) is None  # the boundary past the cap
    assert planner._max_batch_from_lines(at(10 * mib), [], 5 * mib, 1, None) is None  # not even batch 1


def test_where_the_first_trace_ran_fewer_operations_the_lines_bound_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a batch's tokens equal the hidden size, autograd sums a 4-bit LoRA layer's input gradients without the
    out-of-place add it runs at other batches (llama-3.2-1b QLoRA at 4 x 512, not at 3 or 5 x 512; here 2 x 32 tokens
    of 64 hidden): the plan's own trace ran fewer moments than the guess's. The lines between the two still give the
    traced search's answer, with the guess's trace alone: the moments it ran alone are bounded by their bytes there."""
    recipe = MODES["QLoRA nf4, checkpointing"]
    ops = {}
    lines = planner._batch_lines

    def kept(a, at_a, b, at_b):
        ops[at_a], ops[at_b] = a.keys, b.keys
        return lines(a, at_a, b, at_b)

    monkeypatch.setattr(planner, "_batch_lines", kept)
    found, said = _max_batch_both_ways(monkeypatch, recipe, seq_len=32)
    assert len(ops) == 2 and ops[2] != ops[max(ops)]  # the case is exercised: the two traces ran other operations
    assert sum("trace at batch" in line for line in said) == 1, said
    assert any("moments only the trace at" in line and "ran: at most their bytes there" in line for line in said), said
    assert found[True] == found[False] > 2


def test_moments_one_trace_ran_alone_bound_the_batches_up_to_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_batch_lines` with a moment only the trace at batch 6 ran: up to 6 it counts at most its bytes there, above
    6 the step is unknown (None); the largest batch is read off only where the bound says it fits and the moments
    both traces ran say the next does not."""
    import types

    from colab_memopt.core.tracker import PHASES

    def trace(batch_lines: list[tuple[int, int, str]]) -> object:
        by_phase: dict[str, int] = {}
        for phase, nbytes, _ in batch_lines:
            by_phase[PHASES[phase]] = max(by_phase.get(PHASES[phase], 0), nbytes)
        return types.SimpleNamespace(lines=[(p, (b,)) for p, b, _ in batch_lines], keys=[k for _, _, k in batch_lines],
                                     peak_bytes=max(by_phase.values()), by_phase=by_phase)

    monkeypatch.setattr(planner, "_LINE_MARGIN_BYTES", 0)
    at_2 = trace([(0, 10, "embed"), (1, 20, "mm")])  # mm: 10 + 5 x batch
    at_6 = trace([(0, 30, "embed"), (1, 38, "add"), (1, 40, "mm")])  # "add": run at 6 only
    at = planner._batch_lines(at_2, 2, at_6, 6)
    assert at is not None and at.one_batch == (1, 6)
    assert at(4).by_phase == {"forward": 20, "backward": 38} and at(4).floor.by_phase == {"forward": 20, "backward": 30}
    assert at(7) is None
    reverse = planner._batch_lines(at_6, 6, at_2, 2)  # the trace with the moment first: the same step
    assert reverse is not None and reverse(4) == at(4) and reverse(7) is None
    assert planner._max_batch_from_lines(at, [], 39, 1, None) == 5  # 5: at most 38; 6: 40 by the moments both ran
    assert planner._max_batch_from_lines(at, [], 40, 1, None) is None  # 6 fits, 7 unknown
    assert planner._max_batch_from_lines(at, [], 37, 1, None) is None  # batch 1 not clear of the bound
    assert planner._batch_lines(at_2, 2, trace([(0, 30, "embed"), (1, 45, "mul"), (1, 40, "copy")]), 6) is None


def test_where_the_first_two_traces_leave_it_open_the_lines_come_from_the_next_two(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the lines between the plan's trace and the guess's give no answer (here made so), they come from the
    traces at the guess and at the corrected guess, and give the traced search's answer."""
    lines = planner._batch_lines
    monkeypatch.setattr(planner, "_batch_lines", lambda a, at_a, b, at_b: None if 2 in (at_a, at_b) else lines(a, at_a, b, at_b))
    found, said = _max_batch_both_ways(monkeypatch, _LORA_CKPT)
    assert sum("trace at batch" in line for line in said) == 2, said
    assert any("linear in the batch between the traces at 35 and 38" in line for line in said), said
    assert found[True] == found[False] == 35
