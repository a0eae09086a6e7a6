"""Chat templates: read from either place a folder keeps them, rendered to transformers' text."""

from __future__ import annotations

import json

import pytest

from nereus.errors import ConfigError
from nereus.models import train_tiny_tokenizer
from nereus.models.chat import CHATML_TEMPLATE, load_chat_template, render_chat

# SmolLM2-Instruct's template (a default system turn), with a raise_exception branch.
SMOLLM2_LIKE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad "
    "role ' + message['role']) }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    [{"role": "user", "content": "What is 2+3?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tom has 4 apples."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "How many now?"},
    ],
]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, SMOLLM2_LIKE], ids=["chatml", "smollm2"])
@pytest.mark.parametrize("where", ["tokenizer_config", "jinja_file"])
def test_render_matches_transformers(tmp_path, template, where):
    from transformers import AutoTokenizer

    train_tiny_tokenizer(
        tmp_path,
        ["What is 2+3? Tom has 4 apples."] * 4,
        vocab_size=270,
        chat_template=template if where == "tokenizer_config" else None,
    )
    if where == "jinja_file":
        (tmp_path / "chat_template.jinja").write_text(template)
    assert load_chat_template(tmp_path) == template
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for messages in MESSAGES:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(template, messages, {"eos_token": "<|endoftext|>"}) == want
        assert render_chat(
            template, messages, add_generation_prompt=False
        ) == hf.apply_chat_template(messages, tokenize=False)


def test_folder_without_a_template_and_named_templates(tmp_path):
    train_tiny_tokenizer(tmp_path, ["a b c"] * 4, vocab_size=270)
    assert load_chat_template(tmp_path) is None
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path) == "D"


def test_errors_name_where_the_messages_came_from():
    with pytest.raises(ConfigError, match=r"data.jsonl: row 3.*bad role tool"):
        render_chat(SMOLLM2_LIKE, [{"role": "tool", "content": "x"}], where="data.jsonl: row 3")
    with pytest.raises(ConfigError, match=r"row 1: message 0 must be a map"):
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": 5}], where="row 1")
    with pytest.raises(ConfigError, match="non-empty list"):
        render_chat(CHATML_TEMPLATE, [], where="row 2")
    with pytest.raises(ConfigError, match="rendering failed"):
        render_chat("{% for x in %}", [{"role": "user", "content": "x"}])
    # The sandbox refuses to reach into Python internals.
    with pytest.raises(ConfigError, match="rendering failed"):
        render_chat(
            "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
            [{"role": "user", "content": "x"}],
        )
