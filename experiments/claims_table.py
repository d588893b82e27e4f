"""The paper / fp4stack claims table both claim scripts print (quads_claims, fullstack_claims)."""

from __future__ import annotations

from typing import Any

_VERDICT = {True: "yes", False: "no", None: "-"}  # None: not measurable from these runs


def format_claims(table: list[dict[str, Any]]) -> str:
    """Markdown rows {claim, paper, here, holds} as | claim | paper | fp4stack | holds here |."""
    lines = ["| claim | paper | fp4stack | holds here |", "|---|---|---|---|"]
    lines += [f"| {c['claim']} | {c['paper']} | {c['here']} | {_VERDICT[c['holds']]} |"
              for c in table]
    return "\n".join(lines)
