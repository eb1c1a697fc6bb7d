import pytest

import colab_memopt as cm


def test_default_recipe_builds_adamw():
    model, opt = cm.Recipe().build(cm.build_model("tiny"))
    assert type(opt).__name__ == "AdamW"


def test_recipe_sets_attention_on_the_reference_model():
    model, _ = cm.Recipe(attention="naive").build(cm.build_model("tiny"))
    assert all(block.attn.attention == "naive" for block in model.blocks)


def test_recipe_rejects_bad_values_and_unknown_fields():
    with pytest.raises(ValueError, match="recipe.optimizer must be one of .* got 'adam9'"):
        cm.Recipe(optimizer="adam9")
    with pytest.raises(ValueError, match="recipe.lr must be > 0, got -1"):
        cm.Recipe(lr=-1)
    with pytest.raises(ValueError, match=r"unknown recipe field\(s\) \['colour'\]"):
        cm.Recipe.from_dict({"colour": "red"})
    assert cm.Recipe.from_dict({"optimizer": "sgd"}).with_(lr=0.1).to_dict()["lr"] == 0.1
