"""OutputSink: EOS, max_new_tokens and stop strings token by token; streaming deltas."""

from __future__ import annotations

import random

from specdecode.engine.output import OutputSink

WORDS = {0: "Hel", 1: "lo", 2: " wo", 3: "rld", 4: "!", 5: " S", 6: "TO", 7: "P", 8: "x"}


def words(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


# byte-level tokens, like a byte-fallback tokenizer: "é" = C3 A9 and "€" = E2 82 AC split over tokens
BYTES = {0: b"a", 1: b"b", 2: b"\xc3", 3: b"\xa9", 4: b"\xe2", 5: b"\x82", 6: b"\xac", 7: b" ", 8: b"ab", 9: b"\xa9b"}


def utf8(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def test_eos_ends_generation_and_is_kept():
    sink = OutputSink(words, eos_ids=[4], max_new_tokens=10)
    assert sink.push([0, 1, 4, 2, 3]) == 3
    assert sink.token_ids == [0, 1, 4]
    assert sink.finish_reason == "eos"
    assert sink.text == "Hello!"
    assert sink.push([0]) == 0


def test_max_new_tokens_cuts_inside_a_run():
    sink = OutputSink(words, eos_ids=[], max_new_tokens=3)
    assert sink.remaining == 3
    assert sink.push([0, 1]) == 2
    assert sink.remaining == 1 and sink.finish_reason is None
    assert sink.push([2, 3, 4]) == 1
    assert sink.token_ids == [0, 1, 2] and sink.finish_reason == "length" and sink.remaining == 0


def test_text_without_a_stop_string_is_the_whole_decode():
    sink = OutputSink(words, eos_ids=[], max_new_tokens=10, stop=("STOP",))
    sink.push([0, 1, 2, 3, 5, 6])
    assert sink.finish_reason is None
    assert sink.text == "Hello world STO"


def test_stop_string_spanning_tokens_is_cut_from_the_text():
    sink = OutputSink(words, eos_ids=[], max_new_tokens=10, stop=("o wo",))
    assert sink.push([0, 1, 2, 3, 4]) == 3  # " wo" completes "o wo"; later tokens are dropped
    assert sink.finish_reason == "stop"
    assert sink.token_ids == [0, 1, 2]
    assert sink.text == "Hell"


def test_stop_string_of_one_token_and_the_earliest_of_several():
    sink = OutputSink(words, eos_ids=[], max_new_tokens=10, stop=("!",))
    assert sink.push([0, 1, 4, 8]) == 3
    assert sink.text == "Hello"
    sink = OutputSink(words, eos_ids=[], max_new_tokens=10, stop=("rld", "llo w"))
    assert sink.push([0, 1, 2, 3]) == 3  # "llo w" completes first, with token 2
    assert sink.text == "He"
    sink = OutputSink(words, eos_ids=[], max_new_tokens=10, stop=("wor", "o"))
    assert sink.push([0, 1]) == 2
    assert sink.text == "Hell"


def test_stop_string_completed_by_the_last_token_allowed_reports_stop():
    sink = OutputSink(words, eos_ids=[], max_new_tokens=2, stop=("lo",))
    assert sink.push([0, 1, 2]) == 2
    assert sink.finish_reason == "stop" and sink.text == "Hel"


def test_stop_string_completed_by_the_last_byte_of_a_character():
    sink = OutputSink(utf8, eos_ids=[], max_new_tokens=10, stop=("aé",))
    assert sink.push([0, 2, 3, 1]) == 3
    assert sink.finish_reason == "stop" and sink.text == ""
    sink = OutputSink(utf8, eos_ids=[], max_new_tokens=10, stop=("€",))
    assert sink.push([0, 4, 5, 6, 1]) == 4
    assert sink.finish_reason == "stop" and sink.text == "a"


def test_streaming_holds_back_a_possible_stop_prefix():
    sink = OutputSink(words, eos_ids=[], max_new_tokens=10, stop=("STOP",))
    sink.push([0, 1])
    assert sink.take_delta() == "Hello"
    sink.push([5])
    assert sink.take_delta() == " "  # "S" could start "STOP"
    sink.push([6])
    assert sink.take_delta() == ""  # "STO" too
    sink.push([8])
    assert sink.take_delta() == "STOx"  # no longer
    sink.push([5, 6, 7])
    assert sink.finish_reason == "stop"
    assert sink.take_delta() == " "
    assert sink.text == "Hello STOx "


def test_streaming_holds_back_a_partial_character():
    sink = OutputSink(utf8, eos_ids=[], max_new_tokens=10)
    sink.push([0, 2])
    assert sink.text == "a\ufffd"
    assert sink.take_delta() == "a"
    sink.push([3])
    assert sink.take_delta() == "é"
    sink.push([4, 5])
    assert sink.take_delta() == ""
    sink.push([6])
    assert sink.take_delta() == "€"


def test_streaming_releases_everything_when_finished():
    sink = OutputSink(utf8, eos_ids=[], max_new_tokens=2)
    sink.push([0, 2])
    assert sink.finish_reason == "length"
    assert sink.take_delta() == "a\ufffd"  # the text is final: nothing more will complete it


def reference(tokens: list[int], decode, eos: set[int], max_new_tokens: int, stop: tuple[str, ...]):
    """Brute force: the first prefix that ends generation, and its text cut at the earliest stop string."""
    for n in range(1, len(tokens) + 1):
        text = decode(tokens[:n])
        hits = [i for s in stop for i in [text.find(s)] if i >= 0]
        if tokens[n - 1] in eos:
            return tokens[:n], text, "eos"
        if hits:
            return tokens[:n], text[: min(hits)], "stop"
        if n == max_new_tokens:
            return tokens[:n], text, "length"
    return tokens, decode(tokens), None


def test_random_streams_match_a_brute_force_reference():
    rng = random.Random(0)
    pieces = ["a", "b", "é", "€", " ", "ab", "aé"]
    for _ in range(400):
        tokens = [rng.randrange(len(BYTES)) for _ in range(rng.randrange(1, 25))]
        stop = tuple(rng.sample(pieces, rng.randrange(0, 3)))
        eos = {9} if rng.random() < 0.3 else set()
        max_new_tokens = rng.randrange(1, 30)
        sink = OutputSink(utf8, eos, max_new_tokens, stop)
        deltas, i = [], 0
        while i < len(tokens) and sink.finish_reason is None:
            run = rng.randrange(1, 6)  # pushed in runs, like accepted drafts
            sink.push(tokens[i : i + run])
            deltas.append(sink.take_delta())
            i += run
        expected_ids, expected_text, expected_reason = reference(tokens, utf8, eos, max_new_tokens, stop)
        case = (tokens, stop, eos, max_new_tokens)
        assert sink.token_ids == expected_ids, case
        assert sink.text == expected_text, case
        assert sink.finish_reason == expected_reason, case
        if sink.finish_reason is not None:
            assert "".join(deltas) == expected_text, case
        else:
            assert expected_text.startswith("".join(deltas)), case
