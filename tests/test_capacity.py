import pytest

import colab_memopt as cm
from colab_memopt import capacity
from colab_memopt.training.recipe import Recipe


def test_params_and_scaled_models():
    assert capacity.model_params("smollm2-135m") == pytest.approx(134.5e6, rel=0.01)
    one, two = capacity.model_params(capacity.scaled("smollm2-135m", 1)), capacity.model_params(capacity.scaled("smollm2-135m", 2))
    assert two > one
    with pytest.raises(ValueError, match="num_layers"):
        capacity.scaled("smollm2-135m", 0)
    with pytest.raises(ValueError, match="unknown architecture"):
        capacity.scaled("tiny", 2)


def test_leaner_recipes_fit_more():
    full = capacity.fit("llama-3.2-1b", "baseline", Recipe(), mode="full", seq_len=512)
    best = capacity.best_fit("llama-3.2-1b", mode="full", seq_len=512)
    qlora = capacity.best_fit("llama-3.2-1b", mode="qlora", seq_len=512)
    assert full.need_bytes > best.need_bytes > qlora.need_bytes and qlora.fits and not full.fits


def test_capacity_table_rows_and_qlora_8b_at_512():
    rows = capacity.capacity_table(["smollm2-135m", "llama-3.1-8b"], seq_lens=(512,), modes=("full", "qlora"), presets=("ckpt-every-2-paged",))
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["qlora"]["largest_model"] == "llama-3.1-8b"
    assert by_mode["full"]["largest_model"] == "smollm2-135m" and by_mode["full"]["next_short_bytes"] > 0
    assert by_mode["full"]["next_model"] == "llama-3.1-8b"
    with pytest.raises(ValueError, match="unknown model"):
        capacity.capacity_table(["gpt-9"])


def test_largest_scaled_brackets_the_limit():
    # LOMO with 16-bit weights fits more than 64 of its layers at 512 tokens: the bracket needs room above that
    fit, miss = capacity.largest_scaled("llama-3.2-1b", mode="full", seq_len=512, max_layers=160)
    assert fit is not None and fit.fits and miss is not None and not miss.fits
    assert miss.params > fit.params


def test_largest_scaled_for_one_recipe_is_the_traced_boundary():
    from colab_memopt import planner
    from colab_memopt.training.recipe import Recipe

    target = {"name": "small", "device_bytes": 320 * 2**20, "host_bytes": 64 * 2**30, "cuda": False}
    recipe = Recipe(precision="bf16", optimizer="lomo", checkpointing="full")
    fit = capacity.largest_scaled_for("smollm2-135m", recipe, seq_len=32, target=target, headroom=0.05)
    assert fit["planned_by"] == "trace" and fit["layers"] >= 2
    limit = int(target["device_bytes"] * 0.95)

    def need(n):
        name = capacity.scaled("smollm2-135m", n)
        return planner.plan(lambda: capacity._SCALED[name].build(), 1, seq_len=32, recipe=recipe, target=target,
                            headroom=0.05, find_max_batch=False, method="trace").device_need_bytes

    assert fit["need_bytes"] == need(fit["layers"]) <= limit < need(fit["layers"] + 1)
    assert fit["params"] == capacity.model_params(capacity.scaled("smollm2-135m", fit["layers"]))
    # AdamW with 16-bit weights and Kahan needs 10 B/param: not even two blocks fit in 320 MiB.
    kahan = capacity.largest_scaled_for("smollm2-135m", Recipe(precision="bf16", update_rounding="kahan"), seq_len=32,
                                        target=target)
    assert kahan["layers"] == 0 and kahan["params"] == 0


def test_full_candidates_cross_precision_and_checkpointing_and_refuse_what_cannot_run():
    recipes = capacity.full_candidates(target="t4", model="llama-3.2-1b")
    names = {name for name, _ in recipes}
    assert names == set(capacity.FULL_CANDIDATES)
    per_layer = [r for name, r in recipes if name == "GaLore 8-bit per layer"]
    assert per_layer and all(r.precision == "fp32" for r in per_layer)  # in-backward cannot run under GradScaler
    assert {r.precision for name, r in recipes if name == "BAdam"} == {"fp32", "fp16-autocast"}
    one_line = capacity.full_candidates(extra={"Lion 8-bit": {"optimizer": "lion8bit"}})
    assert {r.optimizer for _, r in one_line} == {"lion8bit"} and len(one_line) == 12


