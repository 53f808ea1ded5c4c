"""Prompt sources and chat templating (distill/data.py). Offline; the hub is a monkeypatched stub."""
from __future__ import annotations

import json
import os

import datasets
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from distill import data
from distill.config import ConfigError, DataConfig
from distill.data import (
    PromptTooLong,
    check_prompt_length,
    encode_prompt,
    load_prompts,
    prompt_token_limit,
    render_prompt,
)
from specdec.tiny import tiny_tokenizer

CONF = os.path.join(os.path.dirname(__file__), "..", "conf")
ROWS = [
    {"q": "What is 2 + 2?", "key": "a", "chat": [{"role": "user", "content": "Hi there"}]},
    {
        "q": "Name a prime.",
        "key": "b",
        "chat": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "Later turn"},
        ],
    },
    {"q": "", "key": "c", "chat": [{"role": "assistant", "content": "no user turn"}]},
]


def _ids_unique(ds: datasets.Dataset) -> bool:
    return len(set(ds["id"])) == len(ds)


def _check_schema(ds: datasets.Dataset, source: str) -> None:
    assert ds.column_names == ["id", "source", "messages", "category"]
    assert set(ds["source"]) == {source} and _ids_unique(ds)
    for msgs in ds["messages"]:
        assert msgs[-1]["role"] == "user" and msgs[-1]["content"].strip()


# ---------------------------------------------------------------- built-in sources


def test_mt_bench():
    ds = load_prompts(DataConfig(source="mt_bench"))
    _check_schema(ds, "mt_bench")
    assert len(ds) == 80 and ds[0]["id"] == "mt_bench-81"
    categories = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert set(ds["category"]) == categories
    assert all(len(m) == 1 for m in ds["messages"])  # first turn only


def test_humaneval():
    ds = load_prompts(DataConfig(source="humaneval"))
    _check_schema(ds, "humaneval")
    assert len(ds) == 164 and ds[0]["id"] == "humaneval-0" and set(ds["category"]) == {"humaneval"}
    assert "def has_close_elements(" in ds[0]["messages"][0]["content"]


def test_stdlib_is_large_deterministic_and_disjoint_from_eval_sets():
    ds = load_prompts(DataConfig(source="stdlib"))
    _check_schema(ds, "stdlib")
    assert len(ds) >= 2000 and set(ds["category"]) == {"function", "topic"}
    data._stdlib_rows.cache_clear()  # rebuild from the source files: same rows, same order
    again = load_prompts(DataConfig(source="stdlib"))
    assert again["id"] == ds["id"] and again["messages"] == ds["messages"]
    texts = {m[-1]["content"] for m in ds["messages"]}
    for name in ("mt_bench", "humaneval"):
        assert not texts & {m[-1]["content"] for m in load_prompts(DataConfig(source=name))["messages"]}
    entry_points = {p["entry_point"] for p in data._humaneval_problems()}
    functions = [i.rsplit(".", 1)[-1] for i, c in zip(ds["id"], ds["category"]) if c == "function"]
    assert not set(functions) & entry_points
    assert max(len(t) for t in texts) < 2000  # docstrings and topic texts are trimmed
    assert "stdlib-json.dumps" in ds["id"] and "stdlib-topic.assert" in ds["id"]


def test_limit_shuffle_seed_and_system_prompt():
    base = load_prompts(DataConfig(source="mt_bench"))
    assert load_prompts(DataConfig(source="mt_bench", limit=5))["id"] == base["id"][:5]
    a = load_prompts(DataConfig(source="mt_bench", shuffle=True, seed=1, limit=10))
    assert a["id"] == load_prompts(DataConfig(source="mt_bench", shuffle=True, seed=1, limit=10))["id"]
    assert a["id"] != base["id"][:10] and set(a["id"]) < set(base["id"])
    assert a["id"] != load_prompts(DataConfig(source="mt_bench", shuffle=True, seed=2, limit=10))["id"]
    sys_ds = load_prompts(DataConfig(source="mt_bench", system_prompt="You are terse.", limit=2))
    assert sys_ds["messages"][0][0] == {"role": "system", "content": "You are terse."}
    assert sys_ds["messages"][0][1] == base["messages"][0][0]


def test_skip_gives_the_prompts_a_limit_leaves_out():
    held = list(load_prompts(DataConfig(source="humaneval", shuffle=True, seed=0, limit=48))["id"])
    rest = list(load_prompts(DataConfig(source="humaneval", shuffle=True, seed=0, skip=48))["id"])
    everything = list(load_prompts(DataConfig(source="humaneval", shuffle=True, seed=0))["id"])
    assert len(held) == 48 and len(rest) == 164 - 48
    assert held + rest == everything and not set(held) & set(rest)
    assert list(load_prompts(DataConfig(source="humaneval", shuffle=True, seed=0, skip=48, limit=5))["id"]) == rest[:5]


