"""colab_memopt.planning.chat: dataset records as TRL's `messages`, and what merging a LoRA adapter costs."""

import sys

import pytest
import torch

import colab_memopt as cm
from colab_memopt.planning.chat import merge_cost, to_messages


def test_alpaca_records_become_a_user_and_an_assistant_turn():
    assert to_messages({"instruction": "Translate to French.", "input": "cat", "output": "chat"}) == {"messages": [
        {"role": "user", "content": "Translate to French.\n\ncat"}, {"role": "assistant", "content": "chat"}]}
    # an empty input adds nothing; a system message goes first
    assert to_messages({"instruction": "Name a colour.", "input": "", "output": "Blue."}, system="Be brief.") == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                     {"role": "assistant", "content": "Blue."}]}


def test_sharegpt_records_map_their_speakers_to_chat_roles():
    record = {"conversations": [{"from": "system", "value": "You help."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Bye"},
                                {"from": "gpt", "value": "Bye!"}]}
    roles = [m["role"] for m in to_messages(record)["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert to_messages(record, system="ignored")["messages"][0]["content"] == "You help."  # it has one already
    # some ShareGPT sets name the column `messages` and keep from/value
    assert to_messages({"messages": record["conversations"][1:3]})["messages"][1] == {"role": "assistant",
                                                                                     "content": "Hello!"}
    with pytest.raises(ValueError, match="unknown ShareGPT speaker 'narrator'"):
        to_messages({"conversations": [{"from": "narrator", "value": "Once"}]})


def test_trl_forms_are_read_as_they_are():
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert to_messages({"messages": chat}) == {"messages": chat}
    assert to_messages({"prompt": chat[:1], "completion": chat[1:]}) == {"messages": chat}
    assert to_messages({"prompt": "2+2?", "completion": "4"}) == {"messages": chat}


def test_a_record_of_another_form_is_refused_with_its_fields():
    with pytest.raises(ValueError, match=r"fields \['question', 'text'\].*Alpaca"):
        to_messages({"text": "x", "question": "y"})
    with pytest.raises(TypeError, match="got list"):
        to_messages([{"role": "user", "content": "x"}])


def test_to_messages_maps_a_dataset_sharegpt_and_alpaca_alike():
    from datasets import Dataset

    alpaca = Dataset.from_list([{"instruction": "a", "input": "", "output": "b"}])
    out = alpaca.map(to_messages, remove_columns=alpaca.column_names)
    assert out.column_names == ["messages"] and out[0]["messages"][1]["content"] == "b"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config)


def test_merge_cost_counts_the_16_bit_weights_and_the_largest_adapted_layer():
    config, model = _tiny_llama()
    cost = merge_cost(config, "float16", r=8)
    params = sum(p.numel() for p in model.parameters())  # the tied head once
    assert cost.parameters == params and cost.weights_bytes == 2 * params and cost.dtype == torch.float16
    # the largest Linear LoRA adapts is an MLP projection (160 x 64), not the tied head (96 x 64)
    assert cost.largest_layer.endswith("mlp.gate_proj") and cost.update_bytes == 160 * 64 * 4 * 2
    # A and B of rank 8 in fp32 on q, k, v, o, gate, up, down (k and v: 2 heads of 16 -> 32 outputs)
    per_layer = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 160) + (160 + 64)
    assert cost.adapter_bytes == 2 * 8 * per_layer * 4
    assert merge_cost(model, torch.float32).weights_bytes == 4 * params  # a model in memory, counted as it is
    assert "merge in float16" in str(cost) and max(len(line) for line in str(cost).splitlines()) <= 100


def test_merge_cost_bounds_a_real_merge_on_the_cpu():
    """Merge a LoRA adapter into an fp16 base on the CPU, counting every tensor storage: the peak is the base's
    weights plus one layer's update (peft upcasts it to fp32 there), as merge_cost says, and no more."""
    from peft import LoraConfig, get_peft_model

    from colab_memopt.core.tracker import LiveBytesMode

    config, model = _tiny_llama()
    model = model.to(torch.float16)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if "lora_" in n)
    cost = merge_cost(config, torch.float16, r=8)
    assert cost.adapter_bytes == adapter_bytes
    mode = LiveBytesMode(sys.maxsize, device=torch.device("cpu"))
    mode.track(peft_model)
    with mode:
        merged = peft_model.merge_and_unload()
    assert cost.weights_bytes + cost.adapter_bytes < mode.peak <= cost.peak_bytes  # an update is held while added
    assert sum(p.numel() for p in merged.parameters()) == cost.parameters


