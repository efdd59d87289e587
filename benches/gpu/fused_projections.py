"""Fused projections: plain mlx-lm's first token and decode rate with a layer's projections fused and not.

The ``fused_projections`` setting (:mod:`runtime.model.fused_projections`) runs a llama or qwen2
layer's query, key and value projections as one product and its MLP's gate and up projections as
another: four products a layer instead of seven. It is meant for a GPU's host (every product of two or
more rows costs MLX's CUDA backend a cuBLASLt algorithm lookup); this bench measures what it does to
the same model where it runs now, so the setting's CPU cost is a number, not a guess.

Each model is loaded twice by mlx-lm from the same folder, one copy fused; the two take turns
(``benches.gpu.gpu.mlx_lm_turn``: ``generate_step``, greedy, the same prompt), medians of ``--repeats``; first
token (tokenizing and the prompt's prefill, mlx-lm's chunks) and decode tokens/s after it, and the largest difference between the two
copies' first logits. Models: ``micro`` (1 layer, 64 wide: a step's time is the host's, as a small
model's is on a fast GPU), ``tiny-llama`` and ``kvmem-default`` (SmolLM2-135M, float32, 30 layers).
Here (2-core CPU)::

    .venv/bin/python -m benches fused_projections
"""

from __future__ import annotations

from typing import Any

import runtime  # noqa: F401  (OpenBLAS before mlx)
from benches import harness
from benches.speed.decode_runs import _folder
from benches.gpu.gpu import mlx_lm_turn
from benches.harness import ResultFile, log, median, table

MODELS = ("micro", "tiny-llama", "kvmem-default")
PROMPT = "The harbour master kept a ledger of ships, and every evening he wrote down who came in. "


def _first_logits_diff(plain: Any, fused: Any, ids: Any) -> float:
    import mlx.core as mx

    a, b = plain(ids[None]), fused(ids[None])
    return float(mx.abs(a - b).max().item())


def measure(name: str, prompt_copies: int, tokens: int, repeats: int) -> dict[str, Any]:
    """The two copies of ``name`` side by side (see the module docstring)."""
    import mlx.core as mx
    from mlx_lm import load

    from runtime.model.fused_projections import fuse_projections

    folder = str(_folder(name))
    plain, tokenizer = load(folder)
    fused = load(folder)[0]
    groups = fuse_projections(fused)
    text = PROMPT * prompt_copies
    ids = mx.array(tokenizer.encode(text, add_special_tokens=False))
    diff = _first_logits_diff(plain, fused, ids)
    samples: dict[str, list[tuple[float, float]]] = {"plain": [], "fused": []}
    for copy in (plain, fused):
        mlx_lm_turn(copy, tokenizer, text, 8)  # warm-up
    for r in range(repeats):
        order = (("plain", plain), ("fused", fused)) if r % 2 == 0 else (("fused", fused), ("plain", plain))
        for label, copy in order:
            turn = mlx_lm_turn(copy, tokenizer, text, tokens)
            samples[label].append((turn.ttft_ms, turn.decode_tps))
    return {"model": name, "groups": groups, "prompt_tokens": int(ids.size), "tokens": tokens, "max_diff": diff,
            **{f"{label}_{what}": [s[k] for s in got] for label, got in samples.items()
               for k, what in enumerate(("ttft_ms", "decode_tps"))}}


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, repeats=6, quick_repeats=2)
    p.add_argument("--models", nargs="+", choices=MODELS, help="only these models")
    args = p.parse_args(argv)
    repeats = harness.repeats(args, full=6, quick=2)
    res = ResultFile("fused_projections", "Fused projections: plain mlx-lm with a layer's projections fused and not",
                     args.quick, argv or [], model=None,
                     setup=["each model loaded twice by mlx-lm from one folder, one copy fused "
                            "(`runtime.model.fused_projections.fuse_projections`); `generate_step`, greedy, the same "
                            f"prompt, the copies alternating; {repeats} turns each, medians"])
    rows, points = [], []
    for name in args.models or MODELS:
        small = name == "kvmem-default"
        got = measure(name, 4 if args.quick else (12 if small else 24), 16 if args.quick else (64 if small else 400),
                      repeats)
        res.record(**got)
        ttft = {k: median(got[f"{k}_ttft_ms"]) for k in ("plain", "fused")}
        tps = {k: median(got[f"{k}_decode_tps"]) for k in ("plain", "fused")}
        log(f"{name}: first token {ttft['plain']:.1f} / {ttft['fused']:.1f} ms, decode {tps['plain']:.1f} / "
            f"{tps['fused']:.1f} tok/s, max |logit diff| {got['max_diff']:.2g}")
        rows.append([f"`{name}`", str(got["groups"]), str(got["prompt_tokens"]), f"{ttft['plain']:.1f}",
                     f"{ttft['fused']:.1f} ({ttft['fused'] / ttft['plain']:.2f}x)", str(got["tokens"]),
                     f"{tps['plain']:.1f}", f"{tps['fused']:.1f} ({tps['fused'] / tps['plain']:.2f}x)",
                     f"{got['max_diff']:.2g}"])
        points.append((name, ttft["plain"] / ttft["fused"], tps["fused"] / tps["plain"]))
    res.body += ["## Plain and fused, side by side (medians)", "",
                 *table(["model", "groups fused", "prompt tokens", "first token ms, plain", "fused",
                         "tokens", "decode tok/s, plain", "fused", "max |first logits diff|"], rows), ""]
    _plot(res, points)
    print(res.write(plot=True).read_text())


def _plot(res: ResultFile, points: list[tuple[str, float, float]]) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.38
    for i, (_, first, decode) in enumerate(points):
        ax.bar(i - width / 2, first, width, color="#d98c3a", label="first token: plain / fused" if i == 0 else None)
        ax.bar(i + width / 2, decode, width, color="#3a7dd9", label="decode tok/s: fused / plain" if i == 0 else None)
    ax.set_xticks(range(len(points)), [p[0] for p in points])
    ax.axhline(1.0, color="#444444", linewidth=0.8)
    ax.set_ylabel("fused against plain (above 1: fused faster)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    ax.set_title("Fused projections on this machine (plain mlx-lm, both copies)")
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main()
