"""The figures of a multi-request workload (``workloads.run_workload``): per inferlet, summed over its requests.

decode tok/s        tokens after the first / decode seconds, both summed over requests (each run's decode
                    seconds: its tokens over its decode rate)
tokens per forward  decode tokens over forwards (verify rounds + plain steps): 1 for text-completion
acceptance          drafts kept over drafts proposed, overall and per draft position (summed counters)
ratios              decode tok/s of each over the reference's (text-completion) and suffix over cacheback
store bytes / 1,000 requests: a SuffixIndex holding the suffix runs' outputs, measured with tracemalloc
"""

from __future__ import annotations

import tracemalloc
from typing import Any

from pie_runtime.protocol.spec_counters import SpecCounters


def summarize(results: list[dict]) -> dict[str, Any]:
    """One inferlet's figures over its requests' results."""
    counters = SpecCounters()
    tokens = decode_tokens = forwards = 0
    seconds = 0.0
    for r in results:
        s = r["stats"]
        n = len(r["token_ids"])
        tokens += n
        rate = s.get("decode_tokens_per_s") or 0.0
        if rate and n > 1:
            decode_tokens += n - 1
            seconds += (n - 1) / rate
        spec = r.get("speculation")
        if spec:  # a speculative run's counters (SpecStats.summary)
            counters.merge(SpecCounters(**{k: spec[k] for k in SpecCounters.names() if k in spec}))
            forwards += spec["rounds"] + sum(spec.get("skipped", {}).values())
        else:
            forwards += max(n - 1, 0)
    figures = counters.figures()
    return {
        "requests": len(results),
        "tokens": tokens,
        "decode_tokens_per_s": round(decode_tokens / seconds, 2) if seconds else 0.0,
        "tokens_per_forward": round(decode_tokens / forwards, 3) if forwards else 1.0,
        "rounds": counters.rounds,
        "acceptance": round(figures["acceptance"], 3),
        "acceptance_per_position": [round(a, 3) for a in figures["acceptance_per_position"]],
        "tree_rounds": counters.tree_rounds,
    }


def compare(by_label: dict[str, list[dict]], reference: str = "text-completion") -> dict[str, Any]:
    """Every inferlet's figures, its ratio to the reference, whether its greedy tokens equal the reference's
    request by request, and suffix over cacheback when both ran."""
    out: dict[str, Any] = {label: summarize(rs) for label, rs in by_label.items()}
    base = out[reference]["decode_tokens_per_s"]
    for label, rs in by_label.items():
        out[label]["ratio_to_text_completion"] = round(out[label]["decode_tokens_per_s"] / base, 3) if base else None
        same = [a["token_ids"] == b["token_ids"] for a, b in zip(rs, by_label[reference], strict=True)]
        out[label]["greedy_match"] = f"{sum(same)}/{len(same)}"
    if "suffix" in out and "cacheback" in out and out["cacheback"]["decode_tokens_per_s"]:
        out["suffix"]["ratio_to_cacheback"] = round(
            out["suffix"]["decode_tokens_per_s"] / out["cacheback"]["decode_tokens_per_s"], 3
        )
    return out


def store_bytes_per_1000(outputs: list[list[int]], min_match: int = 2) -> dict[str, float]:
    """The memory a suffix store of these outputs takes (tracemalloc, Python objects and arrays), scaled to
    1,000 requests of the same lengths; also per token."""
    from inferlet.spec.suffix_index import SuffixIndex

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex(min_match)
        for ids in outputs:
            index.add(ids)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    n = max(len(outputs), 1)
    return {
        "requests": len(outputs),
        "tokens": index.tokens,
        "bytes_per_token": round(used / max(index.tokens, 1), 1),
        "mib_per_1000_requests": round(used / n * 1000 / 2**20, 2),
    }
