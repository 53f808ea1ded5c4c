"""How numbers, rows and tables look wherever the project shows them: report.md, the terminal summary,
results.md, comparison.md and the model card (distill/report.py, pipeline.py, sweep.py, card.py).

    num(0.6234, 3) -> "0.623"; ci_cell(0.62, [0.58, 0.66]) -> "0.62 [0.58–0.66]"; shown(row, "speedup")
    label("prompt_lookup") -> "prompt lookup (no draft)"; markdown(headers, cells); text(headers, cells)
"""
from __future__ import annotations

from typing import Any, Optional

# report row name -> label, in the order tables list them (a trained draft not named here sits after init)
LABELS = {"target": "target alone", "init": "undistilled draft (init)", "best": "distilled draft (best)",
          "head": "feature head (EAGLE-3)", "hf_assisted": "HF assisted generation",
          "prompt_lookup": "prompt lookup (no draft)", "hybrid": "hybrid (prompt lookup + draft)",
          "hybrid_head": "hybrid (prompt lookup + head)"}
ORDER = {"target": 0, "init": 1, "hf_assisted": 3, "prompt_lookup": 4, "hybrid": 5, "hybrid_head": 6}  # trained drafts: 2


def num(x: Any, digits: int = 2, suffix: str = "") -> str:
    """A number for a table: fixed digits, "–" for missing or NaN."""
    return "–" if not isinstance(x, (int, float)) or x != x else f"{x:.{digits}f}{suffix}"


def ci_cell(x: Any, ci: Any, digits: int = 2, suffix: str = "") -> str:
    """A number with its 95% interval: "0.62 [0.58–0.66]" ("–" when missing)."""
    if not isinstance(x, (int, float)):
        return "–"
    return num(x, digits, suffix) + (f" [{num(ci[0], digits)}–{num(ci[1], digits)}]" if ci else "")


def shown(row: dict, key: str, digits: int = 2) -> str:
    """A speedup cell: the number with its interval, or "n.s." when the doctor flagged it."""
    if key in (row.get("flagged") or {}):
        return "n.s."
    return ci_cell(row.get(key), row.get(f"{key}_ci"), digits, "×")


def sampling(temperature: Any, top_p: Any = 1.0, draft_sampled: bool = False) -> str:
    """"greedy", or "T=1, top-p 0.9" (+ ", draft sampled")."""
    if not temperature:
        return "greedy"
    return (f"T={temperature:g}" + (f", top-p {top_p:g}" if top_p not in (None, 1, 1.0) else "")
            + (", draft sampled" if draft_sampled else ""))


def label(name: str, assistant: Optional[str] = None) -> str:
    """A row's label: the reference kinds by name, any other draft as "distilled draft (<name>)"."""
    out = LABELS.get(name) or f"distilled draft ({name})"
    return f"{out} ({assistant})" if name == "hf_assisted" and assistant else out


def order(name: str) -> int:
    return ORDER.get(name, 2)


def markdown(headers: list[str], cells: list[list[str]]) -> str:
    """A markdown table, padded so that it aligns in a terminal too."""
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    line = lambda cs: "| " + " | ".join(c.ljust(w) for c, w in zip(cs, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(c) for c in cells])


def text(headers: list[str], cells: list[list[str]]) -> str:
    """A plain aligned table for the terminal."""
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    fmt = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(c) for c in cells])
