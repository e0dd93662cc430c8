from mooncake.hashing import hash_prompt_blocks
from mooncake.engine.kv_events import BlockEventLog, BlockHashTranslator

B = 4


def test_translated_hashes_equal_the_conductors_prompt_hashes():
    """The key agreement the cache-aware router depends on: what a worker reports stored is
    exactly what the conductor computes from the same prompt."""
    prompt = list(range(100, 118))  # 4 full blocks + 2 tokens
    t = BlockHashTranslator()
    ours = t.stored(["e0", "e1"], None, prompt[:8], B) + t.stored(["e2", "e3"], "e1", prompt[8:16], B)
    assert ours == hash_prompt_blocks(prompt, B)


def test_unknown_parent_is_skipped_not_guessed():
    t = BlockHashTranslator()
    assert t.stored(["e5"], "never-seen", [1, 2, 3, 4], B) == []


def test_removed_maps_back_and_forgets():
    t = BlockHashTranslator()
    [h] = t.stored(["e0"], None, [1, 2, 3, 4], B)
    assert t.removed(["e0", "zzz"]) == [h]
    assert t.removed(["e0"]) == []


def test_log_pages_and_resets():
    log = BlockEventLog(max_events=4)
    first = log.since(-1)
    assert first.reset and first.stored == []
    log.stored([1, 2])
    page = log.since(first.seq)
    assert not page.reset and page.stored == [1, 2]
    log.removed([1])
    page2 = log.since(page.seq)
    assert page2.removed == [1] and page2.stored == []
    log.stored([3, 4, 5])  # pushes old events out of the 4-event window
    stale = log.since(page.seq - 1)
    assert stale.reset and sorted(stale.stored) == [2, 3, 4, 5]
    ahead = log.since(10_000)  # a worker that restarted: its seq went backwards for us
    assert ahead.reset
