"""`GET /metrics`: engine and expert-cache counters in the Prometheus text format (0.0.4).

Engine counters come from `engine.Counters`; cache hit rate per tier, SSD bytes read and
prefetch coverage from the streaming provider's `stats()` (absent with resident experts).
Prefetch coverage = speculative reads later used / (those + demand reads): the share of needed
records the lookahead had already asked for.
"""

from __future__ import annotations


def _lines(name: str, kind: str, help_: str, samples) -> list[str]:
    out = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{name}{lab} {float(value):.6g}" if isinstance(value, float)
                   else f"{name}{lab} {value}")
    return out


def metrics_text(engine) -> str:
    c = engine.counters
    rows = [
        ("mtplx_requests_total", "counter", "generations started", c.requests),
        ("mtplx_requests_cancelled_total", "counter",
         "generations stopped or skipped because the client went away", c.cancelled),
        ("mtplx_requests_failed_total", "counter", "generations that raised", c.failed),
        ("mtplx_prompt_tokens_total", "counter", "prompt tokens prefilled", c.prompt_tokens),
        ("mtplx_generated_tokens_total", "counter", "tokens generated", c.generated_tokens),
        ("mtplx_prefill_seconds_total", "counter", "model time in prefill", c.prefill_s),
        ("mtplx_decode_seconds_total", "counter", "model time in decode", c.decode_s),
        ("mtplx_decode_tokens_per_second", "gauge", "decode tok/s over all requests",
         c.decode_forwards / c.decode_s if c.decode_s else 0.0),
        ("mtplx_last_decode_tokens_per_second", "gauge", "decode tok/s of the last request",
         c.last_decode_tok_s),
        ("mtplx_last_prefill_tokens_per_second", "gauge", "prefill tok/s of the last request",
         c.last_prefill_tok_s),
        ("mtplx_queue_depth", "gauge", "requests waiting for the engine", engine.depth),
        ("mtplx_requests_running", "gauge", "requests generating now",
         int(engine.running is not None)),
    ]
    out: list[str] = []
    for name, kind, help_, v in rows:
        out += _lines(name, kind, help_, [({}, v)])
    provider = engine.rt.provider
    if provider is not None:
        s = provider.stats()
        tiers = s["totals"]
        out += _lines("mtplx_cache_hit_rate", "gauge", "expert cache hits / lookups per tier",
                      [({"tier": t}, c_["hits"] / c_["lookups"] if c_["lookups"] else 0.0)
                       for t, c_ in tiers.items()])
        out += _lines("mtplx_cache_lookups_total", "counter", "expert cache lookups per tier",
                      [({"tier": t}, c_["lookups"]) for t, c_ in tiers.items()])
        out += _lines("mtplx_cache_hits_total", "counter", "expert cache hits per tier",
                      [({"tier": t}, c_["hits"]) for t, c_ in tiers.items()])
        pf = s["prefetch"]
        out += _lines("mtplx_ssd_bytes_read_total", "counter",
                      "expert record bytes read from disk (demand, speculative, warm start)",
                      [({"kind": "demand"}, pf["demand_bytes"]),
                       ({"kind": "speculative"}, pf["spec_bytes"]),
                       ({"kind": "warm"}, pf["warm_bytes"])])
        needed = pf["spec_used"] + pf["demand_reads"]
        out += _lines("mtplx_prefetch_coverage", "gauge",
                      "speculative reads used / (used speculative + demand reads)",
                      [({}, pf["spec_used"] / needed if needed else 0.0)])
        out += _lines("mtplx_expert_stall_seconds_total", "counter",
                      "time the model waited for expert reads", [({}, s["stall_ms"] / 1e3)])
    return "\n".join(out) + "\n"
