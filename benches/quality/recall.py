"""Which facts the default model recalls after a restart, through kvmem's warm path.

Each case tells an agent a fact in turn 1, closes the runtime (as a restart
does: every cache flushed to disk), opens a new one and asks for the fact in
turn 2, which is served from the agent's Q4 cache on disk (``tier == warm``).
Next to it runs plain mlx-lm with a float cache over the same conversation
(cold prefill, greedy): the independent reference. A case counts as recalled
when the answer contains the expected word; the table shows both answers, so
a miss can be told apart from a KV-cache error (kvmem and the reference miss
together) — a 135M model simply cannot do some of these.

Run: ``python -m benches recall`` (~3 min on 2 cores).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from benches import harness

CASES: list[tuple[str, str, str, str]] = [
    # kind, turn 1, turn 2, expected word in the answer
    ("secret word", "Remember this: the secret word is pineapple.", "What is the secret word?", "pineapple"),
    ("password", "Please remember that my password is tulip42.", "What is my password?", "tulip42"),
    ("pet's name", "I have a dog called Biscuit.", "What is my dog called?", "biscuit"),
    ("home city", "Hi, my name is Alice and I live in Paris.", "Where do I live?", "paris"),
    ("own name", "My name is Alice.", "What is my name?", "alice"),
    ("favourite colour", "Hello! My favourite colour is green.", "What is my favourite colour?", "green"),
    ("job", "I work as a nurse in a big hospital.", "What is my job?", "nurse"),
    ("number", "My lucky number is 17.", "What is my lucky number?", "17"),
    ("meeting day", "Our team meeting is on Thursday.", "Which day is our team meeting?", "thursday"),
    ("food", "My favourite food is sushi.", "What is my favourite food?", "sushi"),
]
MAX_TOKENS = 40


async def _turn(home: Path, agent: str, messages: list[dict[str, str]]) -> Any:
    from actors import open_runtime

    async with open_runtime(model="kvmem-default", home=home, models_dir=harness.BENCH_HOME / "models", prewarm_mb=0,
                            handle_signals=False) as rt:
        return await rt.agent(agent).send(messages, max_tokens=MAX_TOKENS)


def _reference(lm: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[float]]:
    """Greedy tokens of plain mlx-lm over a cold float cache, with each step's top-1 margin (nats)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, margins = [], []
    for token, logprobs in generate_step(mx.array(lm.tokenize(lm.render(messages))[0]), lm.model,
                                         max_tokens=MAX_TOKENS):
        top2 = mx.topk(logprobs.astype(mx.float32).reshape(-1), 2).tolist()
        tokens.append(int(token))
        margins.append(abs(top2[1] - top2[0]))
        if int(token) in lm.eos_token_ids:
            break
    return tokens, margins


def _divergence(lm: Any, tokens: list[int], reply: str) -> int | None:
    """First reference token the reply does not continue with (None: the same reply)."""
    for i, token in enumerate(tokens):
        if token in lm.eos_token_ids:
            return None if lm.tokenizer.decode(tokens[:i]) == reply else i
        if not reply.startswith(lm.tokenizer.decode(tokens[: i + 1])):
            return i
    return None


def main(argv: list[str]) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    import runtime  # noqa: F401  (OpenBLAS before MLX)
    from runtime.model.loaded import load_model

    res = harness.ResultFile("recall", "Fact recall after a restart on kvmem-default (warm Q4 cache vs float reference)",
                             args.quick, argv)
    res.setup.append("each case: turn 1 in one runtime, runtime closed, turn 2 in a new runtime (warm from disk); "
                     f"greedy, at most {MAX_TOKENS} new tokens; reference: mlx_lm.generate, float KV, cold prefill")
    lm = load_model("kvmem-default", models_dir=harness.BENCH_HOME / "models")
    rows, recalled, reference_recalled, agree, worst = [], 0, 0, 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (kind, fact, question, expected) in enumerate(CASES[:3] if args.quick else CASES):
            agent = f"recall-{i}"
            first = [{"role": "user", "content": fact}]
            turn1 = trio.run(_turn, Path(tmp), agent, first)
            second = [*first, {"role": "assistant", "content": turn1.reply}, {"role": "user", "content": question}]
            turn2 = trio.run(_turn, Path(tmp), agent, second)
            tokens, margins = _reference(lm, second)
            reference = lm.tokenizer.decode([t for t in tokens if t not in lm.eos_token_ids])
            diverged = _divergence(lm, tokens, turn2.reply)
            hit, ref_hit = expected in turn2.reply.lower(), expected in reference.lower()
            recalled += hit
            reference_recalled += ref_hit
            agree += diverged is None
            worst = max(worst, margins[diverged] if diverged is not None else 0.0)
            harness.log(f"{kind}: {turn2.usage.tier} hit={hit} ref={ref_hit} diverged={diverged}")
            where = "same" if diverged is None else f"token {diverged}, margin {margins[diverged]:.2f}"
            rows.append([kind, turn2.usage.tier, f"{turn2.usage.tokens_reused}/{turn2.usage.tokens_prefilled}",
                         "yes" if hit else "no", "yes" if ref_hit else "no", where,
                         turn2.reply.replace("\n", " ").replace("|", "/")[:90]])
            res.record(kind=kind, fact=fact, question=question, turn1=turn1.reply, turn2=turn2.reply,
                       reference=reference, diverged=diverged, tier=turn2.usage.tier, reused=turn2.usage.tokens_reused,
                       prefilled=turn2.usage.tokens_prefilled)
    n = len(rows)
    res.body += [
        f"**Recalled {recalled}/{n} after a restart (warm Q4 cache); the float-cache reference recalls "
        f"{reference_recalled}/{n}; answers identical to the reference in {agree}/{n}.**",
        "",
        f"Where an answer leaves the reference, the reference's top-1 margin there is at most {worst:.2f} nats: "
        "a near-tie that 4-bit KV may tip either way (the stated Q4 tolerance is 1.0 nats, "
        "tests/model/test_real_model_memory.py). Whether the fact is recalled then depends on the branch taken, "
        "so kvmem and the reference can recall different cases.",
        "",
        *harness.table(["fact", "turn-2 tier", "reused/prefilled", "kvmem recalls", "reference recalls",
                        "first divergence from the reference", "kvmem's answer (turn 2)"], rows, align="llrllll"),
    ]
    print(res.write())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
