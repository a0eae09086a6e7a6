"""Prompts from JSONL and Parquet files: verl's columns, chat templates, clear errors for bad
rows, and the synthetic tasks' global order and exact resume."""

from __future__ import annotations

import json

import pytest

from nereus.config import from_dict
from nereus.data.filedata import FileTask, read_rows
from nereus.data.prompts import PromptDataset
from nereus.data.rewards import load_reward
from nereus.data.vocab import Codec
from nereus.errors import ConfigError
from nereus.job.config import DataConfig, JobConfig
from tests.data._files import gsm8k_rows, tiny_chat_model, write_jsonl, write_parquet


def _task(path, **data) -> FileTask:
    return FileTask.load(DataConfig(path=str(path), **data), load_reward("math"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_rows_read_in_verl_columns(tmp_path, fmt):
    rows = gsm8k_rows(12, seed=3)
    for r in rows:  # numbers are read as their text
        r["reward_model"]["ground_truth"] = int(r["reward_model"]["ground_truth"])
    rows[5]["reward_model"]["ground_truth"] = 11
    rows[5]["prompt"].insert(0, {"role": "system", "content": "Answer briefly."})
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"train.{fmt}", rows)
    task = _task(path)
    assert len(task) == 12
    assert task.rows[5].messages[0] == {"role": "system", "content": "Answer briefly."}
    assert task.rows[5].ground_truth == "11"
    assert task.rows[0].data_source == "openai/gsm8k" and task.rows[0].extra_info["index"] == 0
    s = task.sample(2, seed=0)
    assert (s.index, s.prompt, s.answer) == (
        2,
        rows[2]["prompt"][0]["content"],
        str(rows[2]["reward_model"]["ground_truth"]),
    )
    assert task.reward(s, f"So the answer is {s.answer}.") == 1.0
    assert task.reward(s, "I think 1000.") == 0.0


def test_chat_template_is_applied_like_transformers(tmp_path):
    from transformers import AutoTokenizer

    model, _ = tiny_chat_model(tmp_path / "model")
    codec = Codec.from_dir(model)
    hf = AutoTokenizer.from_pretrained(model)
    rows = gsm8k_rows(4) + gsm8k_rows(2, text_prompts=True)
    task = _task(write_jsonl(tmp_path / "t.jsonl", rows))
    for i, row in enumerate(rows):
        messages = (
            row["prompt"]
            if isinstance(row["prompt"], list)
            else [{"role": "user", "content": row["prompt"]}]
        )
        # The text transformers renders, tokenized by the folder's tokenizer.json (transformers 5
        # rebuilds this tiny BPE's pre-tokenizer with its own digit rule; SmolLM2's ids agree).
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        want = codec.tokenizer.encode(text, add_special_tokens=False).ids
        assert task.prompt_ids(task.sample(i, 0), codec) == want
    # A base model's text prompts go in as they are.
    raw = _task(
        write_jsonl(tmp_path / "raw.jsonl", gsm8k_rows(2, text_prompts=True)),
        apply_chat_template=False,
    )
    assert raw.prompt_ids(raw.sample(0, 0), codec) == codec.encode(
        gsm8k_rows(2, text_prompts=True)[0]["prompt"], raw=True
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: r.pop("prompt"), "row 3 column 'prompt': expected a prompt"),
        (lambda r: r.update(prompt=""), "row 3 column 'prompt': expected a non-empty string"),
        (
            lambda r: r.update(prompt=[{"role": "user"}]),
            "row 3 column 'prompt': expected chat messages with string 'role' and 'content'",
        ),
        (lambda r: r.update(prompt=7), "row 3 column 'prompt': expected chat messages or a string"),
        (
            lambda r: r.update(reward_model={"style": "rule"}),
            "row 3 column 'reward_model.ground_truth': expected a ground truth",
        ),
        (
            lambda r: r.update(reward_model={"ground_truth": ["1", "2"]}),
            "row 3 column 'reward_model.ground_truth': expected a string or a number",
        ),
        (lambda r: r.update(data_source=5), "row 3 column 'data_source': expected a string"),
        (lambda r: r.update(extra_info="x"), "row 3 column 'extra_info': expected a map"),
    ],
)
def test_bad_rows_name_the_file_row_and_column(tmp_path, change, words):
    rows = gsm8k_rows(6)
    change(rows[3])
    path = tmp_path / "bad.jsonl"
    # Written line by line: a column whose type changes between rows is still a JSONL file.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        _task(path)
    except ConfigError as e:
        assert str(path) in str(e) and words in str(e), str(e)
    else:
        pytest.fail(f"no error for {words}")


