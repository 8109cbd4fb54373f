"""Speculative-decoding acceptance in `deltaserve bench serve` results: acceptance per position from the server's
`spec_decode_num_accepted_tokens_per_pos{position="j"}` counter (scraped before and after the run), and vLLM's
"Speculative Decoding" section of the console table.

The totals (drafts, draft tokens, accepted tokens, acceptance length and rate) come from `endpoint.counter_metrics`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

_PER_POS = re.compile(r"^(?:[A-Za-z_]+:)?spec_decode_num_accepted_tokens_per_pos(?:_total)?\{([^}]*)\}\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def parse_accepted_per_pos(text: str) -> dict[int, float]:
    """Accepted tokens by draft position (summed over every other label) from a Prometheus text exposition."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        m = _PER_POS.match(line)
        pos = _POSITION.search(m.group(1)) if m else None
        if m and pos:
            j = int(pos.group(1))
            out[j] = out.get(j, 0.0) + float(m.group(2))
    return out


async def scrape_accepted_per_pos(client: httpx.AsyncClient, base_url: str,
                                  headers: dict[str, str]) -> dict[int, float]:
    """`parse_accepted_per_pos` of GET /metrics (empty when the server has none)."""
    import httpx

    try:
        resp = await client.get(f"{base_url}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return {}
    return parse_accepted_per_pos(resp.text) if resp.status_code == 200 else {}


def per_position_rates(before: dict[int, float], after: dict[int, float], drafts: int) -> list[float]:
    """vLLM's `spec_decode_per_position_acceptance_rates`: accepted at position j during the run / drafts."""
    if not drafts:
        return []
    return [(after[j] - before.get(j, 0.0)) / drafts for j in range(len(after)) if j in after]


def spec_decode_section(result: dict[str, Any]) -> str:
    """vLLM's "Speculative Decoding" console lines, or "" when the run verified no draft."""
    if not result.get("spec_decode_num_drafts"):
        return ""
    lines = ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {value:<10}")

    rate = result.get("spec_decode_acceptance_rate")
    row("Acceptance rate (%):", "n/a" if rate is None else f"{rate:.2f}")
    row("Acceptance length:", f"{result['spec_decode_acceptance_length']:.2f}")
    row("Drafts:", result["spec_decode_num_drafts"])
    row("Draft tokens:", result["spec_decode_draft_tokens"])
    row("Accepted tokens:", result["spec_decode_accepted_tokens"])
    rates = result.get("spec_decode_per_position_acceptance_rates") or []
    if rates:
        lines.append("Per-position acceptance (%):")
        for j, r in enumerate(rates):
            row(f"  Position {j}:", f"{100 * r:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
