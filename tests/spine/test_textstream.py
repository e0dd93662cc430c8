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


def test_detokenizer_flushes_truncated_character():
    detok = IncrementalDetokenizer(ByteTokenizer())
    out = detok.push(list("ab".encode())) + detok.push([0xE2, 0x82])  # first 2 bytes of "€"
    assert out == "ab"
    assert detok.flush() == "\ufffd"


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
