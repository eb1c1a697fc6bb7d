"""The command line: exit codes 0/1/2, one line naming a bad value, one JSON object with --json.

Each test named `test_probe_row_N...` is a reproduction from shared/reviews/reliability-probe.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colab_memopt.tooling.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _json_error(argv, capsys, code=2):
    got, out, err = _run([*argv, "--json"], capsys)
    assert got == code, err
    obj = json.loads(out)  # exactly one JSON object on stdout
    assert obj["exit_code"] == code and obj["error"]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return obj["error"]


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "tiny", "--batch", "2", "--seq", "32", "--recipe", "zero_stage=2", "offload_optimizer=true", "--json"],
    ["plan", "--model", "tiny", "--batch", "2", "--seq", "32", "--recipe", "zero_stage=3", "offload_param=true", "--json"],
])
def test_probe_rows_33_34_deepspeed_output_goes_to_stderr_and_stdout_is_json(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "colab_memopt", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["recipe"]["zero_stage"] in (2, 3)


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "tiny", "--batch", "1", "--seq", "32", "--recipe", "lr=abc"], r"recipe.lr must be a finite number > 0, got 'abc'"),  # row 15
    (["recommend", "--model", "tiny", "--seq", "1000000000"], "seq_len 1000000000 exceeds 'tiny''s maximum of 64"),  # row 41
    (["recommend", "--model", "llama-3.2-1b", "--seq", "200000"], "seq_len 200000 exceeds 'llama-3.2-1b''s maximum of 131072"),  # row 42
    (["recommend", "--model", "tiny", "--seq", "100000"], "seq_len 100000 exceeds 'tiny''s maximum of 64"),  # row 43
    (["recommend", "--model", "tiny", "--seq", "32", "--headroom", "1.5"], r"headroom must be in [0, 1) (the fraction of memory kept free), got 1.5"),  # row 46
    (["recommend", "--model", "tiny", "--seq", "32", "--headroom", "nan"], "headroom must be in [0, 1) (the fraction of memory kept free), got nan"),  # row 48
    (["recommend", "--model", "tiny", "--seq", "32", "--headroom", "1"], "headroom must be in [0, 1) (the fraction of memory kept free), got 1.0"),  # row 49
    (["plan", "--model", "tiny", "--batch", "abc"], "argument --batch: invalid int value: 'abc'"),
    (["plan", "--batch", "1"], "plan needs --model and --batch (or --training-args FILE)"),
    (["plan", "--model", "tiny", "--batch", "1", "--nope"], "unrecognized arguments: --nope"),
])
def test_probe_rows_bad_input_is_exit_2_with_one_line_and_a_json_error(argv, says, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in err
    assert says in _json_error(argv, capsys)


def test_plan_and_recommend_refuse_with_the_same_message(capsys):
    # probe row 43: plan said exit 2, recommend said exit 0 "fits"
    plan_err = _json_error(["plan", "--model", "tiny", "--batch", "1", "--seq", "100000"], capsys)
    rec_err = _json_error(["recommend", "--model", "tiny", "--seq", "100000"], capsys)
    assert plan_err == rec_err == "seq_len 100000 exceeds 'tiny''s maximum of 64"


@pytest.mark.parametrize("content, says", [
    ('{"device": "x"}', r"c.json lacks \['ratios', 'model', 'batch', 'seq_len'\]"),  # row 52 (was KeyError: 'ratios')
    ("{not json", r"c.json is not valid JSON"),  # row 51 (the file was not named)
    ("[]", r"c.json must hold a JSON object"),  # row 54 (list indices must be integers)
    ('{"ratios": {"lora": "fast"}, "device": "x", "model": "m", "batch": 1, "seq_len": 1}', r"'ratios' must map .*'lora': 'fast'"),
    (None, r"is a folder, not a JSON file"),  # row 53 (IsADirectoryError traceback)
])
def test_probe_rows_51_to_54_a_bad_costs_file_is_named(tmp_path, capsys, content, says):
    path = tmp_path / "c.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    argv = ["recommend", "--model", "tiny", "--seq", "32", "--costs", str(path)]
    code, out, err = _run(argv, capsys)
    assert code == 2 and "Traceback" not in err and str(path) in err
    assert __import__("re").search(says, _json_error(argv, capsys))


def test_probe_row_31_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and "colab-memopt 0.1.0" in capsys.readouterr().out


def test_does_not_fit_is_exit_1_with_the_plan(capsys):
    argv = ["plan", "--model", "tiny", "--batch", "1", "--seq", "32", "--device-bytes", "1000", "--host-bytes", str(10**12)]
    code, out, _ = _run(argv, capsys)
    assert code == 1 and "DOES NOT FIT (device memory)" in out
    code, out, _ = _run([*argv, "--json"], capsys)
    assert code == 1 and json.loads(out)["fits"] is False


def test_no_recipe_fits_is_exit_1_with_a_json_error(capsys):
    argv = ["recommend", "--model", "tiny", "--seq", "32", "--device-bytes", "1", "--host-bytes", "1", "--method", "analytic"]
    assert "no recipe fits" in _json_error(argv, capsys, code=1)


def test_no_recipe_fits_says_each_modes_reason_in_lines_of_at_most_100_characters(capsys):
    # the message ran to one line of over 1,000 characters (three modes' reasons joined by ' | ')
    argv = ["recommend", "--model", "tiny", "--seq", "32", "--device-bytes", "1", "--host-bytes", "1", "--method", "analytic"]
    code, out, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and lines[0].startswith("no recipe fits: ") and " | " not in err
    assert len(lines) > 3 and max(map(len, lines)) <= 100, err
    assert sum(line.startswith("mode ") for line in lines) == 2  # full, lora, qlora: one paragraph each


def test_probe_row_21_lora_targets_can_be_set_from_the_cli(capsys):
    code, out, err = _run(["plan", "--model", "tiny", "--batch", "1", "--seq", "16", "--method", "analytic", "--no-max-batch",
                           "--recipe", "lora_rank=4", "lora_targets=qkv,proj", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["recipe"]["lora_targets"] == ["qkv", "proj"]


def test_probe3_row_226_plan_with_the_automatic_loss_chunk_answers_in_seconds(capsys):
    # the max-batch search with loss_chunk_tokens=auto ran 376 s for the tiny model (a round per chunk); the trace now
    # runs the chunked loss's first rounds only, and the search finds its boundary
    import time

    start = time.perf_counter()
    code, out, err = _run(["plan", "--model", "tiny", "--batch", "2", "--seq", "32", "--recipe", "loss_chunk_tokens=auto",
                           "--json"], capsys)
    assert code == 0 and time.perf_counter() - start < 60, err
    answer = json.loads(out)
    assert answer["max_batch"] > 2 * 128 and not any("max_batch" in w for w in answer["warnings"]), answer["warnings"]


def test_issue36_int8_full_fine_tune_plans_by_trace_from_the_cli(capsys):
    # the Llama-3.1-8B command of issue 36 at small scale: fp16 int8 weights fell back to the analytic estimate
    # (the overflow check read a value the fake tensors do not have)
    code, out, err = _run(["plan", "--model", "tiny", "--batch", "1", "--seq", "32", "--target", "t4", "--no-max-batch",
                           "--recipe", "weight_dtype=int8", "optimizer=adalomo", "precision=fp16", "checkpointing=full",
                           "--verbose"], capsys)
    assert code == 0, err
    assert "method: trace;" in out and "verdict: FITS" in out, out
    assert "could not trace" not in out + err


# -- reliability probe 4 (shared/reviews/reliability-probe-4.md): the --training-args rows ------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("probe4") / "llama"
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(folder)
    return folder


def _plan_file(tmp_path, llama_dir, text, capsys, *extra):
    path = tmp_path / "args.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\n" + text)
    return _json_error(["plan", "--model", str(llama_dir), "--training-args", str(path), "--no-max-batch", *extra],
                       capsys)


@pytest.mark.parametrize(("text", "extra", "named"), [
    # exit 3: AttributeError: module 'torch' has no attribute 'float8'
    ("max_length: 64\n", ("--bnb", "load_in_4bit=true", "bnb_4bit_compute_dtype=float8", "--lora", "r=8"),
     "bnb_4bit_compute_dtype must be one of ['float32', 'float16', 'bfloat16'], got 'float8'"),
    # exit 3: MemoryError from the planner's one-row dataset
    ("max_length: 64\nper_device_train_batch_size: 2\n", ("--seq", "1000000000000"),
     "--seq=1,000,000,000,000 at per_device_train_batch_size=2: the micro-batch's token ids alone"),
    # no answer in 200 s (probe 4 recheck): the planner's fake Trainer mapped and collated a row of 50M tokens
    ("max_length: 64\nper_device_train_batch_size: 2\n", ("--seq", "50000000"),
     "per_device_train_batch_size=2 at seq_len=50,000,000: the embedding's output and the first block's normalized "
     "copy of it alone (2 x 2 x 50,000,000 x 64 values, 2 bytes each at the least) need 23.84 GiB"),
    # exit 3: OverflowError: cannot fit 'int' into an index-sized integer
    ("max_length: 1000000000000000000000000000000\n", (), "max_length=1,000,000,000,000,000,000,000,000,000,000 at"),
    # planned at 64 without a word
    ("max_length: 64\nper_device_train_batch_size: 2\nper_device_train_batch_size: 64\n", (),
     "gives 'per_device_train_batch_size' twice (line 6) (2, then 64)"),
    # refused as "recipe.lr must be a finite number > 0": the internal field, not the user's
    ("max_length: 64\nlearning_rate: .inf\n", (), "learning_rate must be a finite number > 0 such as 2e-4, got inf"),
    ("max_length: 64\nlearning_rate: -1.0e-4\n", (), "learning_rate must be a finite number > 0 such as 2e-4, got -0.0001"),
])
def test_probe4_cli_rows_are_exit_2_naming_the_users_setting(tmp_path, llama_dir, capsys, text, extra, named):
    error = _plan_file(tmp_path, llama_dir, text, capsys, *extra)
    assert named in error and "recipe." not in error, error


def test_probe4_duplicate_keys_in_json_and_yaml_merge_keys(tmp_path):
    from colab_memopt.planning.hfconfig import read_mapping

    (tmp_path / "a.json").write_text('{"max_length": 64, "max_length": 32}')
    with pytest.raises(ValueError, match=r"gives 'max_length' twice \(64, then 32\)"):
        read_mapping(tmp_path / "a.json")
    # a YAML merge key's values may be overridden once (that is what << is for); a key written twice may not
    (tmp_path / "m.yaml").write_text("base: &b {x: 1, y: 1}\nrun:\n  <<: *b\n  x: 3\n")
    assert read_mapping(tmp_path / "m.yaml")["run"] == {"x": 3, "y": 1}
    (tmp_path / "n.yaml").write_text("run:\n  x: 1\n  nested: {a: 1, a: 2}\n")
    with pytest.raises(ValueError, match=r"gives 'a' twice \(line 3\)"):
        read_mapping(tmp_path / "n.yaml")


def test_round3_a_string_learning_rate_is_named_through_the_api():
    """Round 3 and 4: plan_trainer(SFTConfig(learning_rate='fast')) said "could not convert string to float: 'fast'"."""
    from trl import SFTConfig

    import colab_memopt as cm

    for lr, says in (("fast", "learning_rate must be a number such as 2e-4, got 'fast'"),
                     (float("nan"), "learning_rate must be a finite number > 0 such as 2e-4, got nan")):
        args = SFTConfig("/tmp/colab_memopt_test_cli", learning_rate=lr, max_length=16, use_cpu=True, bf16=False,
                         report_to=[])
        with pytest.raises(ValueError, match=says):
            cm.hfconfig.trainer_recipe(args)
    args = SFTConfig("/tmp/colab_memopt_test_cli", learning_rate="2e-4", use_cpu=True, bf16=False, report_to=[])
    assert cm.hfconfig.trainer_recipe(args)[0].lr == 2e-4  # a number written as a string, as TRL's parser reads it
    # but a Trainer keeps it as text, and its optimizer refuses it when training starts (torch's AdamW: "'<=' not
    # supported between instances of 'float' and 'str'", from inside the plan's trace before): said by name
    with pytest.raises(ValueError, match=r"learning_rate='2e-4' is text: .* give a number: learning_rate=0.0002"):
        cm.plan_trainer(args, model="smollm2-135m", target="t4")


_HEAVY = ("torch", "transformers", "trl", "peft", "bitsandbytes")


def _imports_of(argv: list[str]) -> tuple[int, list[str], str]:
    """Run the command line in a fresh interpreter; return (exit code, the heavy libraries it imported, stderr)."""
    code = ("import sys\nfrom colab_memopt.tooling.cli import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as exc:\n    rc = exc.code or 0\n"
            f"print('IMPORTED', sorted(m for m in {_HEAVY!r} if m in sys.modules), rc)\n")
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("IMPORTED"))
    heavy, _, rc = line.split(" ", 1)[1].rpartition(" ")
    return int(rc), eval(heavy), run.stderr  # noqa: S307 - our own printed list


@pytest.mark.parametrize("argv", [
    ["--help"], ["plan", "--help"], ["recommend", "--help"], ["doctor", "--help"], ["context", "--help"],
])
def test_help_of_every_verb_answers_before_torch_is_imported(argv):
    rc, heavy, _ = _imports_of(argv)
    assert rc == 0 and heavy == []


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "tiny", "--batch", "0"], "--batch must be an integer >= 1 (sequences), got 0"),
    (["recommend", "--model", "tiny", "--seq", "-5"], "--seq must be an integer >= 1 (tokens), got -5"),
    (["context", "--model", "tiny", "--max-plans", "0"], "--max-plans must be an integer >= 1 (plans per search), got 0"),
    (["context", "--model", "tiny", "--mode", "bogus"], "invalid choice: 'bogus'"),
    (["recommend"], "the following arguments are required: --model"),
    (["doctor", "--model", "tiny", "--batch", "0"], "--batch must be an integer >= 1 (sequences), got 0"),
    (["plan", "--model", "tiny", "--batch", "two"], "invalid int value: 'two'"),
    (["plan", "--model", "llama-3.1-8b"], "plan needs --model and --batch"),
    (["plan", "--model", "nosuch", "--batch", "1"], "unknown model 'nosuch': not one of our names"),
    (["recommend", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["context", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["doctor", "--model", "./no/such/folder/x"], "unknown model './no/such/folder/x'"),
    (["plan", "--model", "tiny", "--batch", "1", "--target", "t5"], "unknown target 't5'; choose one of"),
    (["doctor", "--model", "tiny", "--target", "t5"], "unknown target 't5'; choose one of ['a100-40gb', 'a100-80gb', "
                                                      "'auto', 'h100-80gb', 'l4', 't4']"),
    (["context", "--model", "tiny", "--device-bytes", "1000000"], "--device-bytes and --host-bytes go together"),
    (["plan", "--model", "tiny", "--batch", "1", "--recipe", "bogus=1"], "unknown recipe field(s) ['bogus']"),
    (["doctor", "--model", "tiny", "--recipe", "precision"], "--recipe takes field=value pairs, got 'precision'"),
    (["doctor"], "doctor needs --model (or --training-args FILE)"),
    (["plan", "--model", "tiny", "--batch", "1", "--lora", "r=8"], "--lora and --bnb go with --training-args"),
    (["plan", "--model", "tiny", "--training-args", "tests/test_cli.py", "--batch", "2"], "leave --batch and --recipe out"),
    (["plan", "--model", "tiny", "--training-args", "no/such.yaml"], "--training-args: no such file: 'no/such.yaml'"),
    (["recommend", "--model", "tiny", "--costs", "no/such.json"], "--costs: no such file: 'no/such.json'"),
    (["recommend", "--model", "tiny", "--headroom", "2"], "--headroom must be in [0, 1) (the fraction of memory kept free)"),
    (["plan", "--model", "gpt2", "--batch", "1", "--seq", "8192"], "seq_len 8192 exceeds 'gpt2''s maximum of 1024"),
])
def test_a_bad_argument_is_refused_before_torch_is_imported(argv, says):
    rc, heavy, err = _imports_of(argv)
    assert rc == 2 and heavy == [] and says in err


def test_the_names_help_lists_are_the_packages_own():
    from colab_memopt.planning.recommender import OBJECTIVES
    from colab_memopt.planning.targets import TARGETS
    from colab_memopt.techniques.architectures import model_names
    from colab_memopt.tooling import cli
    from colab_memopt.training.presets import MODES

    assert list(cli.MODEL_NAMES) == model_names()
    assert list(cli.TARGET_NAMES) == list(TARGETS)
    assert list(cli.MODES) == list(MODES)
    assert tuple(cli.OBJECTIVES) == tuple(OBJECTIVES)
    from dataclasses import fields

    from colab_memopt.training.recipe import Recipe

    assert cli.RECIPE_FIELDS == tuple(f.name for f in fields(Recipe))
    from colab_memopt.techniques.architectures import max_seq_len

    assert cli.MAX_SEQ_LEN == {name: max_seq_len(name) for name in model_names()}


@pytest.mark.parametrize("model", ["llama-3.1-8b", "tiny", "nosuch", "", "  ", "org/name", "org/", "/org/name",
                                   "./rel/name", "~nosuchuser_x/m", "a/b/c", "tests", "tests/test_cli.py"])
def test_the_command_lines_model_check_refuses_what_the_planner_refuses(model):
    """The command line refuses an unknown --model before importing the planner: exactly where `resolve_model`
    says 'unknown model' or 'empty' (a folder or file it reads, and what it lacks, is the planner's to say)."""
    from colab_memopt.techniques.architectures import resolve_model
    from colab_memopt.tooling import cli

    try:
        cli._check_model(model)
        quick = None
    except ValueError as exc:
        quick = str(exc)
    try:
        resolve_model(model)
        slow = None
    except ValueError as exc:
        slow = str(exc)
    except Exception as exc:  # noqa: BLE001 - the hub (no network here) or a file it cannot read: not a name error
        slow = f"{type(exc).__name__}"
    if quick is not None:
        assert slow == quick
    else:
        assert slow is None or not slow.startswith(("unknown model", "model must not be empty")), slow
