"""The rotation table of a hub repository's ``README.md`` (model card): one row per model and tag."""

from __future__ import annotations

import re
from typing import Mapping

from ..registry import SIDES

#: Marker comments that delimit the rotation table in a repository's ``README.md``.
CARD_BEGIN = "<!-- rotationzoo:table:begin -->"
CARD_END = "<!-- rotationzoo:table:end -->"
CARD_HEADER = (
    "| model | tag | layers × d | objectives (K / V) | files | sha256 (K / V) |\n"
    "|---|---|---|---|---|---|\n"
)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row_key(line: str) -> tuple[str, str] | None:
    if not line.lstrip().startswith("|"):
        return None
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())]
    if len(cells) < 4:
        return None
    return cells[1], cells[2]


def card_row(model_folder: str, tag: str, layers: int, head_dim: int, objectives: Mapping[str, str],
             files: Mapping[str, tuple[str, str]]) -> str:
    """One table row (no newline); ``files`` maps ``k``/``v`` to ``(repo path, sha256)``."""
    links = " · ".join(f"[{s.upper()}]({files[s][0]})" for s in SIDES)
    shas = " / ".join(f"`{files[s][1][:12]}`" for s in SIDES)
    cells = [model_folder, tag, f"{layers} × {head_dim}", f"{objectives['k']} / {objectives['v']}", links, shas]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def update_model_card(text: str, key: tuple[str, str], row: str, *, title: str = "") -> tuple[str, str]:
    """``README.md`` text with the row for ``key`` (model folder, tag) added or replaced.

    Only the table between :data:`CARD_BEGIN` and :data:`CARD_END` is touched, and in it only the
    row whose first two cells are ``key``; every other byte stays as it was. Without the markers,
    a section holding them is appended (or a new card is written when ``text`` is empty).

    Returns:
        ``(new text, what happened)`` where what happened is ``"created"``, ``"section added"``,
        ``"row added"`` or ``"row replaced"``.
    """
    begin = text.find(CARD_BEGIN)
    end = text.find(CARD_END, begin + len(CARD_BEGIN)) if begin >= 0 else -1
    if begin < 0 or end < 0:
        section = f"## Rotations\n\n{CARD_BEGIN}\n{CARD_HEADER}{row}\n{CARD_END}\n"
        if not text.strip():
            front = "---\ntags:\n- rotationzoo\n- kv-cache-quantization\n---\n\n"
            intro = (f"# {title}\n\n" if title else "") + (
                "OSCAR rotations for 2-bit (INT2) KV caches: one orthogonal matrix per attention layer for "
                "the keys and one for the values. Load them with "
                "[rotationzoo](https://pypi.org/project/rotationzoo/): `rotationzoo.load(MODEL, TAG)`.\n\n"
            )
            return front + intro + section, "created"
        sep = "\n" if text.endswith("\n") else "\n\n"
        return text + sep + section, "section added"
    head, inner, tail = text[: begin + len(CARD_BEGIN)], text[begin + len(CARD_BEGIN): end], text[end:]
    lines = inner.splitlines(keepends=True)
    out: list[str] = []
    replaced = False
    for line in lines:
        if _row_key(line) == key and not set(line.strip()) <= set("|-: "):
            if not replaced:
                ending = line[len(line.rstrip("\r\n")):] or "\n"
                out.append(row + ending)
                replaced = True
            continue  # a duplicate row of the same entry is dropped
        out.append(line)
    if replaced:
        return head + "".join(out) + tail, "row replaced"
    body = "".join(out)
    if not body.endswith("\n"):
        body += "\n"
    if not any(line.lstrip().startswith("|") for line in out):
        body += CARD_HEADER
    return head + body + row + "\n" + tail, "row added"