def test_best_fit_picks_among_the_candidates_asked_for():
    kwargs = dict(mode="full", seq_len=512)
    everything = capacity.best_fit("llama-3.2-1b", **kwargs)
    recommended = capacity.best_fit("llama-3.2-1b", candidates="recommend", **kwargs)
    badam = capacity.best_fit("llama-3.2-1b", candidates="BAdam", **kwargs)
    assert badam.recipe.optimizer == "badam" and recommended.recipe.optimizer not in ("badam",)
    assert everything.need_bytes == min(badam.need_bytes, recommended.need_bytes, everything.need_bytes)
    assert badam.need_bytes < recommended.need_bytes  # one block's gradients and state, not the whole model's
    cats = badam.categories()
    model = capacity._meta_model("llama-3.2-1b")
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    # at the step's peak BAdam holds one block's fp32 gradients at most: under fp16 autocast (traced in fp16) the
    # peak falls at the loss, before the active block's gradients exist; never the whole model's
    assert cats["gradients"] in (0, 4 * block)
    with pytest.raises(ValueError, match="candidates must be"):
        capacity.best_fit("llama-3.2-1b", candidates="lomo", **kwargs)


def test_best_fit_takes_the_8bit_weight_candidates_by_name():
    # 'all' leaves them out (recommend offers 8-bit weights only when nothing else fits): the benchmark names them
    int8 = capacity.best_fit("llama-3.1-8b", mode="full", seq_len=2048, candidates="AdaLomo, int8 weights")
    assert int8.fits and int8.recipe.weight_dtype == "int8" and int8.recipe.optimizer == "adalomo"
    assert int8.recipe.precision == "fp16"  # a T4: no native bf16


def test_capacity_json_names_llama_3_1_8b_for_full_fine_tuning_at_2048_tokens_by_trace():
    table = cm.capacity.shipped_table("capacity")
    rows = {r["seq_len"]: r for r in table["rows"] if r["mode"] == "full"}
    row = rows[2048]
    assert row["largest_named_params"] >= 8_030_261_248, row["largest_named_model"]  # Llama-3.1-8B's parameters, or more
    assert row["largest_named_planned_by"] == "trace" and row["largest_named_traced"]["fits"]
    assert row["target_met_by_trace"] is True  # the 4B target at 2,048 tokens, met by the traced 8B plan
    assert row["largest_named_traced"]["need_bytes"] <= row["largest_named_traced"]["limit_bytes"]
    assert "weight_dtype=int8" in row["largest_named_recipe"]
    # the loss gap is the measured one, from the benchmark's file, with its source
    assert row["largest_named_loss_gap_pct"] is not None and "finetune" in row["largest_named_loss_gap_source"]
    assert set(capacity.INT8_CANDIDATES) <= set(row["candidates"]) and set(capacity.INT8_CANDIDATES) <= set(table["full_candidates"])
    for seq in (512, 2048):  # both lengths name their largest model with its loss gap
        assert rows[seq]["largest_named_model"] and "largest_named_loss_gap_pct" in rows[seq]


def test_longest_sequence_is_the_boundary_of_the_planned_fit():
    """The longest multiple of step_tokens whose plan fits; the next one up does not."""
    import warnings

    from colab_memopt import Recipe
    from colab_memopt.planning.capacity import longest_sequence
    from colab_memopt.planning.planner import plan

    recipe = Recipe(loss_chunk_tokens=8)
    at_32 = plan("tiny", 1, seq_len=32, recipe=recipe, target={"device_bytes": 2**30, "host_bytes": 2**40, "cuda": False},
                 find_max_batch=False)
    target = {"name": "tight", "device_bytes": int(at_32.peak_bytes / 0.95) + 1, "host_bytes": 2**40, "cuda": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = longest_sequence("tiny", recipe, target=target, step_tokens=8, guess_tokens=8)
        assert res.max_seq_len >= 32 and res.method == "trace" and res.converged
        assert res.max_seq_len == 64 or not plan("tiny", 1, seq_len=res.max_seq_len + 8, recipe=recipe, target=target,
                                                   find_max_batch=False).fits
    assert res.first_miss is not None and res.host_need_bytes > 0 and res.device_need_bytes <= int(target["device_bytes"] * 0.95)
    with pytest.raises(ValueError, match="step_tokens must be an integer >= 1, got 0"):
        longest_sequence("tiny", recipe, step_tokens=0)


def test_probe3_rows_198_201_a_step_above_the_cap_searches_below_it_and_max_plans_is_checked():
    # `context --model tiny` (default step 1024, cap 64 tokens) answered "nothing fits at 1024 tokens" and exit 1
    from colab_memopt.planning.capacity import longest_context, longest_sequence

    recipe = Recipe(loss_chunk_tokens=8)
    target = {"name": "big", "device_bytes": 2**34, "host_bytes": 2**40, "cuda": False}
    for step in (1024, 10**9):
        res = longest_sequence("tiny", recipe, target=target, step_tokens=step, method="analytic")
        assert res.max_seq_len == 64 and res.step_tokens == 8 and res.limited_by == "the sequence cap"
        assert res.note == f"the step ({step} tokens) is above the 64-token cap: searched in steps of 8"
    few = longest_sequence("tiny", recipe, target=target, step_tokens=1, guess_tokens=1, max_plans=2, method="analytic")
    assert not few.converged and few.plans == 2 and "the search stopped after 2 plans (max_plans=2)" in few.note
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"max_plans must be an integer >= 1 \(plans per search\), got {bad!r}"):
            longest_sequence("tiny", recipe, max_plans=bad)
        with pytest.raises(ValueError, match=r"max_plans must be an integer >= 1"):
            longest_context("tiny", max_plans=bad)


