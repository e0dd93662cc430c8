from hypothesis import given
from hypothesis import strategies as st

from conductor.textstream import IncrementalDetokenizer, StopStringMatcher


class ByteTokenizer:
    """Each token is one UTF-8 byte, so multi-byte characters span tokens (the hard case)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_back_split_characters():
    detok = IncrementalDetokenizer(ByteTokenizer())
    data = "héllo €!".encode()
    out = "".join(detok.push([b]) for b in data) + detok.flush()
    assert out == "héllo €!"
    assert "\ufffd" not in out


def test_detokenizer_drops_a_character_cut_at_the_end_as_vllm_does():
    detok = IncrementalDetokenizer(ByteTokenizer())
    out = detok.push(list("ab".encode())) + detok.push([0xE2, 0x82])  # first 2 bytes of "€"
    assert out == "ab"
    assert detok.flush() == ""  # not U+FFFD (max_tokens cut the character)
    detok.push(list("c€".encode()))
    assert detok.flush() == ""  # nothing held back any more


def test_stop_string_split_across_pushes_is_cut_and_not_emitted():
    stopper = StopStringMatcher(["STOP"])
    emitted = []
    for piece in ["hello S", "TO", "P world"]:
        result = stopper.push(piece)
        emitted.append(result.text)
        if result.stopped:
            break
    assert "".join(emitted) == "hello "
    assert result.stopped


def test_partial_stop_prefix_is_released_when_it_does_not_match():
    stopper = StopStringMatcher(["STOP"])
    first = stopper.push("abc ST")
    assert first.text == "abc" and not first.stopped
    second = stopper.push("ART")
    assert not second.stopped
    assert first.text + second.text + stopper.flush() == "abc START"


def test_earliest_of_several_stops_wins():
    stopper = StopStringMatcher(["xyz", "b"])
    result = stopper.push("aaxyzb")
    assert result.stopped and result.text == "aa"


def test_no_stops_passes_everything_through():
    stopper = StopStringMatcher([])
    assert stopper.push("abc").text == "abc"
    assert stopper.flush() == ""


def test_the_stop_that_completes_first_wins_not_the_one_that_starts_first():
    # vLLM's detokenizer checks after every token: "b" completes before "abc" does.
    result = StopStringMatcher(["abc", "b"]).push("xabc")
    assert result.stopped and result.text == "xa" and result.stop == "b"


def test_protected_text_cannot_complete_a_stop_but_a_match_may_start_inside_it():
    stopper = StopStringMatcher(["."])
    first = stopper.push("Paris.", protected=True)  # min_tokens not reached yet
    second = stopper.push(" It is.")
    assert not first.stopped and second.stopped and first.text + second.text == "Paris. It is"
    straddling = StopStringMatcher(["is a"])
    first = straddling.push("this", protected=True)
    second = straddling.push(" a b")
    assert second.stopped and first.text + second.text == "th"  # "is a" ends after the protected text


def _reference(text: str, stops: list[str], protected: int) -> tuple[str, str | None]:
    """vLLM's rule, one character at a time: the first position past `protected` at which a
    stop string ends (ties: the first listed) cuts the text before that stop string, which is
    the answer's stop_reason."""
    for end in range(protected + 1, len(text) + 1):
        for stop in stops:
            if stop and text[:end].endswith(stop):
                return text[:end - len(stop)], stop
    return text, None



@given(text=st.text("abc.", max_size=30), stops=st.lists(st.text("abc.", min_size=1, max_size=3), max_size=4),
       protected=st.integers(0, 30), cuts=st.lists(st.integers(0, 30), max_size=6))
def test_the_matcher_agrees_with_vllms_rule_however_the_text_arrives(text, stops, protected, cuts):
    protected = min(protected, len(text))
    bounds = sorted({0, protected, len(text), *(min(c, len(text)) for c in cuts)})
    stopper, out, stop = StopStringMatcher(stops), "", None
    for start, end in zip(bounds, bounds[1:]):
        result = stopper.push(text[start:end], protected=end <= protected)
        out += result.text
        assert result.stopped == (result.stop is not None)
        if result.stopped:
            stop = result.stop
            break
    if stop is None:
        out += stopper.flush()
    assert (out, stop) == _reference(text, stops, protected)
