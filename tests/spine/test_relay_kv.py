"""The conductor's side of the KV path (conductor/relay.py) with fake workers: the push names the
blocks D holds, and a prefill whose KV did not land sends D on without a pull."""

import asyncio

from conductor.relay import Relay, RelayStats
from conductor.routing import Route
from conductor.workers import WorkerHandle
from mooncake.protocol import GenerateChunk, Sampling


class Workers:
    def __init__(self, kv_error=None):
        self.kv_error = kv_error
        self.requests, self.dropped = [], []

    async def generate(self, worker, request):
        self.requests.append((worker.name, request))
        if request.sampling.max_tokens == 1:  # the prefill
            yield GenerateChunk([7], finish_reason="length", num_cached_tokens=0, kv_error=self.kv_error)
            return
        yield GenerateChunk([1], num_cached_tokens=0)
        yield GenerateChunk([2], finish_reason="length")

    async def drop_transfer(self, worker, transfer_id):
        self.dropped.append((worker.name, transfer_id))


def handle(name):
    return WorkerHandle(http_url=f"http://{name}", instance_id=name, kv_address=f"{name}:1")


def run(workers, route):
    async def main():
        relay = Relay(workers, 5.0, lambda tried: None)
        return [c async for c in relay.run("r", [5] * 300, Sampling(max_tokens=3), route, RelayStats())]
    return asyncio.run(main())


def test_the_push_skips_the_blocks_the_decode_worker_holds_and_decode_pulls():
    workers = Workers()
    chunks = run(workers, Route(handle("p"), handle("d"), decode_held_blocks=2))
    (_, prefill), (_, decode) = workers.requests
    assert prefill.kv_transfer_params["mooncake_push"]["skip_blocks"] == 2
    assert decode.kv_transfer_params["mooncake_pull"]["num_tokens"] == 300
    assert [t for c in chunks for t in c.token_ids] == [7, 1, 2] and workers.dropped == []


def test_a_push_that_did_not_land_sends_decode_on_without_a_pull():
    workers = Workers(kv_error="ChecksumError: slice 0")
    chunks = run(workers, Route(handle("p"), handle("d")))
    (_, _), (where, decode) = workers.requests
    assert where == "d" and decode.kv_transfer_params == {}  # D computes the prompt, waiting for nothing
    assert workers.dropped == [("d", "r")]  # and frees what was staged of it
    assert [t for c in chunks for t in c.token_ids] == [7, 1, 2]


def test_a_request_let_go_before_decode_frees_the_pushed_kv_and_after_it_does_not():
    """The client left (or the stream was cancelled) after the prefill's token but before D was
    asked for the KV: D is told to drop it at once, not left holding it until the staging TTL.
    Once D was asked, its own abort frees it, and nothing is dropped twice."""
    async def main(close_after: int):
        workers = Workers()
        relay = Relay(workers, 5.0, lambda tried: None)
        chunks = relay.run("r", [5] * 300, Sampling(max_tokens=3), Route(handle("p"), handle("d")), RelayStats())
        for _ in range(close_after):
            await anext(chunks)
        await chunks.aclose()
        await asyncio.sleep(0)  # the drop runs as a task of its own
        await asyncio.gather(*relay._drops)
        return workers

    let_go = asyncio.run(main(close_after=1))  # P's token relayed, D not asked yet
    assert [w for w, _ in let_go.requests] == ["p"] and let_go.dropped == [("d", "r")]
    decoding = asyncio.run(main(close_after=2))  # D already answering
    assert [w for w, _ in decoding.requests] == ["p", "d"] and decoding.dropped == []


def test_a_decode_worker_failing_before_its_first_token_is_retried_and_counted():
    from conductor.workers import WorkerError

    class FailingDecode(Workers):
        async def generate(self, worker, request):
            if worker.name == "d" and request.sampling.max_tokens != 1:
                self.requests.append((worker.name, request))
                raise WorkerError("connection refused")
                yield  # an async generator
            async for chunk in super().generate(worker, request):
                yield chunk

    async def main():
        workers, retries, moved = FailingDecode(), [], []
        relay = Relay(workers, 5.0, lambda tried: handle("spare"), on_retry=retries.append,
                      on_moved=lambda route, worker: moved.append((route.request_id, worker.name)))
        chunks = [c async for c in relay.run("r", [5] * 300, Sampling(max_tokens=3),
                                             Route(handle("p"), handle("d"), "r"), RelayStats())]
        await asyncio.gather(*relay._drops)
        return workers, retries, chunks, moved

    workers, retries, chunks, moved = asyncio.run(main())
    assert [w for w, _ in workers.requests] == ["p", "d", "spare"] and retries == ["decode"]
    assert moved == [("r", "spare")]  # the router counts the request on the spare from now on
    assert [t for c in chunks for t in c.token_ids] == [7, 1, 2]
    # The spare computes the prompt; the KV pushed to the failed worker is freed there, not left
    # to its staging TTL.
    assert workers.requests[2][1].kv_transfer_params == {} and workers.dropped == [("d", "r")]