@pytest.mark.parametrize("argv,says", [
    (["--max-plans", "0"], "--max-plans must be an integer >= 1 (plans per search), got 0"),
    (["--max-plans", "-2"], "--max-plans must be an integer >= 1 (plans per search), got -2"),
    (["--step", "0"], "--step must be an integer >= 1 (tokens), got 0"),
])
def test_probe3_context_cli_refuses_bad_search_bounds_by_flag(argv, says, capsys):
    from colab_memopt.tooling.cli import main

    assert main(["context", "--model", "tiny", *argv]) == 2
    assert says in capsys.readouterr().err


def test_probe3_context_cli_answers_for_the_tiny_model(capsys):
    from colab_memopt.tooling.cli import main

    code = main(["context", "--model", "tiny", "--mode", "full", "--method", "analytic"])
    out = capsys.readouterr().out
    assert code == 0 and "full fine-tuning: 64 tokens" in out and "max_length=64" in out, out
    assert main(["context", "--model", "tiny", "--mode", "full", "--method", "analytic", "--verbose"]) == 0
    assert "searched in steps of 8" in capsys.readouterr().out  # the search's note: behind --verbose


def test_a_length_the_device_fits_but_host_ram_does_not_is_limited_by_host_ram_and_two_level_offload_goes_on():
    """Offloaded checkpoints count against host RAM: past what the host holds the search says 'host RAM', not
    'fits'; with split checkpoints one host copy per 2 blocks (checkpoint_interval=2) takes it further."""
    import warnings

    from colab_memopt.planning.capacity import longest_sequence
    from colab_memopt.planning.planner import plan

    recipe = Recipe(checkpointing="offload", loss_chunk_tokens=8)
    big = {"name": "big", "device_bytes": 2**34, "host_bytes": 2**40, "cuda": False}
    at_64 = plan("tiny", 1, seq_len=64, recipe=recipe, target=big, find_max_batch=False, method="analytic")
    copies = sum(c.bytes for c in at_64.host_costs if c.name == "offloaded checkpoints")  # bytes at 64 tokens
    data = sum(c.bytes for c in at_64.host_costs if c.name == "data pipeline")
    target = {**big, "name": "little-ram", "host_bytes": int((0.6 * copies + data) / 0.95)}  # 38 tokens' copies
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = longest_sequence("tiny", recipe, target=target, step_tokens=8, guess_tokens=8, host_base_bytes=0,
                               method="analytic")
        two = longest_sequence("tiny", recipe, target=target, step_tokens=8, guess_tokens=8, host_base_bytes=0,
                               split_checkpoints=True, method="analytic")
    assert one.max_seq_len == 32 and one.limited_by == "host RAM", (one.max_seq_len, one.limited_by)
    assert one.first_miss["fits_device"] and not one.first_miss["fits_host"]
    assert one.host_need_bytes <= int(target["host_bytes"] * 0.95) < one.first_miss["host_need_bytes"]
    assert two.max_seq_len == 64 and two.recipe["checkpoint_interval"] == 2, (two.max_seq_len, two.recipe)
    assert two.offloaded_checkpoint_bytes == copies // 2
    from colab_memopt.planning.capacity import ContextReport

    said = str(ContextReport("tiny", "little-ram", {"full": one}, {}))
    assert "full fine-tuning: 32 tokens" in said and "next limit: host RAM at 40" in said, said


