"""Smoke check of the vLLM+MooncakeConnector peer against stock colocated vLLM, one at a time.

    python -m benchmarks.peer_smoke [--dtype float32|bfloat16] [--log-dir DIR]

Prints each answer (non-streamed and streamed, with the time to the first streamed text) for
"The capital of France is" (max_tokens 8, temperature 0), checks that requests whose first
token ends them (max_tokens=1; a stop string or a stop token id, which ends it as EOS does,
matching at once) come back promptly, and prints the decode server's own count of prompt
tokens that arrived over the connector. Exit status 1 when float32 texts differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

from benchmarks.servers import MODEL_NAME, colocated_vllm, vllm_mooncake_pd
from mooncake.model import ensure_model

PROMPT = "The capital of France is"
# About 1,500 tokens: the KV spans many blocks; four at once make both engines batch.
LONG_PROMPTS = [f"Story {i}. " + " ".join(f"Line {j}: the {i}th river flows past town {j}."
                                          for j in range(110)) + " Summarise the story:"
                for i in range(4)]


def ask(url: str, **kw) -> tuple[str, str, float]:
    client = OpenAI(base_url=url, api_key="none", timeout=60, max_retries=0)
    t0 = time.monotonic()
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **{"temperature": 0, **kw})
    return out.choices[0].text, out.choices[0].finish_reason, time.monotonic() - t0


def ask_streamed(url: str, **kw) -> tuple[str, str, float, float]:
    client = OpenAI(base_url=url, api_key="none", timeout=60, max_retries=0)
    t0, ttft, text, finish = time.monotonic(), None, "", None
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0,
                                           stream=True, **kw):
        if chunk.choices:
            if chunk.choices[0].text and ttft is None:
                ttft = time.monotonic() - t0
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish, ttft if ttft is not None else float("nan"), time.monotonic() - t0


def first_token_id(model: str, text: str) -> int:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model).encode(text, add_special_tokens=False)[0]


def check(name: str, url: str, model: str) -> dict:
    answers = {}
    ask(url, max_tokens=8)  # warm-up: the first request pays one-time costs (and the handshake)
    text, finish, secs = ask(url, max_tokens=8)
    answers["plain"] = text
    print(f"[{name}] non-streamed: {text!r} finish={finish} ({secs:.2f} s)")
    text, finish, ttft, secs = ask_streamed(url, max_tokens=8)
    answers["streamed"] = text
    print(f"[{name}] streamed:     {text!r} finish={finish} (first text {ttft:.2f} s, "
          f"all {secs:.2f} s)")
    # Sampling with a seed: P and D draw the first token with the same seed, so the peer's text
    # should equal a colocated server's with that seed.
    text, finish, secs = ask(url, max_tokens=8, temperature=1.0, seed=1234)
    answers["sampled"] = text
    print(f"[{name}] sampled (seed 1234): {text!r} finish={finish} ({secs:.2f} s)")
    # A stop token id ends the request in the engine, as EOS does; a stop string ends it in
    # the server's front end. Both match the first token here.
    stop_id = first_token_id(model, answers["plain"])
    for label, kw in (("max_tokens=1", {"max_tokens": 1}),
                      ("stop string at once", {"max_tokens": 8, "stop": [answers["plain"][:2]]}),
                      ("stop token at once (as EOS)",
                       {"max_tokens": 8, "extra_body": {"stop_token_ids": [stop_id]}})):
        text, finish, secs = ask(url, **kw)
        print(f"[{name}] {label}: {text!r} finish={finish} ({secs:.2f} s)")
        text, finish, ttft, secs = ask_streamed(url, **kw)
        print(f"[{name}] {label}, streamed: {text!r} finish={finish} ({secs:.2f} s)")
        answers[label] = text
    t0 = time.monotonic()
    client = OpenAI(base_url=url, api_key="none", timeout=120, max_retries=0)
    with ThreadPoolExecutor(len(LONG_PROMPTS)) as pool:
        outs = list(pool.map(lambda p: client.completions.create(
            model=MODEL_NAME, prompt=p, temperature=0, max_tokens=16), LONG_PROMPTS))
    answers["long"] = [o.choices[0].text for o in outs]
    print(f"[{name}] 4 long prompts ({outs[0].usage.prompt_tokens} tokens each) at once: "
          f"{time.monotonic() - t0:.2f} s; first answer {answers['long'][0]!r}")
    return answers


def external_hits(proxy_url: str) -> str:
    """D's own count of prompt tokens that came over the connector (vLLM's metrics), so a
    decode server that silently recomputed the prompt shows here."""
    decode = httpx.get(proxy_url.removesuffix("/v1") + "/health", timeout=5).json()["decode"]
    lines = httpx.get(f"{decode}/metrics", timeout=5).text.splitlines()
    wanted = ("vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")
    return "; ".join(line for line in lines if line.startswith(wanted))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--log-dir", type=Path, default=Path("benchmarks/out/peer_smoke"))
    parser.add_argument("--peer-only", action="store_true", help="skip the colocated server")
    args = parser.parse_args()
    model = str(ensure_model())
    results = {}
    with vllm_mooncake_pd(model, args.log_dir / f"pd-{args.dtype}", args.dtype) as url:
        results["peer"] = check(f"vllm+mooncake-pd {args.dtype}", url, model)
        print(f"[vllm+mooncake-pd {args.dtype}] decode server: {external_hits(url)}")
    if not args.peer_only:
        with colocated_vllm(model, args.log_dir / f"colocated-{args.dtype}", args.dtype) as url:
            results["colocated"] = check(f"colocated-vllm {args.dtype}", url, model)
        keys = ("plain", "streamed", "sampled", "long")
        differ = [k for k in keys if results["peer"][k] != results["colocated"][k]]
        same = not differ
        print(f"peer text == colocated text ({', '.join(keys)}): {same}"
              + (f"; differ: {differ}" if differ else ""))
        return 0 if same or args.dtype != "float32" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
