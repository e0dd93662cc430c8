"""The worker's record of which prompts its engine computed at the same time."""

from mooncake.engine.prefill_overlap import PrefillOverlap


def test_a_prompt_computed_alone_has_no_others():
    o = PrefillOverlap()
    o.submitted("a", 1.0)
    o.first_output("a", 2.0)
    o.submitted("b", 3.0)  # after a's first output
    o.first_output("b", 4.0)
    assert o.others("b", 3.1, 3.9) == 0
    assert o.others("a", 1.1, 1.9) == 0


def test_prompts_in_prefill_together_count_each_other():
    o = PrefillOverlap()
    for rid in "abc":
        o.submitted(rid, 1.0)
    o.first_output("a", 2.0)
    # b's prefill (1.5, 3.0): a was still in prefill until 2.0, c has not had its first output.
    assert o.others("b", 1.5, 3.0) == 2
    o.first_output("b", 3.0)
    o.first_output("c", 5.0)
    assert o.others("c", 3.5, 4.9) == 0  # a and b were done before c was first scheduled
    assert o.others("c", 2.5, 4.9) == 1  # b was still computing


def test_a_prompt_submitted_after_the_window_does_not_count():
    o = PrefillOverlap()
    o.submitted("a", 1.0)
    o.submitted("late", 5.0)
    assert o.others("a", 1.0, 4.0) == 0


def test_first_output_is_idempotent_and_an_unknown_id_is_ignored():
    o = PrefillOverlap()
    o.submitted("a", 1.0)
    o.first_output("a", 2.0)
    o.first_output("a", 9.0)  # the request's finally: already closed
    o.first_output("never-submitted", 3.0)
    assert len(o) == 0
    assert o.others("x", 1.5, 1.6) == 1  # a's span is (1, 2), not (1, 9)
    assert o.others("x", 2.5, 8.0) == 0


def test_history_is_bounded():
    o = PrefillOverlap(history=3)
    for i in range(10):
        o.submitted(str(i), float(i))
        o.first_output(str(i), i + 0.5)
    assert o.others("x", 0.0, 100.0) == 3


class FakeEngine:
    """AsyncLLM.generate's shape: one finished output per request after `prefill_s`, with the
    engine timestamps vLLM records (time.monotonic, as the engine core's clock)."""

    def __init__(self, prefill_s: float):
        self.prefill_s = prefill_s

    async def generate(self, prompt, sampling, request_id):
        import asyncio
        import time
        from types import SimpleNamespace

        scheduled = time.monotonic()
        await asyncio.sleep(self.prefill_s)
        first = time.monotonic()
        yield SimpleNamespace(
            finished=True, num_cached_tokens=0, prompt_logprobs=None, kv_transfer_params=None,
            outputs=[SimpleNamespace(token_ids=[7], finish_reason="length", stop_reason=None, logprobs=None)],
            metrics=SimpleNamespace(queued_ts=scheduled, scheduled_ts=scheduled, first_token_ts=first,
                                    last_token_ts=first, num_generation_tokens=1))


def test_decode_steps_count_the_prompts_computed_meanwhile():
    from types import SimpleNamespace

    from mooncake.engine.engine import measured_times

    o = PrefillOverlap()
    o.submitted("other", 5.0)
    o.first_output("other", 6.0)  # computed while r decoded (4, 8)
    stats = SimpleNamespace(scheduled_ts=1.0, first_token_ts=4.0, last_token_ts=8.0, num_generation_tokens=5)
    times = measured_times(stats, o, "r")
    assert (times["prefill_concurrent"], times["decode_concurrent"]) == (0, 1)
    one = SimpleNamespace(scheduled_ts=1.0, first_token_ts=4.0, last_token_ts=4.0, num_generation_tokens=1)
    assert "decode_concurrent" not in measured_times(one, o, "r")  # no decode step to judge
    assert measured_times(None, o, "r") == {}  # stats off


def test_run_request_reports_how_many_prompts_shared_the_prefill():
    import asyncio

    from mooncake.engine.engine import run_request
    from mooncake.protocol import GenerateRequest, PullParams, Sampling

    engine, overlap = FakeEngine(0.05), PrefillOverlap()

    async def last(rid, params=None):
        request = GenerateRequest(rid, [1, 2, 3], Sampling(max_tokens=1), params or {})
        return [c async for c in run_request(engine, request, overlap)][-1]

    async def scenario():
        together = await asyncio.gather(last("a"), last("b"), last("c"))
        alone = await last("d")
        # A prompt whose KV is pulled is loaded, not computed: it shares no compute.
        pulled = PullParams(transfer_id="t", num_tokens=3, wait_timeout_s=1.0).to_params()
        beside_a_pull = await asyncio.gather(last("e"), last("f", pulled))
        return together, alone, beside_a_pull

    together, alone, beside_a_pull = asyncio.run(scenario())
    assert [c.prefill_concurrent for c in together] == [2, 2, 2]
    assert alone.prefill_concurrent == 0 and alone.prefill_s > 0
    assert beside_a_pull[0].prefill_concurrent == 0
    assert len(overlap) == 0  # every span closed