def test_context_json_gives_llama_8b_qlora_49152_tokens_by_trace_within_colab_host_ram():
    """The shipped long-context table (benchmarks/context.py): issue 36's target, traced, host RAM counted."""
    context = cm.capacity.shipped_table("context")
    best = context["best"]["llama-3.1-8b/qlora"]
    assert best["max_seq_len"] >= 49152 and best["method"] == "trace", best
    assert best["recipe"]["attention"] == "sdpa_repeated_kv"  # a T4 runs the O(T) kernel only with K/V repeated
    assert best["host_need_bytes"] <= context["target"]["host_bytes"] * (1 - context["target"]["headroom"]) < 12.7e9
    assert best["device_need_bytes"] <= context["target"]["device_bytes"] * (1 - context["target"]["headroom"])
    target = next(t for t in context["targets"] if (t["model"], t["mode"]) == ("llama-3.1-8b", "qlora"))
    assert target["met"] and target["method"] == "trace"
    # rows of grouped-query models planned with the O(T) kernel (before the T4's kernel was modelled) are not best
    rows = {(r["model"], r["mode"], r["recipe_name"]): r for r in context["rows"]}
    for key, b in context["best"].items():
        assert not rows[(*key.split("/"), b["recipe_name"])].get("stale"), key


def test_a_shipped_table_planned_for_another_t4_says_so():
    """The T4 changed (14.56 GiB on 2026 Colab images, a 147 MiB CUDA context, one 5% margin): a table planned for
    the older definition still ships, and says what it was planned for, so no notebook shows it as today's plan."""
    from colab_memopt.planning.targets import DEFAULT_HEADROOM, get_target

    t4 = get_target("t4")
    today = {"name": "t4", "device_bytes": t4.device_bytes, "host_bytes": t4.host_bytes,
             "cuda_context_bytes": t4.cuda_context_bytes, "headroom": DEFAULT_HEADROOM}
    assert capacity.stale_target({"target": today}) is None
    assert capacity.stale_target({"target": "t4", "device_bytes": t4.device_bytes, "host_bytes": t4.host_bytes,
                                  "headroom": DEFAULT_HEADROOM}) is None  # capacity.json's flat form
    older = capacity.stale_target({"target": {**today, "device_bytes": 15_826_954_485, "cuda_context_bytes": 768 * 2**20}})
    assert older.startswith("planned for a t4 of 14.74 GiB total, 768.00 MiB CUDA context") and "14.56 GiB" in older
    assert "margin 10%" not in older and "10% margin" in capacity.stale_target({"target": "t4", "headroom": 0.1})
    assert "does not define" in capacity.stale_target({"target": "a100"})
    for name in ("capacity", "context"):  # what ships: the marker is computed, never typed in
        table = cm.capacity.shipped_table(name)
        stored = {k: v for k, v in capacity._table_target(table).items() if k != "name" and v is not None}
        now = {k: today[k] for k in stored}
        assert (table["stale_target"] is None) == (stored == now), (name, stored, now)


@pytest.mark.parametrize("need", [
    lambda u: 1000 * u,  # linear: the line lands on the boundary
    lambda u: 1000 * u + 40 * u * u,  # bends up (the gallop from a poor guess took 12 plans on a curve like it)
    lambda u: 20000 * (u ** 0.5),  # bends down
    lambda u: 1000 * u + (30000 if u > 40 else 0),  # a step (a recipe that changes with the length)
], ids=["linear", "bends up", "bends down", "steps"])
@pytest.mark.parametrize("start", [1, 17, 60, 128])
def test_the_secant_search_finds_the_boundary_in_few_plans(need, start):
    """`_secant_search` (the longest sequence's): the longest length whose need is under the limit, as a scan finds
    it, from any first guess, in few plans; nothing fits, everything fits, and a plan budget too small are said."""
    from colab_memopt.planning.capacity import _secant_search

    for limit in (400, 55_000, 10**9):
        planned: list[int] = []

        def fits(u: int) -> bool:
            planned.append(u)
            return need(u) <= limit

        units, converged = _secant_search(fits, lambda u: limit - need(u), start, 128, 16)
        expected = max((u for u in range(1, 129) if need(u) <= limit), default=0)
        assert (units, converged) == (expected, True), (limit, planned)
        assert len(planned) == len(set(planned)) <= 10, planned  # never the same length twice
    units, converged = _secant_search(lambda u: need(u) <= 55_000, lambda u: 55_000 - need(u), 1, 128, 2)
    assert not converged and units == 2  # two plans (1 and 2 tokens' steps) fit: the boundary is not found yet


def test_longest_context_names_an_unknown_model_once():
    """An unknown model is its own error, not one 'cannot be planned' per mode."""
    with pytest.raises(ValueError, match=r"^unknown model 'nosuch': not one of our names"):
        cm.capacity.longest_context("nosuch")