def test_merge_cost_refuses_a_quantized_model_and_other_dtypes():
    with pytest.raises(ValueError, match="dtype must be 'float16', 'bfloat16' or 'float32', got 'int8'"):
        merge_cost("smollm2-135m", "int8")
    with pytest.raises(ValueError, match="got torch.int8"):
        merge_cost("smollm2-135m", torch.int8)
    with pytest.raises(ValueError, match="r must be an int >= 1 .*got 0"):
        merge_cost("smollm2-135m", r=0)
    net = torch.nn.Linear(4, 4)
    net.weight = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(ValueError, match="model is quantized"):
        merge_cost(net)


def test_merge_cost_of_a_named_1_5b_model_fits_colab_host_ram_and_a_t4():
    cost = merge_cost("qwen2.5-1.5b")  # Qwen2.5-1.5B's config, built on the meta device
    assert 1.5e9 < cost.parameters < 1.6e9
    assert cost.peak_bytes < cm.COLAB_HOST_RAM_BYTES and cost.peak_bytes < cm.T4_USABLE_BYTES


@pytest.mark.parametrize("record, names", [
    ({"instruction": "x", "output": None}, r"output is missing or None"),
    ({"instruction": None, "output": "y"}, r"instruction is missing or None"),
    ({"instruction": "x", "output": 5}, r"output must be a str, got int 5"),
    ({"conversations": []}, r"conversations is an empty chat"),
    ({"messages": []}, r"messages is an empty chat"),
    ({"conversations": [{"from": "human"}]}, r"conversations\[0\]\['value'\] is missing or None"),
    ({"conversations": "hello"}, r"conversations must be a list of \{'from'.*got str 'hello'"),
    ({"conversations": [{"from": "human", "value": "a"}, "hi"]}, r"conversations\[1\] must be a dict.*got str 'hi'"),
    ({"prompt": "x", "completion": None}, r"completion is missing or None"),
    ({"prompt": None, "completion": "y"}, r"prompt is missing or None"),
    ({"prompt": ["x"], "completion": "y"}, r"prompt\[0\] must be a dict \{'role'.*got str 'x'"),
    ({"messages": "hello"}, r"messages must be a list of \{'role'.*got str 'hello'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]\['content'\] is missing or None"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\] has no 'role'"),
])
def test_a_row_without_an_answer_an_empty_chat_or_a_turn_without_text_is_refused_naming_the_field(record, names):
    """Probe 4: such rows became the text 'None', an empty message or an empty chat, or raised AttributeError."""
    with pytest.raises(ValueError, match=names):
        to_messages(record)


def test_system_must_be_text_and_a_tool_call_turn_keeps_its_empty_content():
    with pytest.raises(TypeError, match=r"system must be a str .*got int 5"):
        to_messages({"prompt": "x", "completion": "y"}, system=5)
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    chat = [{"role": "user", "content": "x"}, call]
    assert to_messages({"messages": chat}) == {"messages": chat}


def test_a_dataset_row_missing_its_answer_stops_the_map_naming_the_field():
    from datasets import Dataset

    ds = Dataset.from_list([{"instruction": "a", "output": "b"}, {"instruction": "c"}])  # datasets fills None
    with pytest.raises(ValueError, match="output is missing or None"):
        ds.map(to_messages, remove_columns=ds.column_names)


def test_merge_cost_refuses_int8_models_like_4_bit_ones(tmp_path):
    """An int8 model (load_int8, or quantization.quantize_model's int8 schemes) holds no 16-bit weights to count:
    refused like a bitsandbytes 4-bit model, not answered with its int8 bytes (reliability probe 4)."""
    from colab_memopt.techniques import quantization

    config, model = _tiny_llama()
    for scheme in ("int8_channel", "int8_tensor"):
        _, fresh = _tiny_llama()
        with pytest.raises(ValueError, match=r"model is quantized \(.*int8.*\): give its id, folder or config"):
            merge_cost(quantization.quantize_model(fresh, scheme))
    model.save_pretrained(tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"model is quantized \(.*int8.*\): give its id, folder or config"):
        merge_cost(cm.load_int8(tmp_path / "tiny", dtype=torch.bfloat16, device="cpu"))


def test_merge_cost_of_a_peft_model_counts_its_base_only():
    """A trained PeftModel: its adapters are neither base weights nor layers to adapt (reliability probe 4)."""
    from peft import LoraConfig, get_peft_model

    config, model = _tiny_llama()
    expected = merge_cost(config, torch.float32, r=8)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", modules_to_save=["lm_head"]))
    cost = merge_cost(peft_model, torch.float32, r=8)
    assert (cost.parameters, cost.weights_bytes, cost.adapter_bytes, cost.update_bytes, cost.largest_layer) == (
        expected.parameters, expected.weights_bytes, expected.adapter_bytes, expected.update_bytes,
        expected.largest_layer)
    assert cost.shard_by_shard.disk_bytes == expected.shard_by_shard.disk_bytes


def test_merge_cost_refuses_a_bool_rank():
    with pytest.raises(ValueError, match=r"r must be an int >= 1 .*got True"):
        merge_cost("smollm2-135m", r=True)