def test_a_sample_the_caller_stops_is_closed_at_its_next_chunk_and_the_others_go_on():
    """n > 1, one sample cut at a stop string: its decode request went on to max_tokens for
    nobody, taking decode capacity from the others."""
    class Streams(Workers):
        def __init__(self):
            super().__init__()
            self.sent, self.closed = {}, []

        async def generate(self, worker, request):
            self.requests.append((worker.name, request))
            if request.sampling.max_tokens == 1:
                yield GenerateChunk([7], finish_reason="length", num_cached_tokens=0)
                return
            finished = False
            try:
                for i in range(20):
                    self.sent[request.request_id] = i + 1
                    finished = i == 19
                    yield GenerateChunk([i], num_cached_tokens=0, finish_reason="length" if finished else None)
                    await asyncio.sleep(0.001)
            finally:
                if not finished:
                    self.closed.append(request.request_id)

    async def main():
        workers, stopped = Streams(), set()
        relay = Relay(workers, 5.0, lambda tried: None)
        counts = {0: 0, 1: 0}
        async for index, chunk in relay.samples("r", [5] * 300, Sampling(max_tokens=21), Route(handle("p"), handle("d")),
                                                RelayStats(), 2, stopped=stopped):
            counts[index] += len(chunk.token_ids)
            if index == 0 and counts[0] >= 3:
                stopped.add(0)
        return workers, counts

    workers, counts = asyncio.run(main())
    assert workers.closed == ["r-d1"] and workers.sent["r-d1"] <= 4  # at most one chunk more
    assert workers.sent["r-s1-d1"] == 20 and counts[1] == 20


def test_a_decode_that_samples_the_first_token_is_not_told_to_skip_the_block_its_vllm_must_compute():
    """D's vLLM computes at least a request's last token. With a grammar D's request is the prompt
    alone, so for a prompt of whole blocks that D holds, one block is not a hit there: skipping it
    made every such pull fail and recompute."""
    d = handle("d")
    d.block_size = 128
    grammar = Sampling(max_tokens=3, structured=("regex", "[0-9]+"))
    cases = [(256, grammar, 2, 1), (300, grammar, 2, 2), (256, Sampling(max_tokens=3), 2, 2), (256, grammar, 0, 0)]
    for prompt_tokens, sampling, held, skipped in cases:
        workers = Workers()

        async def main():
            relay = Relay(workers, 5.0, lambda tried: None)
            route = Route(handle("p"), d, decode_held_blocks=held)
            return [c async for c in relay.run("r", [5] * prompt_tokens, sampling, route, RelayStats())]

        asyncio.run(main())
        prefill = workers.requests[0][1]
        assert prefill.kv_transfer_params["mooncake_push"]["skip_blocks"] == skipped, (prompt_tokens, held)


def test_a_one_token_answer_pushes_no_kv_and_asks_no_decode_worker():
    """P's token is the whole answer: its KV went to D only to be dropped (and a D without room
    for it failed the push for nothing)."""
    async def main(sampling):
        workers = Workers()
        relay = Relay(workers, 5.0, lambda tried: None)
        chunks = [c async for c in relay.run("r", [5] * 300, sampling, Route(handle("p"), handle("d")), RelayStats())]
        await asyncio.gather(*relay._drops)
        return workers, chunks

    workers, chunks = asyncio.run(main(Sampling(max_tokens=1)))
    [(where, prefill)] = workers.requests
    assert where == "p" and "mooncake_push" not in prefill.kv_transfer_params and workers.dropped == []
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([7], "length")]
    # A token that D must sample itself (a grammar's, ...) still goes there with the prompt's KV.
    workers, _ = asyncio.run(main(Sampling(max_tokens=1, presence_penalty=0.5)))
    assert [w for w, _ in workers.requests] == ["p", "d"] and "mooncake_push" in workers.requests[0][1].kv_transfer_params
