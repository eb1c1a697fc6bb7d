"""Progress lines: a planning call that runs longer than about 2 s says what it is doing, one line per step on stderr
(plain lines: a terminal and a notebook show the same); a quick call prints nothing."""

from __future__ import annotations

import io
import threading
import time

import pytest

from colab_memopt.core import progress as pg


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_call_quicker_than_the_threshold_prints_nothing():
    out = io.StringIO()
    with pg.progress("plan", after_s=60, stream=out):
        pg.say("tracing")
    assert out.getvalue() == ""


def test_a_long_call_prints_its_steps_while_it_runs_the_held_ones_first():
    out = io.StringIO()
    seen_while_running: list[str] = []
    with pg.progress("fit_trainer", after_s=0.2, stream=out):
        pg.say("plan 1: your settings")  # before the threshold: held
        time.sleep(0.6)  # one long step: the timer shows the held line while it runs
        seen_while_running = _lines(out)
        pg.say("plan 2: fp16=True")
    assert seen_while_running == ["fit_trainer: plan 1: your settings"]
    lines = _lines(out)
    assert lines[:2] == ["fit_trainer: plan 1: your settings", "fit_trainer: plan 2: fp16=True"]
    assert lines[2].startswith("fit_trainer: done in ") and len(lines) == 3


def test_inner_blocks_join_the_outer_lines_indented_and_a_plan_inside_a_search_stays_quiet():
    out = io.StringIO()
    with pg.progress("context", after_s=0, stream=out):
        pg.say("lora: searching")
        with pg.progress("longest sequence"):
            pg.say("plan 1 of at most 12: 4,096 tokens")
            with pg.progress("plan", nested=False):
                pg.say("tracing one training step")  # the search's line already said which plan
                with pg.progress("largest batch"):
                    pg.say("trace at batch 3")
    assert _lines(out)[:2] == ["context: lora: searching", "  longest sequence: plan 1 of at most 12: 4,096 tokens"]
    assert len(_lines(out)) == 3  # and the done line


def test_lines_are_at_most_100_characters_and_go_to_stderr_as_it_is_then(capsys):
    with pg.progress("fit_trainer", after_s=0):
        pg.say("plan 3: " + ", ".join(f"setting_{i}=value_{i}" for i in range(20)))
    err = capsys.readouterr().err.splitlines()
    assert len(err) > 2 and all(len(line) <= 100 for line in err)
    assert err[0].startswith("fit_trainer: plan 3: setting_0=value_0") and err[1].startswith("    setting_")


def test_say_outside_a_block_prints_nothing(capsys):
    pg.say("nothing")
    assert capsys.readouterr() == ("", "")


def test_blocks_in_other_threads_are_their_own():
    out = io.StringIO()
    other = io.StringIO()

    def work():
        with pg.progress("recommend", after_s=0, stream=other):
            pg.say("in the thread")

    with pg.progress("doctor", after_s=0, stream=out):
        t = threading.Thread(target=work)
        t.start()
        t.join()
        pg.say("in the main thread")
    assert _lines(other)[0] == "recommend: in the thread" and _lines(out)[0] == "doctor: in the main thread"


# The planning calls themselves, with the threshold at 0 so that every line shows.

@pytest.fixture
def at_once(monkeypatch):
    monkeypatch.setattr(pg, "SHOW_AFTER_S", 0.0)


def test_plan_says_it_builds_and_traces_and_its_largest_batch_search_each_trace(at_once, capsys):
    import colab_memopt as cm

    p = cm.plan("tiny", 2, seq_len=32, target="t4", method="trace", find_max_batch=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "plan: building tiny on fake tensors (no weights loaded)"
    assert err[1] == "plan: tracing one training step: batch 2 x 32 tokens"
    searched = [ln for ln in err if ln.startswith("  largest batch: trace at batch ")]
    assert searched and p.max_batch > 2
    assert len(searched) == len({ln for ln in searched})  # each batch traced once
    assert err[-1].startswith("plan: done in ")


def test_doctor_says_each_check(at_once, capsys):
    import colab_memopt as cm

    checkup = cm.doctor("tiny", target="t4", seq_len=32)
    err = capsys.readouterr().err.splitlines()
    checks = [ln for ln in err if ln.startswith("doctor: check ")]
    assert len(checks) == len(checkup.checked) and "doctor: check 1: bf16 on this GPU" in checks


def test_context_says_each_plan_of_its_search(at_once, capsys):
    import colab_memopt as cm

    report = cm.longest_context("tiny", modes=("full",), step_tokens=8, max_plans=4)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "context: full: searching the longest sequence"
    plans = [ln for ln in err if ln.startswith("  longest sequence: full: plan ")]
    assert len(plans) == report.results["full"].plans and "of at most 4" in plans[0]


def test_fit_trainer_says_each_setting_it_plans(at_once, capsys):
    pytest.importorskip("trl")
    from transformers import LlamaConfig
    from trl import SFTConfig

    import colab_memopt as cm

    args = SFTConfig(output_dir="/tmp/colab_memopt_test_progress", per_device_train_batch_size=2, max_length=32,
                     report_to=[], use_cpu=True, bf16=True)
    model = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64)
    fit = cm.fit_trainer(args, model=model, target="t4")
    err = capsys.readouterr().err.splitlines()
    plans = [ln for ln in err if ln.startswith("fit_trainer: plan ")]
    assert plans[0] == "fit_trainer: plan 1: your settings"
    assert len(plans) == 1 + len(fit.tried) and "fp16=True" in plans[1]
    assert not any("plan_trainer:" in ln for ln in err)  # one line per setting, not the plan's own steps


def test_an_error_is_not_followed_by_a_done_line_and_a_call_without_steps_prints_nothing():
    out = io.StringIO()
    with pytest.raises(ValueError), pg.progress("recommend", after_s=0.05, stream=out):
        time.sleep(0.2)  # past the threshold, no step said yet
        raise ValueError("seq_len 200000 exceeds the model's maximum")
    assert out.getvalue() == ""
    with pytest.raises(ValueError), pg.progress("recommend", after_s=0, stream=out):
        pg.say("plan 1 of at most 4: fp16")
        raise ValueError("bad")
    assert _lines(out) == ["recommend: plan 1 of at most 4: fp16"]
