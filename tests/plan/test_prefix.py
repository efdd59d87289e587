"""Character-level prefix matching (pure Python)."""

import os
import random

import pytest

from runtime.plan import prefix
from runtime.plan.prefix import MatchKind, common_prefix_length, match_prefix, word_start

TEXT = "Hello world, how are you?"
# tokens: "Hello" " world" "," " how" " are" " you" "?"
OFFSETS = [5, 11, 12, 16, 20, 24, 25]


def test_empty_cache_matches_nothing():
    m = match_prefix("", [], "anything")
    assert m.kind is MatchKind.EMPTY and m.reuse_tokens == 0


def test_extend_reuses_every_token_and_prefills_only_the_suffix():
    prompt = TEXT + " Fine, thanks."
    m = match_prefix(TEXT, OFFSETS, prompt)
    assert m.kind is MatchKind.EXTEND
    assert m.reuse_tokens == len(OFFSETS)
    assert m.suffix(prompt) == " Fine, thanks."


def test_exact_recomputes_only_the_last_token():
    m = match_prefix(TEXT, OFFSETS, TEXT)
    assert m.kind is MatchKind.EXACT
    assert m.reuse_tokens == len(OFFSETS) - 1
    assert m.suffix(TEXT) == "?"


def test_partial_trims_to_last_whole_token_inside_common_prefix():
    prompt = "Hello world, how are yo!!"  # differs inside " you"
    m = match_prefix(TEXT, OFFSETS, prompt)
    assert m.kind is MatchKind.PARTIAL
    assert m.reuse_tokens == 5  # up to " are"
    assert m.suffix(prompt) == " yo!!"


def test_any_common_prefix_is_reused_however_small_a_part_of_the_cache():
    """The seeds' rule discarded a cache the prompt kept less than 80% of: a compacted history (the system
    prompt kept, the conversation replaced) started cold. Every whole token before the parting word is kept."""
    m = match_prefix(TEXT, OFFSETS, "Hello there")
    assert m.kind is MatchKind.PARTIAL and m.reuse_tokens == 1 and m.suffix("Hello there") == " there"
    m = match_prefix(TEXT, OFFSETS, "Hello world,")  # a rewind to a prefix of the cache: all but its last token
    assert m.kind is MatchKind.PARTIAL and m.reuse_tokens == 2 and m.suffix("Hello world,") == ","


def test_nothing_in_common_or_no_whole_token_is_cold():
    assert match_prefix(TEXT, OFFSETS, "Goodbye").kind is MatchKind.DIVERGE
    m = match_prefix(TEXT, OFFSETS, "Help")  # "Hel" in common, inside the first token
    assert m.kind is MatchKind.DIVERGE and m.reuse_tokens == 0 and m.common_chars == 3


def test_a_cut_inside_a_word_backs_off_to_the_words_start():
    """Where the texts part inside a word, the suffix starts at the word's leading space, so it tokenizes as
    a cold prefill of the whole prompt does (the word's first tokens would otherwise end where they part)."""
    text = "the capital of France"
    offsets = [3, 11, 14, 18, 21]  # "the" " capital" " of" " Fr" "ance"
    m = match_prefix(text, offsets, "the capital of Francis?")
    assert m.reuse_tokens == 3 and m.suffix("the capital of Francis?") == " Francis?"
    assert word_start("abc def", 6) == 3 and word_start("abc def", 3) == 3
    assert word_start("x" * 200, 150) == 150  # no whitespace within WORD_BACKOFF: cut where they part


def test_replacement_character_round_trip_matches():
    cached = "reply: \ufffd\ufffd ok"
    offsets = [6, 7, 8, 9, 12]
    m = match_prefix(cached, offsets, cached + " next")
    assert m.kind is MatchKind.EXTEND and m.reuse_tokens == 5


@pytest.mark.parametrize("kind", ["str", "ids"])
def test_common_prefix_length_agrees_with_os_path_at_every_cut(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against ``os.path.commonprefix`` (the reference, one item at a time): equal, a prefix of the other,
    a difference at each place around and inside a block, empty; a tuple against a list of the same ids."""
    monkeypatch.setattr(prefix, "PREFIX_BLOCK", 16)  # several blocks in a short text
    rng = random.Random(0)
    base = "".join(rng.choice("ab\u00e9\ufffd ") for _ in range(100)) if kind == "str" else [rng.randrange(5) for _ in range(100)]
    cases = [(base, base), (base, base[:0]), (base[:37], base), (base, base[:64])]
    for cut in [*range(0, 20), 31, 32, 33, 47, 48, 49, 63, 64, 65, 99]:
        other = base[:cut] + ("z" if kind == "str" else [9]) + base[cut + 1 :]
        cases += [(base, other), (other[: cut + 3], base)]
    for a, b in cases:
        want = len(os.path.commonprefix([a, b]))
        assert common_prefix_length(a, b) == want
        assert common_prefix_length(b, a) == want
        if kind == "ids":
            assert common_prefix_length(tuple(a), list(b)) == want


def test_a_long_conversations_match_reads_blocks_not_characters() -> None:
    """A 16K-token conversation's text (~100,000 characters) extended by a question, and the same with one
    character changed near the end: a few dozen slices read, where ``os.path.commonprefix`` indexes every
    character in Python (about 3 ms a turn on an H200's host, before the turn reaches the model)."""

    class Counted(str):
        reads = 0

        def __getitem__(self, key):  # noqa: ANN001, ANN204 - str's own signature
            Counted.reads += 1
            return str.__getitem__(self, key)

    text = "".join(f"note{i % 97} was kept. " for i in range(5000))
    prompt = text + "\n\nUser: and then?\nAssistant:"
    changed = text[:-10] + "X" + text[-9:]
    assert common_prefix_length(Counted(text), Counted(prompt)) == len(text)
    assert Counted.reads <= 2 * (len(text) // prefix.PREFIX_BLOCK + 1)
    Counted.reads = 0
    assert common_prefix_length(Counted(text), Counted(changed)) == len(text) - 10
    assert Counted.reads <= 2 * (len(text) // prefix.PREFIX_BLOCK + 1 + 12)
