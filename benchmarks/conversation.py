"""Multi-turn conversations through `mooncake serve` (1 prefill + 1 decode worker): what the live
conductor's remote fetches (Algorithm 1's fetch_from, on by default) buy the next turn, against
the same cluster with `--no-remote-fetch` (issue #14).

    flock /tmp/heavy.lock timeout 1800 .venv/bin/python -m benchmarks.conversation

Why it can help: the decode worker saves the blocks of the answer it generated in its KVCache
pool, while the prefill worker holds only the prompts it computed. The next turn's prompt is the
previous one, its answer and a new question, so the prefill worker either computes the answer's
tokens again or fetches their KV from the decode worker's pool.

The conversations are built first with one stock vLLM server (greedy, `return_token_ids`), which
then stops: every system is sent the same token ids, turn by turn. vLLM answered each turn with the
earlier ones in its own prefix cache, answers included (their KV computed while decoding), as a
colocated server does in a conversation; each system's text is checked against it. (In bf16 a
block's KV computed in a prefill and in a decode step differ in their last bits, so a system that
recomputes an answer's tokens in a prefill may pick another token at a near tie.) Both clusters then run at once and take turns: each
turn goes to one system and then the other, the order alternating, so the machine's noise falls
on both. TTFT is the official `openai` client's first streamed chunk; the prompt tokens served
from a cache and the conductor's fetch counters are read back. Prints per turn the median TTFT of
each system and their ratio, and a JSON summary (benchmarks/out/conversation.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.goodput import routes_from_metrics
from benchmarks.servers import MODEL_NAME, colocated_vllm, mooncake_cluster

SYSTEMS = {"fetch": [], "no-fetch": ["--no-remote-fetch"], "fetch-any": ["--balancing-threshold", "1"]}
"""Each system's `mooncake serve` options beyond the shared ones. fetch-any: a fetch whenever
another worker holds a longer prefix and fetching is predicted faster (Algorithm 1's threshold
at 1, against the default 1.5)."""


def build_conversations(api: str, count: int, turns: int, question: int, answer: int,
                        seed: int) -> list[list[tuple[list[int], str]]]:
    """count conversations of `turns` (prompt token ids, stock vLLM's answer text): each prompt is
    the previous one, the greedy answer stock vLLM gave it, and a new question of random ordinary
    tokens. vLLM answers a turn with the earlier turns in its own prefix cache, answers included,
    as a colocated server does in a conversation: its text is the reference for that turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(1000, 40000) for _ in range(question)]
        conv = []
        while len(conv) < turns:
            resp = httpx.post(api + "/completions", timeout=600, json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": answer, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            conv.append((prompt, choice["text"]))
            prompt = prompt + choice["token_ids"] + [rng.randrange(1000, 40000) for _ in range(question)]
        out.append(conv)
    return out


def one_turn(client: openai.OpenAI, prompt: list[int], answer: int) -> dict:
    """TTFT, cached prompt tokens and text of one streamed turn."""
    start = time.perf_counter()
    first, text, cached = None, [], None
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=answer, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices:
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].text)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return {"ttft_s": first, "cached_tokens": cached, "text": "".join(text)}


def summarize(results: dict[str, list[list[dict]]], turns: int) -> tuple[list[dict], dict[str, float], dict[str, int]]:
    """(a row per turn: median prompt tokens, per system median TTFT and cached tokens, the first
    system's TTFT over the second's; per system the TTFT summed over turns 2 on; per system the
    turns answered with stock vLLM's text, `reference` in each turn's record)."""
    names = list(results)
    rows = []
    for k in range(turns):
        med = {n: statistics.median(conv[k]["ttft_s"] for conv in results[n]) for n in names}
        cached = {n: statistics.median(conv[k]["cached_tokens"] or 0 for conv in results[n]) for n in names}
        tokens = statistics.median(conv[k]["prompt_tokens"] for conv in results[names[0]])
        rows.append({"turn": k + 1, "prompt_tokens": tokens, "ttft_s": med, "cached_tokens": cached,
                     "ratio": med[names[0]] / med[names[1]]})
    totals = {n: sum(t["ttft_s"] for conv in results[n] for t in conv[1:]) for n in names}
    same = {n: sum(t["text"] == t["reference"] for conv in results[n] for t in conv) for n in names}
    return rows, totals, same