def test_unreadable_files_are_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(gsm8k_rows(1)[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"broken.jsonl.*line 2 is not valid JSON"):
        _task(path)
    with pytest.raises(ConfigError, match="data.path='.*missing.jsonl' is not a file"):
        _task(tmp_path / "missing.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="cannot tell the format from the suffix '.csv'"):
        _task(tmp_path / "rows.csv")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl"):
        _task(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match=r"data.path='' must name"):
        DataConfig()
    with pytest.raises(ConfigError, match="data.answer_key='reward_model.' must be a column name"):
        DataConfig(path="x.jsonl", answer_key="reward_model.")


def test_global_order_dp_split_and_resume_like_the_tasks(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(10))
    task = _task(path)
    a = PromptDataset(task, size=len(task), seed=3, fingerprint=task.fingerprint)
    first = (
        [s.index for s in a.take(4)] + [s.index for s in a.take(4)] + [s.index for s in a.take(4)]
    )
    assert sorted(first[:10]) == list(range(10))  # one epoch visits every row once
    assert first[:10] != list(range(10))  # shuffled by the seed
    # DP ranks take every d-th sample of the same global batch, whatever d is.
    b = PromptDataset(task, size=len(task), seed=3)
    b.take(4)
    whole = [s.index for s in b.global_batch(4)]
    for d in (1, 2, 4):
        parts = [[s.index for s in b.global_batch(4, dp_rank=r, dp_size=d)] for r in range(d)]
        assert sorted(sum(parts, [])) == sorted(whole)
    # Resume: the saved position gives the same next samples.
    c = PromptDataset(task, size=len(task), seed=3, fingerprint=task.fingerprint)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    d = PromptDataset(task, size=len(task), seed=3)
    d.position = a.position
    assert [s.index for s in c.take(5)] == [s.index for s in d.take(5)]
    # The same position in a changed file would be other samples: refused.
    rows = gsm8k_rows(10)
    rows[0]["reward_model"]["ground_truth"] = "99"
    changed = _task(write_jsonl(tmp_path / "train.jsonl", rows))
    assert changed.fingerprint != task.fingerprint
    e = PromptDataset(changed, size=len(changed), seed=3, fingerprint=changed.fingerprint)
    with pytest.raises(ConfigError, match="the data file changed"):
        e.load_state_dict(a.state_dict())
    unshuffled = PromptDataset(task, size=len(task), seed=3, shuffle=False)
    assert [s.index for s in unshuffled.take(10)] == list(range(10))


def test_max_samples_and_custom_columns(tmp_path):
    rows = [
        {
            "question": {"text": r["prompt"][0]["content"]},
            "answer": r["reward_model"]["ground_truth"],
        }
        for r in gsm8k_rows(8)
    ]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    rows_read, _ = read_rows(
        DataConfig(path=str(path), prompt_key="question.text", answer_key="answer", max_samples=5)
    )
    assert (
        len(rows_read) == 5
        and rows_read[4].text == rows[4]["question"]["text"]
        and rows_read[4].ground_truth == rows[4]["answer"]
    )


def test_job_config_with_data(tmp_path):
    base = {
        "model": {"kind": "hf", "path": str(tmp_path)},
        "data": {"path": "train.jsonl"},
        "reward": {"rule": "math"},
        "cluster": {"mode": "in_process"},
        "plan": {"policy_generation": {"devices": [0]}, "policy_training": {"devices": [0]}},
    }
    cfg = from_dict(JobConfig, base)
    assert cfg.data.path == "train.jsonl" and cfg.data.answer_key == "reward_model.ground_truth"
    with pytest.raises(
        ConfigError,
        match="reward.rule='task' must be 'math', 'exact' or 'module:function' with \\[data\\]",
    ):
        from_dict(JobConfig, {**base, "reward": {}})
    with pytest.raises(ConfigError, match="task=.* must be left out when \\[data\\] is given"):
        from_dict(JobConfig, {**base, "task": {"name": "arithmetic"}})
    with pytest.raises(
        ConfigError, match="model.kind='tiny' must be 'hf' or 'smollm2' with \\[data\\]"
    ):
        from_dict(JobConfig, {**base, "model": {"kind": "tiny"}})
    with pytest.raises(ConfigError, match="data: unknown key\\(s\\) \\['file'\\]"):
        from_dict(JobConfig, {**base, "data": {"file": "x"}})
    with pytest.raises(ConfigError, match="reward.rule='math' must be 'task' for a synthetic task"):
        from_dict(JobConfig, {k: v for k, v in base.items() if k != "data"})
