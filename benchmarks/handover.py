"""The exposed cost of the KV hand-over (issue #13): TTFT through our prefill and decode workers
against one stock vLLM engine alone on one core, and how much of the KV transfer stayed hidden
behind the prefill's compute, per layer (the Mooncake paper's Figure 5).

    flock /tmp/heavy.lock timeout 900 .venv/bin/python benchmarks/handover.py            # bf16
    flock /tmp/heavy.lock timeout 900 .venv/bin/python benchmarks/handover.py --dtype float32

Ours: `mooncake serve` with one prefill worker on the first core and one decode worker on the
second, fixed roles, no conditional disaggregation and no admission, so every request is
prefilled on P and its KV handed to D. Peer: one stock vLLM OpenAI server, its engine on the
first core. Same model, dtype, prefill chunk (2,048 tokens) and eager mode. Both run at once,
each measured alone: one request at a time, every thread of the idle system confined to the
second core meanwhile (ours idles at several % of a core: its conductor polls), the systems
alternating (ours first on even turns,
vLLM first on odd ones) so the machine's noise falls on both. Each turn sends both systems the
same fresh prompt of random token ids (no prefix-cache hit on either; their caches are
separate). TTFT is the first streamed chunk of the official `openai` client.

Prints, per prompt length: median TTFT ours, median TTFT vLLM, their ratio against the goal
(at most 1.03x). Then, from the prefill worker's `layer_timeline` (on /internal/kv_stats; see
benchmarks/kv_overlap.py for the arithmetic), the median wire time, exposed tail and hidden
fraction of the KV transfer per length, and draws the plot (one long prompt's layers, exposed
against hidden wire time per length, TTFT per length). A prefill worker without a timeline
gives the TTFT table alone and says so. Raw samples go to benchmarks/out/handover_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import kv_overlap  # noqa: E402
from benchmarks.servers import MODEL_NAME, colocated_vllm, running  # noqa: E402
from mooncake.auth import TOKEN_ENV, TOKEN_HEADER  # noqa: E402
from mooncake.net import free_port, free_port_block  # noqa: E402

SYSTEMS = ("ours", "vllm")
NO_TIMELINE = ("the prefill worker's /internal/kv_stats has no `layer_timeline` (it comes with the "
               "layer-wise KV path of issue #13, branch kv-path): the Figure-5 part is skipped")


@dataclass(frozen=True)
class HandoverConfig:
    lengths: tuple[int, ...] = (2048, 4096, 7168)
    """Prompt lengths (tokens), all measured in one run."""
    reps: int = 5
    """Measured requests per length and system (the median is reported)."""
    output_tokens: int = 4
    """Tokens per request: the first from P, the rest from D, so every request hands over."""
    dtype: str = "bfloat16"
    cores: tuple[int, int] = (0, 1)
    """P and the vLLM engine on the first, D on the second."""
    warmup_each_length: bool = True
    """One unmeasured request of every length per system before the measured ones."""
    goal: float = 1.03
    seed: int = 0
    model: str | None = None
    log_dir: Path = Path("benchmarks/out/logs")
    plot: Path | None = None
    json_out: Path | None = None

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 16:
            raise ValueError("--lengths: give one or more prompt lengths of at least 16 tokens")
        if self.reps < 1 or self.output_tokens < 2:
            raise ValueError("--reps must be >= 1 and --output-tokens >= 2 (one token from each worker)")
        if self.cores[0] == self.cores[1]:
            raise ValueError("--cores: prefill and decode need two different cores")

    @property
    def plot_path(self) -> Path:
        return self.plot or Path(f"docs/img/handover_{self.dtype}.png")

    @property
    def json_path(self) -> Path:
        return self.json_out or Path(f"benchmarks/out/handover_{self.dtype}.json")


def parse_args(argv: list[str] | None = None) -> HandoverConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096,7168", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--reps", type=int, default=5, help="measured requests per length and system")
    ap.add_argument("--output-tokens", type=int, default=4, help="tokens generated per request (>= 2)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--cores", default="0,1", help="two cores: P and the vLLM engine on the first, D on the second")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: one 512-token length, one repetition, no per-length warm-up; "
                         "the plot goes to benchmarks/out/ instead of docs/img/")
    ap.add_argument("--goal", type=float, default=1.03, help="TTFT ratio ours/vLLM to meet at every length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model folder (default: the prepared SmolLM2-135M)")
    ap.add_argument("--log-dir", default="benchmarks/out/logs", help="server logs go here")
    ap.add_argument("--plot", default=None, help="PNG path (default: docs/img/handover_<dtype>.png)")
    ap.add_argument("--json-out", default=None, help="raw results (default: benchmarks/out/handover_<dtype>.json)")
    args = ap.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
        cores = tuple(int(x) for x in args.cores.split(","))
    except ValueError:
        ap.error("--lengths and --cores take comma-separated integers")
    if len(cores) != 2:
        ap.error("--cores takes exactly two cores, e.g. 0,1")
    config = dict(lengths=lengths, reps=args.reps, output_tokens=args.output_tokens, dtype=args.dtype,
                  cores=cores, goal=args.goal, seed=args.seed, model=args.model, log_dir=Path(args.log_dir),
                  plot=Path(args.plot) if args.plot else None,
                  json_out=Path(args.json_out) if args.json_out else None)
    if args.quick:
        config.update(lengths=(512,), reps=1, warmup_each_length=False,
                      plot=config["plot"] or Path(f"benchmarks/out/handover_quick_{args.dtype}.png"),
                      json_out=config["json_out"] or Path(f"benchmarks/out/handover_quick_{args.dtype}.json"))
    try:
        return HandoverConfig(**config)
    except ValueError as exc:
        ap.error(str(exc))


@dataclass(frozen=True)
class OurCluster:
    url: str
    prefill_url: str
    token: str

    def kv_stats(self) -> dict:
        resp = httpx.get(f"{self.prefill_url}/internal/kv_stats", headers={TOKEN_HEADER: self.token}, timeout=10)
        resp.raise_for_status()
        return resp.json()


@contextmanager
def our_cluster(model: str, log_dir: Path, dtype: str):
    """`mooncake serve`, 1 prefill + 1 decode, every request handed over (no colocated prefill,
    no refusals). The cores are this process's affinity: the launcher gives P the first."""
    port, worker_port, token = free_port(), free_port_block(2), secrets.token_urlsafe(32)
    args = ["-m", "mooncake.cli", "serve", "--model", model, "--served-model-name", MODEL_NAME,
            "--port", str(port), "--worker-port", str(worker_port), "--dtype", dtype,
            "--prefill", "1", "--decode", "1", "--no-flexible-roles", "--no-conditional-disaggregation",
            "--admission", "none"]
    with running("mooncake", args, f"http://127.0.0.1:{port}/health", log_dir, env={TOKEN_ENV: token}):
        # The launcher numbers workers from --worker-port, prefill first.
        yield OurCluster(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{worker_port}", token)


def make_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def ttft(client: openai.OpenAI, prompt: list[int], output_tokens: int) -> dict:
    """Seconds to the first streamed chunk (whatever its text), and what came back."""
    start = time.perf_counter()
    first, chunks, first_text = None, 0, ""
    try:
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=output_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if not chunk.choices:
                continue
            if first is None:
                first, first_text = time.perf_counter() - start, chunk.choices[0].text
            chunks += 1
    except openai.OpenAIError as exc:
        return {"prompt_tokens": len(prompt), "ttft_s": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"prompt_tokens": len(prompt), "ttft_s": first, "chunks": chunks, "first_text": first_text,
            "error": None if first is not None else "no chunk streamed"}


def system_processes() -> dict[str, list]:
    """Each system's processes (psutil), from this process's children."""
    import psutil

    out = {}
    for child in psutil.Process().children():
        cmd = " ".join(child.cmdline())
        name = "ours" if "mooncake.cli" in cmd else "vllm" if "vllm.entrypoints" in cmd else None
        if name:
            out[name] = [child, *child.children(recursive=True)]
    return out


@contextmanager
def confined(pids: list[int], core: int):
    """Every thread of `pids` on `core` alone, then back: the idle system's polls and loggers
    (ours: several % of a core) must not run on the core the measured engine computes on."""
    saved: dict[int, set[int]] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            main_mask = os.sched_getaffinity(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        for tid in tids:
            try:
                saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {core})
            except (ProcessLookupError, OSError):
                pass
        saved.setdefault(pid, main_mask)
    try:
        yield
    finally:
        for pid in pids:
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except FileNotFoundError:
                continue
            for tid in tids:  # threads born while confined get their process's old mask
                try:
                    os.sched_setaffinity(tid, saved.get(tid, saved.get(pid, set(os.sched_getaffinity(0)))))
                except (ProcessLookupError, OSError):
                    pass


def idle_cpu(seconds: float = 10.0) -> dict[str, float]:
    """Share of one core each system's processes use while nobody sends them anything: the
    system not being measured sits idle beside the one that is, so it must cost ~nothing."""
    import psutil

    def cpu(procs) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    procs = system_processes()
    before = {name: cpu(ps) for name, ps in procs.items()}
    time.sleep(seconds)
    return {name: (cpu(ps) - before[name]) / seconds for name, ps in procs.items()}


def measure(config: HandoverConfig, clients: dict[str, openai.OpenAI]) -> list[dict]:
    rng = random.Random(config.seed)
    pids = {name: [p.pid for p in procs] for name, procs in system_processes().items()}

    def ttft_alone(name: str, prompt: list[int]) -> dict:
        other = pids.get("vllm" if name == "ours" else "ours", [])
        with confined(other, config.cores[1]):
            return ttft(clients[name], prompt, config.output_tokens)

    warmups = [64, *(config.lengths if config.warmup_each_length else ())]
    for n in warmups:
        prompt = make_prompt(rng, n)
        for name in SYSTEMS:
            ttft_alone(name, prompt)
    samples = []
    for rep in range(config.reps):
        for i, n in enumerate(config.lengths):
            prompt = make_prompt(rng, n)
            order = SYSTEMS if (rep + i) % 2 == 0 else SYSTEMS[::-1]
            for name in order:
                sample = {"system": name, "rep": rep, **ttft_alone(name, prompt)}
                samples.append(sample)
                shown = f"{sample['ttft_s']:.3f} s" if sample["ttft_s"] is not None else sample["error"]
                print(f"[handover] {n:>6} tokens  rep {rep}  {name:<5} TTFT {shown}", file=sys.stderr)
    return samples


def ttft_table(config: HandoverConfig, samples: list[dict]) -> list[dict]:
    rows = []
    for n in config.lengths:
        row = {"prompt_tokens": n}
        for name in SYSTEMS:
            values = [s["ttft_s"] for s in samples if s["system"] == name and s["prompt_tokens"] == n
                      and s["ttft_s"] is not None]
            row[name] = statistics.median(values) if values else float("nan")
            row[f"{name}_n"] = len(values)
        row["ratio"] = row["ours"] / row["vllm"] if row["vllm"] > 0 else float("nan")
        # Each turn's two requests ran back to back on the same prompt: their ratio cancels the
        # machine's slow drifts, which the ratio of medians does not.
        turns = {}
        for s in samples:
            if s["prompt_tokens"] == n and s["ttft_s"] is not None:
                turns.setdefault(s["rep"], {})[s["system"]] = s["ttft_s"]
        paired = [t["ours"] / t["vllm"] for t in turns.values() if len(t) == 2 and t["vllm"] > 0]
        row["paired_ratio"] = statistics.median(paired) if paired else float("nan")
        rows.append(row)
    return rows


def same_first_text(samples: list[dict]) -> tuple[int, int]:
    """Turns where both systems streamed the same first chunk (a sanity check: same prompt,
    greedy), and turns where both answered."""
    turns = {}
    for s in samples:
        if s["error"] is None:
            turns.setdefault((s["rep"], s["prompt_tokens"]), {})[s["system"]] = s["first_text"]
    both = [t for t in turns.values() if len(t) == 2]
    return sum(t["ours"] == t["vllm"] for t in both), len(both)


def push_rate(before: dict, after: dict) -> dict:
    """What the prefill worker's connector pushed during the run, from its counters."""
    b, a = before.get("stats", {}), after.get("stats", {})
    moved = {k: a.get(k, 0) - b.get(k, 0) for k in ("pushed_transfers", "pushed_bytes", "push_seconds", "push_failures")}
    moved["gb_per_s"] = moved["pushed_bytes"] / moved["push_seconds"] / 1e9 if moved["push_seconds"] > 0 else None
    return moved


def report(config: HandoverConfig, rows: list[dict], samples: list[dict], pushed: dict, summaries: dict | None,
           routes: dict) -> None:
    print(f"KV hand-over cost: {MODEL_NAME} {config.dtype}; ours = P (core {config.cores[0]}) + "
          f"D (core {config.cores[1]}) behind the conductor, vLLM = one engine on core {config.cores[0]}; "
          f"{config.reps} rep(s), medians")
    print(f"\n| prompt tokens | TTFT ours | TTFT vLLM | ratio | <= {config.goal:g}x | median of paired ratios |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        met = "met" if r["ratio"] <= config.goal else "MISSED"
        print(f"| {r['prompt_tokens']:,} | {r['ours']:.3f} s | {r['vllm']:.3f} s | {r['ratio']:.3f} | {met} "
              f"| {r['paired_ratio']:.3f} |")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(routes.items())) or "none counted"
    errors = sum(s["error"] is not None for s in samples)
    same, turns = same_first_text(samples)
    print(f"\nerrors: {errors}; same first token on both systems in {same} of {turns} turns; "
          f"conductor routes (warm-ups included): {kinds}")
    if pushed.get("pushed_transfers"):
        rate = f"{pushed['gb_per_s']:.2f} GB/s" if pushed["gb_per_s"] else "n/a"
        print(f"KV pushed by P: {pushed['pushed_transfers']} transfers, {pushed['pushed_bytes'] / 1e6:.1f} MB, "
              f"{pushed['push_seconds']:.2f} s pushing ({rate}), {pushed['push_failures']} failures")
    if summaries is None:
        print(f"\n{NO_TIMELINE}")
        return
    print("\n| prompt tokens | transfers | layers | wire time | exposed tail | hidden | TTFT ours - vLLM |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = summaries.get(r["prompt_tokens"])
        gap = (r["ours"] - r["vllm"]) * 1e3
        if s is None:
            print(f"| {r['prompt_tokens']:,} | 0 | - | - | - | - | {gap:.0f} ms |")
            continue
        print(f"| {s.num_tokens:,} | {s.transfers} | {s.layers} | {s.wire_s * 1e3:.1f} ms | "
              f"{s.exposed_s * 1e3:.1f} ms | {s.hidden_fraction:.1%} | {gap:.0f} ms |")


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    os.sched_setaffinity(0, set(config.cores))  # children inherit it: the launcher binds P, then D
    from mooncake.model import ensure_model

    model = config.model or str(ensure_model())
    started = time.monotonic()
    with our_cluster(model, config.log_dir, config.dtype) as ours, \
            colocated_vllm(model, config.log_dir, config.dtype, cores=str(config.cores[0])) as vllm_url:
        clients = {name: openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
                   for name, url in (("ours", ours.url), ("vllm", vllm_url))}
        idle = idle_cpu()
        before = ours.kv_stats()
        samples = measure(config, clients)
        after = ours.kv_stats()
        from benchmarks.spine_latency import route_counts

        routes = route_counts(ours.url)
    rows = ttft_table(config, samples)
    timeline = kv_overlap.timeline_of(after)
    groups = summaries = None
    if timeline is not None:
        groups = kv_overlap.by_length(kv_overlap.overlaps(timeline), list(config.lengths), config.reps)
        summaries = {n: kv_overlap.summarize(n, g) for n, g in groups.items()}
    report(config, rows, samples, push_rate(before, after), summaries, routes)
    print("idle CPU before the measured requests (share of one core): "
          + ", ".join(f"{name} {share:.1%}" for name, share in sorted(idle.items())))
    from benchmarks.handover_plot import draw

    draw(config, rows, groups, config.plot_path)
    config.json_path.parent.mkdir(parents=True, exist_ok=True)
    config.json_path.write_text(json.dumps(
        {"config": {**asdict(replace(config, log_dir=str(config.log_dir), plot=str(config.plot_path),
                                     json_out=str(config.json_path)))},
         "rows": rows, "samples": samples, "routes": routes, "idle_cpu": idle, "pushed": push_rate(before, after),
         "layer_timeline": timeline, "wall_s": time.monotonic() - started}, indent=1, default=str))
    print(f"\nplot: {config.plot_path}; raw: {config.json_path}; {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