def counters(api: str) -> dict[str, float]:
    """The conductor's fetch counters, and its routes by kind (routes_<kind>)."""
    text = httpx.get(api.removesuffix("/v1") + "/metrics", timeout=10).text
    want = ("mooncake_prefix_fetches_total", "mooncake_prefix_fetch_tokens_total")
    out = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in want}
    return out | {f"routes_{kind}": n for kind, n in routes_from_metrics(text).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4, help="prompts per conversation")
    parser.add_argument("--question-tokens", type=int, default=100, help="new tokens each turn asks")
    parser.add_argument("--answer-tokens", type=int, default=150, help="tokens each turn answers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="fetch,no-fetch",
                        help=f"two of {', '.join(SYSTEMS)}, run at once; the ratio is the first's TTFT over the second's")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/conversation.json"))
    args = parser.parse_args()
    names = args.systems.split(",")
    if len(set(names)) != 2 or not set(names) <= set(SYSTEMS):
        parser.error(f"--systems: two of {', '.join(SYSTEMS)}, not {args.systems!r}")
    systems = {name: SYSTEMS[name] for name in names}

    from mooncake.model import ensure_model

    model = str(ensure_model())
    log_dir = args.out.parent / "conversation-logs"
    with colocated_vllm(model, log_dir, dtype=args.dtype) as vllm:
        print(f"building {args.conversations} conversations of {args.turns} turns with stock vLLM",
              file=sys.stderr)
        convs = build_conversations(vllm, args.conversations, args.turns, args.question_tokens,
                                    args.answer_tokens, args.seed)
    results: dict[str, list[list[dict]]] = {name: [] for name in systems}
    with ExitStack() as stack:
        apis = {name: stack.enter_context(mooncake_cluster(model, log_dir / name, extra, dtype=args.dtype))
                for name, extra in systems.items()}
        clients = {name: openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=600)
                   for name, api in apis.items()}
        for c, prompts in enumerate(convs):
            for name in systems:
                results[name].append([])
            for k, (prompt, reference) in enumerate(prompts):
                order = list(systems) if (c + k) % 2 == 0 else list(reversed(systems))
                for name in order:
                    turn = one_turn(clients[name], prompt, args.answer_tokens)
                    results[name][c].append({"prompt_tokens": len(prompt), "reference": reference, **turn})
                    print(f"conversation {c} turn {k + 1} {name}: {len(prompt)} tokens, TTFT "
                          f"{turn['ttft_s']:.3f} s, cached {turn['cached_tokens']}", file=sys.stderr)
        fetched = {name: counters(api) for name, api in apis.items()}

    rows, totals, same = summarize(results, args.turns)
    names = list(systems)
    print(f"\n{args.conversations} conversations, {args.dtype}; median TTFT per turn (s)")
    print("| turn | prompt tokens | " + " | ".join(f"{n} TTFT / cached" for n in names) + f" | {names[0]} / {names[1]} |")
    print("|---|---:|" + "---:|" * (len(names) + 1))
    for r in rows:
        print(f"| {r['turn']} | {r['prompt_tokens']:.0f} | "
              + " | ".join(f"{r['ttft_s'][n]:.3f} / {r['cached_tokens'][n]:.0f}" for n in names)
              + f" | {r['ratio']:.2f}x |")
    print(f"\nTTFT summed over turns 2-{args.turns}: " + ", ".join(f"{n} {totals[n]:.2f} s" for n in names)
          + f" ({totals[names[0]] / totals[names[1]]:.2f}x)")
    print("prefix fetches routed: " + ", ".join(
        f"{n} {fetched[n].get('mooncake_prefix_fetches_total', 0):.0f} "
        f"({fetched[n].get('mooncake_prefix_fetch_tokens_total', 0):.0f} tokens)" for n in names))
    print("routes by kind: " + "; ".join(
        f"{n} " + ", ".join(f"{k.removeprefix('routes_')} {v:.0f}" for k, v in sorted(fetched[n].items())
                            if k.startswith("routes_")) for n in names))
    measured = args.conversations * args.turns
    print("turns answered with stock vLLM's text (a colocated server, its own prefix cache holding the earlier "
          "turns): " + ", ".join(f"{n} {same[n]} of {measured}" for n in names))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "totals": totals, "fetches": fetched, "same_text": same, "raw": results},
                                   indent=1))


if __name__ == "__main__":
    main()