def test_accepts_a_composed_hydra_config_for_every_preset(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n")
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        for preset in ("stdlib", "mt_bench", "humaneval", "jsonl", "hub"):
            extra = [f"data.path={path}"] if preset == "jsonl" else []
            cfg = compose("generate", overrides=[f"data={preset}", *extra]).data
            assert isinstance(OmegaConf.to_object(cfg), DataConfig)
            if preset != "hub":  # hub needs a network
                assert len(load_prompts(cfg)) >= 1


# ---------------------------------------------------------------- user sources


def _write(tmp_path, ext: str, rows=ROWS, stem: str = "prompts") -> str:
    path = str(tmp_path / f"{stem}{ext}")
    if ext == ".jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif ext == ".json":
        with open(path, "w") as f:
            json.dump(rows, f)
    else:
        datasets.Dataset.from_list(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet"])
def test_file_prompt_column(tmp_path, ext):
    ds = load_prompts(DataConfig(source="file", path=_write(tmp_path, ext), prompt_column="q"))
    _check_schema(ds, "file")
    assert ds["id"] == ["file-0", "file-1"]  # the empty prompt (row 2) is dropped, ids keep row numbers
    assert ds["messages"][0] == [{"role": "user", "content": "What is 2 + 2?"}] and ds["category"] == ["", ""]


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_file_messages_column_keeps_system_and_first_user_turn(tmp_path, ext):
    ds = load_prompts(DataConfig(source="file", path=_write(tmp_path, ext), messages_column="chat", id_column="key"))
    assert ds["id"] == ["file-a", "file-b"]
    assert ds["messages"][1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    cfg = DataConfig(source="file", path=_write(tmp_path, ext), messages_column="chat", system_prompt="New.")
    replaced = load_prompts(cfg)
    assert replaced["messages"][1] == [{"role": "system", "content": "New."}, {"role": "user", "content": "Why?"}]


def test_hub_calls_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(source="hub", path="org/chat", name="v1", split="train_sft", messages_column="chat", limit=1)
    ds = load_prompts(cfg)
    assert calls == [("org/chat", "v1", "train_sft")]
    assert ds["id"] == ["hub-0"] and ds["source"] == ["hub"] and ds["messages"][0][0]["content"] == "Hi there"

    def offline(*args, **kw):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match="could not load hub dataset data.path='org/chat'.*no network"):
        load_prompts(cfg)
    assert "needs data.path" in _error(DataConfig(source="hub"))


# ---------------------------------------------------------------- bad input


def _error(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as e:
        load_prompts(cfg)
    return str(e.value)


def test_bad_inputs_name_the_fix(tmp_path, monkeypatch):
    good = _write(tmp_path, ".jsonl")
    assert "one of" in _error(DataConfig(source="nope")) and "mt_bench" in _error(DataConfig(source="nope"))
    assert "no such file" in _error(DataConfig(source="file", path=str(tmp_path / "missing.jsonl")))
    assert "needs data.path" in _error(DataConfig(source="file"))
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    msg = _error(DataConfig(source="file", path=str(tmp_path / "p.csv")))
    assert "unsupported file type '.csv'" in msg and ".parquet" in msg
    msg = _error(DataConfig(source="file", path=good, prompt_column="question"))
    assert "data.prompt_column='question'" in msg and "['q', 'key', 'chat']" in msg
    assert "data.messages_column='turns'" in _error(DataConfig(source="file", path=good, messages_column="turns"))
    assert "data.id_column='uid'" in _error(DataConfig(source="file", path=good, prompt_column="q", id_column="uid"))
    assert "not a list of {role, content} turns" in _error(DataConfig(source="file", path=good, messages_column="q"))
    dup = _write(tmp_path, ".json", [{"q": "x", "k": 1}, {"q": "y", "k": 1}], stem="dup")
    assert "unique column" in _error(DataConfig(source="file", path=dup, prompt_column="q", id_column="k"))
    empty = _write(tmp_path, ".json", [{"q": ""}, {"q": "   "}], stem="empty")
    assert "gave no prompts" in _error(DataConfig(source="file", path=empty, prompt_column="q"))
    assert "data.limit=0 must be >= 1" in _error(DataConfig(source="mt_bench", limit=0))
    assert "data.skip=-1 must be >= 0" in _error(DataConfig(source="mt_bench", skip=-1))
    assert "drops all 80 prompts" in _error(DataConfig(source="mt_bench", skip=80))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert "could not be read as jsonl" in _error(DataConfig(source="file", path=str(bad)))
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    data._mt_bench_rows.cache_clear()
    try:
        assert "scripts/setup.sh" in _error(DataConfig(source="mt_bench"))
    finally:
        monkeypatch.undo()
        data._mt_bench_rows.cache_clear()


# ---------------------------------------------------------------- chat templating


def test_encode_prompt_uses_the_chat_template():
    tok = tiny_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    ids = encode_prompt(tok, msgs)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, msgs) == text
    assert tok.decode(ids) == text and ids == tok.encode(text, add_special_tokens=False)


def test_encode_prompt_without_chat_template_falls_back_to_a_transcript():
    tok = tiny_tokenizer()
    tok.chat_template = None
    ids = encode_prompt(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == render_prompt(tok, [{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_fallback_warns_once_naming_the_option(caplog):
    tok = tiny_tokenizer()
    tok.chat_template = None
    tok.name_or_path = "base-model-without-template"
    with caplog.at_level("WARNING", logger="distill.templates"):
        for text in ("hi", "again", "and again"):
            encode_prompt(tok, [{"role": "user", "content": text}])
            render_prompt(tok, [{"role": "user", "content": text}])
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "data.template" in warnings[0].getMessage()
    assert "base-model-without-template" in warnings[0].getMessage()


@pytest.mark.parametrize("chat", [True, False], ids=["tokenizer-with-template", "without"])
def test_plain_template_formats_the_user_text_for_any_tokenizer(chat):
    tok = tiny_tokenizer()
    if not chat:
        tok.chat_template = None
    fmt = "Question: {prompt}\nAnswer:"
    msgs = [{"role": "user", "content": "héllo {x}"}]  # braces in the prompt are text, not fields
    text = "Question: héllo {x}\nAnswer:"
    assert render_prompt(tok, msgs, fmt) == text
    assert encode_prompt(tok, msgs, template=fmt) == tok.encode(text)
    # a shell passes "\n" as two characters: the same prompt
    assert encode_prompt(tok, msgs, template="Question: {prompt}\\nAnswer:") == tok.encode(text)
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert render_prompt(tok, sys_msgs, "{system}\n\n" + fmt) == "Be brief.\n\n" + text
    with pytest.raises(ConfigError, match="no {system} field"):
        render_prompt(tok, sys_msgs, fmt)
    with pytest.raises(ConfigError, match="formats one user turn"):
        encode_prompt(tok, [*msgs, {"role": "assistant", "content": "a"}, *msgs], template=fmt)
    assert render_prompt(tok, msgs, "chat") == render_prompt(tok, msgs, None)  # null means chat


def test_template_problems_name_the_fix():
    from distill.templates import template_problem

    assert template_problem("chat") is None and template_problem(None) is None
    assert template_problem("Q: {prompt}\nA:") is None and template_problem("{system} {prompt}") is None
    assert "has the fields ['question']" in template_problem("Question: {question}")
    assert "no {prompt} field" in template_problem("Answer:")
    assert "literal brace" in template_problem("{prompt} {")
    assert "only {prompt} and {system}" in template_problem("{prompt} {answer}")


def test_id_list_normalisation():
    import torch

    assert data._as_id_list({"input_ids": [1, 2], "attention_mask": [1, 1]}) == [1, 2]
    assert data._as_id_list(torch.tensor([[3, 4]])) == [3, 4]
    assert data._as_id_list([[5, 6]]) == [5, 6]


def test_prompt_length_checks():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "x" * 100}]
    n = len(encode_prompt(tok, msgs))
    assert len(encode_prompt(tok, msgs, max_prompt_tokens=n)) == n
    with pytest.raises(PromptTooLong) as e:
        encode_prompt(tok, msgs, max_prompt_tokens=n - 1)
    assert (e.value.num_tokens, e.value.limit, len(e.value.ids)) == (n, n - 1, n)
    assert isinstance(e.value, ConfigError) and "generate.max_prompt_tokens" in str(e.value)
    with pytest.raises(PromptTooLong, match="prompt 'p7'"):
        check_prompt_length([0] * 5, 4, prompt_id="p7")

    class Cfg:
        max_position_embeddings = 512

    assert prompt_token_limit(1024, Cfg(), max_new_tokens=128) == 384  # the model's context wins
    assert prompt_token_limit(100, Cfg(), max_new_tokens=128) == 100
    assert prompt_token_limit(100) == 100
    with pytest.raises(ConfigError, match="lower generate.max_new_tokens"):
        prompt_token_limit(100, Cfg(), max_new_tokens=512)
