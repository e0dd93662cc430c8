"""A worker's Prometheus metrics, rendered by hand in the text format (no global registry)."""

from __future__ import annotations

from dataclasses import dataclass, field

_TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class WorkerMetrics:
    requests: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_token_buckets: list[int] = field(default_factory=lambda: [0] * len(_TTFT_BUCKETS_S))
    first_token_count: int = 0
    first_token_sum_s: float = 0.0

    def observe_first_token(self, seconds: float) -> None:
        self.first_token_count += 1
        self.first_token_sum_s += seconds
        for i, bound in enumerate(_TTFT_BUCKETS_S):
            if seconds <= bound:
                self.first_token_buckets[i] += 1

    def render(self, load: dict, kv: dict) -> str:
        lines = [
            "# HELP mooncake_worker_requests_total Requests finished by this worker, by outcome.",
            "# TYPE mooncake_worker_requests_total counter",
        ]
        lines += [f'mooncake_worker_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        lines += [
            "# HELP mooncake_worker_prompt_tokens_total Prompt tokens received (tokens).",
            "# TYPE mooncake_worker_prompt_tokens_total counter",
            f"mooncake_worker_prompt_tokens_total {self.prompt_tokens}",
            "# HELP mooncake_worker_generated_tokens_total Tokens generated (tokens).",
            "# TYPE mooncake_worker_generated_tokens_total counter",
            f"mooncake_worker_generated_tokens_total {self.generated_tokens}",
            "# HELP mooncake_worker_running_requests Requests in the engine now.",
            "# TYPE mooncake_worker_running_requests gauge",
            f"mooncake_worker_running_requests {load['running_requests']}",
            "# HELP mooncake_worker_queued_prefill_tokens Prompt tokens not yet prefilled (tokens).",
            "# TYPE mooncake_worker_queued_prefill_tokens gauge",
            f"mooncake_worker_queued_prefill_tokens {load['queued_prefill_tokens']}",
            "# HELP mooncake_worker_first_token_seconds Time from arrival to first token here (seconds).",
            "# TYPE mooncake_worker_first_token_seconds histogram",
        ]
        for bound, count in zip(_TTFT_BUCKETS_S, self.first_token_buckets):
            lines.append(f'mooncake_worker_first_token_seconds_bucket{{le="{bound}"}} {count}')
        lines += [
            f'mooncake_worker_first_token_seconds_bucket{{le="+Inf"}} {self.first_token_count}',
            f"mooncake_worker_first_token_seconds_sum {self.first_token_sum_s:.6f}",
            f"mooncake_worker_first_token_seconds_count {self.first_token_count}",
        ]
        units = {"bytes": "bytes", "seconds": "seconds"}
        for name, value in sorted(kv.items()):
            unit = next((u for k, u in units.items() if name.endswith(k)), "total")
            metric = f"mooncake_kv_{name}" if unit != "total" else f"mooncake_kv_{name}_total"
            if unit != "total":
                metric += "_total"
            lines += [f"# HELP {metric} KV connector counter {name} ({unit}).",
                      f"# TYPE {metric} counter", f"{metric} {value}"]
        return "\n".join(lines) + "\n"
