"""The server's own speculative-decoding counters, read from its Prometheus /metrics before and after a run
(as vLLM users read `vllm:spec_decode_*`): whatever the prefix (`vllm:`, ours `lab:`), every
`<prefix>:spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total` and
`_num_accepted_tokens_per_pos_total{position}` sample is summed (over models, engines, replicas).

Owns: fetching and parsing the exposition. Ignores: what the counts mean (lab/spec/counters.py).
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from lab.spec.counters import SpecCounters

TOTALS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
          "spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The summed counters in a Prometheus text exposition; None when it has none (no speculation, or not
    exported) or cannot be parsed."""
    totals = dict.fromkeys(TOTALS.values(), 0)
    per_position: dict[int, int] = {}
    found = False
    try:
        for family in text_string_to_metric_families(text):
            name = family.name.rsplit(":", 1)[-1]
            if name not in TOTALS and name != PER_POSITION:
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue   # NOTE: `_created` timestamps
                found = True
                if name == PER_POSITION:
                    position = int(sample.labels.get("position", 0))
                    per_position[position] = per_position.get(position, 0) + int(sample.value)
                else:
                    totals[TOTALS[name]] += int(sample.value)
    except ValueError:   # NOTE: not Prometheus text (another service on that path)
        return None
    if not found:
        return None
    positions = tuple(per_position.get(p, 0) for p in range(max(per_position, default=-1) + 1))
    return SpecCounters(totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"], positions)


async def read_spec_counters(session: aiohttp.ClientSession, url: str) -> SpecCounters | None:
    """GET `url` and parse it; None when the server has no such endpoint or exports no speculative counters."""
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return None
            return parse_spec_counters(await response.text())
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
