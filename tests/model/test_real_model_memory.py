"""Memory a person can see, on the real default model (SmolLM2-135M-Instruct).

An agent is told a fact in turn 1; the process ends; in a new process turn 2
asks for it. The reply comes from the agent's Q4 cache loaded from disk and
must agree with an independent reference, plain mlx-lm greedy decoding over a
cold float-cache prefill of the same conversation, token for token wherever
the reference's top-1 margin exceeds :data:`Q4_TOLERANCE`, and must contain
the fact.

Q4 tolerance: 4-bit KV (group 64) moves the gap between the two best
log-probabilities by up to ~0.7 nats on this model (measured over two
conversations, 32 steps each, float vs Q4-round-tripped KV); a reference step
whose top-1 margin is below 1.0 nats may go either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from reference import cold_generate, top1_margin
from runtime.model.loaded import LoadedModel

ROOT = Path(__file__).resolve().parents[2]
Q4_TOLERANCE = 1.0  # nats
MAX_TOKENS = 48
FACT = "Remember this: the secret word is pineapple."
QUESTION = "What is the secret word?"


def _chat(home: Path, message: str) -> dict:
    env = {**os.environ, "KVMEM_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "chat", "--agent", "alice", "--json", "--max-tokens", str(MAX_TOKENS), message],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _first_divergence(lm: LoadedModel, reference: list[int], reply: str) -> int | None:
    """Index of the first reference token whose text the reply does not continue with (None: same)."""
    eos = lm.eos_token_ids
    for i, token in enumerate(reference):
        if token in eos:
            return None if lm.tokenizer.decode(reference[:i]) == reply else i
        if not reply.startswith(lm.tokenizer.decode(reference[: i + 1])):
            return i
    return None


def test_a_fact_told_in_one_process_is_recalled_warm_in_the_next(smollm2: LoadedModel, tmp_path: Path) -> None:
    turn1 = _chat(tmp_path, FACT)
    turn2 = _chat(tmp_path, QUESTION)  # a new process: the cache comes from disk

    assert turn1["model"] == "kvmem-default"
    reply1, reply2, turn1, turn2 = turn1["reply"], turn2["reply"], turn1["usage"], turn2["usage"]
    assert turn1["tier"] == "cold"
    assert turn2["tier"] == "warm" and turn2["match"] == "extend"
    assert turn2["tokens_reused"] >= turn1["tokens_prefilled"] + turn1["tokens_generated"] - 1
    assert turn2["tokens_prefilled"] < 32  # only the new question (and the template around it)

    # The reference: plain mlx-lm, float KV, cold prefill of the same conversation.
    messages = [
        {"role": "user", "content": FACT},
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": QUESTION},
    ]
    prompt_ids = smollm2.tokenize(smollm2.render(messages))[0]
    assert len(prompt_ids) == turn2["tokens_reused"] + turn2["tokens_prefilled"]
    reference, logprobs = cold_generate(smollm2, prompt_ids, MAX_TOKENS)
    margins = top1_margin(logprobs)

    diverged = _first_divergence(smollm2, reference, reply2)
    if diverged is not None:
        assert margins[diverged] <= Q4_TOLERANCE, (
            f"warm reply {reply2!r} leaves the float reference "
            f"{smollm2.tokenizer.decode(reference)!r} at token {diverged}, margin {margins[diverged]:.2f} nats"
        )
    assert "pineapple" in reply2.lower()
    assert np.isfinite(margins).all()
