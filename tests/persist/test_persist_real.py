"""Bytes written by real conversations, and shared prefixes stored once (tiny-llama)."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny
from runtime.execution.generate import generate
from runtime.persist import CacheDirectory
from runtime.execution.sequence import SequenceSampling

SYSTEM = " ".join(f"Rule {i}: answer briefly, cite the harbour log, and keep the ledger tidy." for i in range(60))


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_ten_turn_conversation_writes_at_most_1_2x_its_final_cache(tmp_path):
    lm = tiny("tiny-llama")
    store = CacheDirectory(tmp_path)
    messages = [{"role": "system", "content": "You keep a diary."}]
    cache, written = None, 0
    for turn in range(10):
        messages.append({"role": "user", "content": f"Day {turn}: the tide came in at {turn + 6} o'clock and the gulls were loud. " * 3})
        result = generate(lm, lm.render(messages), cache, SequenceSampling(max_tokens=40))
        messages.append({"role": "assistant", "content": result.reply})
        cache = result.cache
        written += store.save("diary", cache.to_snapshot()).bytes_written
    final = _disk_bytes(tmp_path)
    assert cache.num_tokens > 1000
    assert written <= 1.2 * final, (written, final)


def test_two_agents_with_the_same_system_prompt_store_its_blocks_once(tmp_path):
    lm = tiny("tiny-llama")
    store = CacheDirectory(tmp_path)
    system_tokens = len(lm.tokenize(SYSTEM)[0])
    assert system_tokens >= 1024
    reports = []
    for agent, question in (("a", "What is rule 3?"), ("b", "Summarize the rules, please.")):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        result = generate(lm, lm.render(msgs), None, SequenceSampling(max_tokens=8))
        reports.append(store.save(agent, result.cache.to_snapshot()))
    shared = system_tokens // 256
    assert reports[0].blocks_written >= shared
    assert reports[1].blocks_reused >= shared
    block_files = list((tmp_path / "blocks").rglob("*.safetensors"))
    assert len(block_files) == reports[0].blocks_written + reports[1].blocks_written
