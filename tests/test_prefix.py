"""Character-level prefix matching (pure Python)."""

from runtime.plan.prefix import MatchKind, match_prefix

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


def test_diverge_below_threshold_starts_cold():
    m = match_prefix(TEXT, OFFSETS, "Hello there")
    assert m.kind is MatchKind.DIVERGE and m.reuse_tokens == 0


def test_tokens_sharing_a_character_are_never_split():
    text = "a\u00e9b"  # é encoded as two byte tokens, both ending after é
    offsets = [1, 2, 2, 3]
    m = match_prefix(text, offsets, "a\u00e9X", partial_threshold=0.5)
    assert m.reuse_tokens == 3 and m.suffix("a\u00e9X") == "X"
    m = match_prefix(text, offsets, "a\u00e8", partial_threshold=0.3)
    assert m.reuse_tokens == 1 and m.suffix("a\u00e8") == "\u00e8"


def test_replacement_character_round_trip_matches():
    cached = "reply: \ufffd\ufffd ok"
    offsets = [6, 7, 8, 9, 12]
    m = match_prefix(cached, offsets, cached + " next")
    assert m.kind is MatchKind.EXTEND and m.reuse_tokens == 5
