"""Grammar engines for constrained decoding: llguidance vs outlines-core on kvmem-default's tokenizer.

Issue 29 asks for constrained decoding with a well-kept grammar engine, measured
and picked, with no hand-written JSON state machine. This bench measures the
candidates side by side in one process, on the real SmolLM2 tokenizer (49,152 tokens):

1. **Vocabulary preparation**: llguidance's ``llguidance.hf.from_tokenizer`` (a
   token trie from the fast tokenizer) and an outlines-core ``Vocabulary`` built
   from the same tokenizer as outlines-core's own ``Vocabulary.from_pretrained``
   builds it (byte-level tokens decoded to their bytes; EOS and special tokens
   left out), timed including the Python walk over the vocabulary.
2. **Grammar compile** of four JSON schemas: tool calls for 2 small tools, tool
   calls for 15 Claude-Code-shaped tools (nested parameters: enums, integers,
   booleans, arrays of objects, optional fields), OpenAI's ``json_object``
   (``{"type": "object"}``) and a strict ``json_schema``. Each repeat compiles
   from scratch (neither engine caches grammars across calls): llguidance
   ``grammar_from_json_schema`` + ``LLMatcher``; outlines-core
   ``build_regex_from_schema`` + ``Index`` (the whole token-level DFA, eagerly).
   *first mask* is the first mask computed after compiling (llguidance builds
   its lexer lazily, so part of its work lands there).
3. **Per-token mask time** while consuming a valid JSON instance token by token
   (the model tokenizer's own tokens): a mask before every token and before the
   end, then the token is consumed; median and p95 in microseconds over all
   tokens of all repeats. For llguidance also the batched path a decode step
   uses: 8 matchers at once through one ``LLExecutor``
   (``llguidance.numpy.fill_next_token_bitmask_par``), per step and per row.
4. **Sanity**: the valid instance must be accepted (every token inside the mask,
   accepting at the end) and an invalid one rejected.
5. **Install footprint**: each engine's wheel for this platform, fetched with
   ``pip download --no-deps`` (wheel bytes, unpacked bytes, Requires-Dist read
   from its METADATA). xgrammar is only downloaded, not installed or measured:
   its metadata requires torch (and triton on Linux x86_64).

Whitespace: llguidance gets ``{"whitespace_flexible": false, "item_separator":
", ", "key_separator": ": ", "lenient": true}``; outlines-core, which cannot fix
separators, gets ``whitespace_pattern="[ ]?"`` (its default). The instances are
written with ``json.dumps`` defaults (", " and ": "), which both accept.
outlines-core is not a kvmem dependency and is imported lazily; without it the
bench measures llguidance alone and says so (``pip install outlines-core``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benches import harness
from benches.harness import ResultFile, log, median, table

LLG_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
OUTLINES_WHITESPACE = "[ ]?"
BATCH = 8
INSTALL_HINT = "pip install outlines-core"
#: Wheels whose footprint is reported (name, version): the two measured engines and xgrammar.
WHEELS = (("llguidance", None), ("outlines-core", None), ("xgrammar", "0.2.8"))

# ---- schemas ------------------------------------------------------------------------------------

STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}


def _obj(props: dict[str, Any], required: list[str], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False, **extra}


SMALL_TOOLS = {
    "get_weather": _obj({"location": STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                        ["location"]),
    "get_time": _obj({"timezone": STR}, ["timezone"]),
}

_EDIT = _obj({"old_string": STR, "new_string": STR, "replace_all": BOOL}, ["old_string", "new_string"])
CLAUDE_CODE_TOOLS = {
    "Bash": _obj({"command": STR, "timeout": {"type": "integer", "maximum": 600000}, "description": STR,
                  "run_in_background": BOOL}, ["command"]),
    "Read": _obj({"file_path": STR, "offset": INT, "limit": INT}, ["file_path"]),
    "Write": _obj({"file_path": STR, "content": STR}, ["file_path", "content"]),
    "Edit": _obj({"file_path": STR, "old_string": STR, "new_string": STR, "replace_all": BOOL},
                 ["file_path", "old_string", "new_string"]),
    "MultiEdit": _obj({"file_path": STR, "edits": {"type": "array", "minItems": 1, "items": _EDIT}},
                      ["file_path", "edits"]),
    "Glob": _obj({"pattern": STR, "path": STR}, ["pattern"]),
    "Grep": _obj({"pattern": STR, "path": STR, "glob": STR,
                  "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
                  "-B": INT, "-A": INT, "-C": INT, "-n": BOOL, "-i": BOOL, "type": STR, "head_limit": INT,
                  "multiline": BOOL},
                 ["pattern"]),
    "LS": _obj({"path": STR, "ignore": {"type": "array", "items": STR}}, ["path"]),
    "WebFetch": _obj({"url": {"type": "string", "format": "uri"}, "prompt": STR}, ["url", "prompt"]),
    "WebSearch": _obj({"query": {"type": "string", "minLength": 2}, "allowed_domains": {"type": "array", "items": STR},
                       "blocked_domains": {"type": "array", "items": STR}}, ["query"]),
    "TodoWrite": _obj({"todos": {"type": "array", "items": _obj(
        {"content": {"type": "string", "minLength": 1},
         "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
         "activeForm": {"type": "string", "minLength": 1}}, ["content", "status", "activeForm"])}}, ["todos"]),
    "Task": _obj({"description": STR, "prompt": STR, "subagent_type": STR}, ["description", "prompt", "subagent_type"]),
    "NotebookEdit": _obj({"notebook_path": STR, "cell_id": STR, "new_source": STR,
                          "cell_type": {"type": "string", "enum": ["code", "markdown"]},
                          "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
                         ["notebook_path", "new_source"]),
    "ExitPlanMode": _obj({"plan": STR}, ["plan"]),
    "BashOutput": _obj({"bash_id": STR, "filter": STR}, ["bash_id"]),
}


def tool_call_schema(tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema kvmem constrains a tool-calling turn to: one or more ``{"name", "arguments"}`` calls."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        _obj({"name": {"const": name}, "arguments": params}, ["name", "arguments"])
        for name, params in tools.items()]}}


STRICT_SCHEMA = _obj({
    "customer": _obj({"name": STR, "email": STR, "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]}},
                     ["name", "email", "tier"]),
    "items": {"type": "array", "items": _obj({"sku": STR, "quantity": {"type": "integer", "minimum": 1},
                                              "unit_price": {"type": "number"}}, ["sku", "quantity", "unit_price"])},
    "priority": {"type": "string", "enum": ["low", "normal", "high"]},
    "gift": BOOL,
}, ["customer", "items", "priority", "gift"])


@dataclass(frozen=True)
class Case:
    """One grammar: its schema, a valid instance and an invalid one."""

    name: str
    schema: dict[str, Any]
    valid: Any
    invalid: Any
    why_invalid: str


CASES = (
    Case("tools-2", tool_call_schema(SMALL_TOOLS),
         [{"name": "get_weather", "arguments": {"location": "Lisbon, Portugal", "unit": "celsius"}},
          {"name": "get_time", "arguments": {"timezone": "Europe/Lisbon"}}],
         [{"name": "get_stock_price", "arguments": {"ticker": "ACME"}}], "unknown tool name"),
    Case("tools-15", tool_call_schema(CLAUDE_CODE_TOOLS),
         [{"name": "Grep", "arguments": {"pattern": "def load_model", "path": "runtime", "output_mode": "content",
                                         "-C": 2, "-n": True, "head_limit": 40}},
          {"name": "MultiEdit", "arguments": {"file_path": "/work/main/runtime/model/loaded.py", "edits": [
              {"old_string": "weights: str = \"auto\"", "new_string": "weights: str = \"float32\""},
              {"old_string": "numpy_attention: bool = True", "new_string": "numpy_attention: bool = False",
               "replace_all": True}]}},
          {"name": "TodoWrite", "arguments": {"todos": [
              {"content": "Benchmark grammar engines", "status": "completed",
               "activeForm": "Benchmarking grammar engines"},
              {"content": "Wire llguidance into the sampler", "status": "in_progress",
               "activeForm": "Wiring llguidance into the sampler"}]}},
          {"name": "Bash", "arguments": {"command": "python -m pytest tests/reply/test_tool_calls.py -q",
                                         "timeout": 120000, "description": "Run the tool-call tests"}}],
         [{"name": "Grep", "arguments": {"pattern": "TODO", "output_mode": "lines"}}], "enum value not allowed"),
    Case("json_object", {"type": "object"},
         {"plan": ["read the schema", "write the bench"], "done": False, "steps": 2,
          "owner": {"name": "kvmem", "tags": ["llm", "kv-cache"]}, "note": None},
         [1, 2, 3], "an array where an object is required"),
    Case("strict", STRICT_SCHEMA,
         {"customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
          "items": [{"sku": "KV-4", "quantity": 2, "unit_price": 19.5},
                    {"sku": "Q4-GRP64", "quantity": 1, "unit_price": 120.0}],
          "priority": "high", "gift": False},
         {"customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"}, "items": [],
          "priority": "urgent", "gift": False}, "enum value not allowed"),
)

# ---- engines ------------------------------------------------------------------------------------


def _bit(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


class LLGuidanceEngine:
    """llguidance: an Earley parser over a lazily built lexer DFA, masks computed on demand."""

    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, n_vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab)
        self.words = (n_vocab + 31) // 32

    def compile(self, schema: dict[str, Any]) -> str:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=LLG_OPTIONS)
        return str(grammar)

    def matcher(self, compiled: str) -> Any:
        m = self.ll.LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def mask(self, state: Any, out: np.ndarray) -> None:
        state.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def consume(self, state: Any, token: int) -> bool:
        return bool(state.consume_token(token)) and not state.is_error()

    def accepting(self, state: Any) -> bool:
        return bool(state.is_accepting())


class OutlinesCoreEngine:
    """outlines-core: the schema becomes one regex, compiled eagerly into a token-level DFA (``Index``)."""

    name = "outlines-core"

    def __init__(self, hf_tokenizer: Any, n_vocab: int) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_vocabulary(outlines_core, hf_tokenizer)
        self.words = (n_vocab + 31) // 32

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), OUTLINES_WHITESPACE)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, state: Any, out: np.ndarray) -> None:
        state.write_mask_into(out.ctypes.data, out.size, 4)

    def consume(self, state: Any, token: int) -> bool:
        if not state.accepts_tokens([token]):
            return False
        state.advance(token, False)
        return True

    def accepting(self, state: Any) -> bool:
        return bool(state.is_finished())


def outlines_vocabulary(oc: Any, hf_tokenizer: Any) -> Any:
    """An outlines-core ``Vocabulary`` built as its ``from_pretrained`` builds one, from a loaded tokenizer.

    ``from_pretrained`` downloads from the Hub; this does its work locally: every
    byte-level BPE token decoded to its bytes, non-special added tokens as their
    text, EOS and special tokens left out (none belongs inside JSON).
    """
    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    backend = hf_tokenizer.backend_tokenizer
    eos = hf_tokenizer.eos_token_id
    special = {t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special}
    tokens: dict[bytes, list[int]] = {}
    for text, tid in backend.get_vocab(with_added_tokens=False).items():
        if tid == eos or text in special:
            continue
        tokens.setdefault(bytes(byte_of[ch] for ch in text), []).append(tid)
    for tid, added in hf_tokenizer.added_tokens_decoder.items():
        if not added.special and tid != eos:
            tokens.setdefault(added.content.encode(), []).append(tid)
    return oc.Vocabulary(eos, tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table that byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# ---- measurements -------------------------------------------------------------------------------


@dataclass
class Cell:
    """One engine x one grammar, measured in its own process: times in seconds, sanity, memory."""

    engine: str = ""
    grammar: str = ""
    prep_s: float = 0.0
    compile_s: list[float] = field(default_factory=list)
    first_mask_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    batch_step_s: list[float] = field(default_factory=list)
    batch_seq_s: list[float] = field(default_factory=list)
    rss_base_mib: float = 0.0
    rss_peak_mib: float = 0.0
    killed_after_s: float = 0.0
    tokens: int = 0
    substituted: int = 0
    valid_ok: bool = False
    invalid_rejected: bool = False
    invalid_why: str = ""
    note: str = ""


@dataclass
class Walk:
    """One instance emitted token by token: the tokens, how many the mask changed, the verdict."""

    tokens: list[int] = field(default_factory=list)
    substituted: int = 0
    accepted: bool = False
    why: str = ""


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95)) if values else float("nan")


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


@dataclass
class Vocab:
    """What the walk needs from the tokenizer: encode text, and each token id's bytes."""

    encode: Callable[[str], list[int]]
    token_bytes: list[bytes]


def walk(engine: Any, compiled: Any, text: str, vocab: Vocab, cell: Cell | None = None) -> Walk:
    """Emit ``text`` under the engine's constraint, a mask before every token and before the end.

    The sampler takes the tokenizer's next token for the rest of the text when the
    mask allows it; where the mask leaves it out (llguidance forces the canonical
    tokens of bytes the grammar fixes, see its docs/fast_forward.md) it takes the
    longest allowed token that spells the next bytes, and tokenizes the rest again.
    Mask times go to ``cell``.
    """
    state = engine.matcher(compiled)
    mask = np.zeros(engine.words, dtype=np.int32)
    rest = text.encode()
    plan = vocab.encode(text)
    out = Walk()
    while rest:
        t0 = time.perf_counter()
        engine.mask(state, mask)
        dt = time.perf_counter() - t0
        if cell is not None:
            cell.mask_s.append(dt)
        tok = plan[0] if plan and _bit(mask, plan[0]) else -1
        if tok < 0:
            spelled = [t for t in allowed_ids(mask).tolist()
                       if vocab.token_bytes[t] and rest.startswith(vocab.token_bytes[t])]
            if not spelled:
                out.why = f"at byte {len(text.encode()) - len(rest)}: no allowed token spells {rest[:12]!r}"
                return out
            tok = max(spelled, key=lambda t: len(vocab.token_bytes[t]))
            out.substituted += 1
        if not engine.consume(state, tok):
            out.why = f"token {tok} in the mask but refused"
            return out
        out.tokens.append(tok)
        rest = rest[len(vocab.token_bytes[tok]):]
        plan = plan[1:] if plan and tok == plan[0] else vocab.encode(rest.decode(errors="replace"))
    t0 = time.perf_counter()
    engine.mask(state, mask)
    if cell is not None:
        cell.mask_s.append(time.perf_counter() - t0)
    out.accepted = engine.accepting(state)
    out.why = "" if out.accepted else "not accepting at the end"
    return out


def measure(engine: Any, case: Case, vocab: Vocab, reps: int, cell: Cell, budget_s: float) -> list[int]:
    """Compile up to ``reps`` times from scratch (fewer where the next one would pass ``budget_s``),
    walk the valid instance ``reps`` times, try the invalid one; returns the valid walk's tokens."""
    compiled = None
    start = time.perf_counter()
    for r in range(reps):
        if r and time.perf_counter() - start + median(cell.compile_s) > budget_s:
            break
        t0 = time.perf_counter()
        compiled = engine.compile(case.schema)
        state = engine.matcher(compiled)
        t1 = time.perf_counter()
        engine.mask(state, np.zeros(engine.words, dtype=np.int32))
        cell.first_mask_s.append(time.perf_counter() - t1)
        cell.compile_s.append(t1 - t0)
    first = walk(engine, compiled, json.dumps(case.valid), vocab)
    cell.valid_ok, cell.tokens, cell.substituted = first.accepted, len(first.tokens), first.substituted
    if not first.accepted:
        cell.note = f"valid instance refused: {first.why}"
    for _ in range(reps):
        walk(engine, compiled, json.dumps(case.valid), vocab, cell)
    bad = walk(engine, compiled, json.dumps(case.invalid), vocab)
    cell.invalid_rejected = not bad.accepted
    cell.invalid_why = bad.why
    return first.tokens


def measure_batched(engine: LLGuidanceEngine, case: Case, tokens: list[int],
                    reps: int) -> tuple[list[float], list[float]]:
    """``BATCH`` matchers emitting the same ``tokens`` in lockstep: one ``LLExecutor`` call per step
    (``fill_next_token_bitmask_par``), next to ``BATCH`` single mask calls on the same matchers."""
    from llguidance.numpy import fill_next_token_bitmask_par

    executor = engine.ll.LLExecutor()
    compiled = engine.compile(case.schema)
    par_s: list[float] = []
    seq_s: list[float] = []
    for _ in range(reps):
        for times in (par_s, seq_s):
            matchers = [engine.matcher(compiled) for _ in range(BATCH)]
            masks = np.zeros((BATCH, engine.words), dtype=np.int32)
            for tok in [*tokens, None]:
                t0 = time.perf_counter()
                if times is par_s:
                    fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], masks)
                else:
                    for i, m in enumerate(matchers):
                        engine.mask(m, masks[i])
                times.append(time.perf_counter() - t0)
                if tok is not None and not all(_bit(masks[i], tok) and engine.consume(m, tok)
                                               for i, m in enumerate(matchers)):
                    raise RuntimeError(f"batched walk of {case.name} refused token {tok}")
    return par_s, seq_s


# ---- install footprint --------------------------------------------------------------------------


def wheel_footprint(name: str, version: str | None) -> list[str]:
    """``[wheel, MiB, unpacked MiB, Requires-Dist]`` of ``name``'s wheel for this platform."""
    from importlib import metadata

    if version is None:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return [name, "not installed", "", ""]
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "-d", tmp, f"{name}=={version}"]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or not wheels:
            return [f"{name} {version}", "pip download failed", "", (got.stderr.strip().splitlines() or [""])[-1]]
        whl = wheels[0]
        with zipfile.ZipFile(whl) as zf:
            unpacked = sum(i.file_size for i in zf.infolist())
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
        requires = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]
        runtime_deps = [r for r in requires if "extra ==" not in r]
        return [f"`{whl.name}`", f"{whl.stat().st_size / 2**20:.2f}", f"{unpacked / 2**20:.2f}",
                ", ".join(f"`{r}`" for r in runtime_deps) or "none"]


# ---- one cell per process -----------------------------------------------------------------------

ENGINES: dict[str, type[LLGuidanceEngine] | type[OutlinesCoreEngine]] = {
    "llguidance": LLGuidanceEngine, "outlines-core": OutlinesCoreEngine}


def _rss_mib(pid: int | str = "self", field_name: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``) or its peak since exec (``VmHWM``), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_cell(engine_name: str, case_name: str, *, tokenizer_dir: str, n_vocab: int, reps: int,
             budget_s: float) -> Cell:
    """Measure one engine on one grammar in this (fresh) process: preparation, compiles, walks."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    case = next(c for c in CASES if c.name == case_name)
    cell = Cell(engine=engine_name, grammar=case_name)
    t0 = time.perf_counter()
    engine = ENGINES[engine_name](hf, n_vocab)
    cell.prep_s = time.perf_counter() - t0
    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    token_bytes = [b""] * n_vocab
    for text, tid in hf.backend_tokenizer.get_vocab(with_added_tokens=False).items():
        token_bytes[tid] = bytes(byte_of[ch] for ch in text)
    for tid in hf.added_tokens_decoder:
        token_bytes[tid] = b""  # special tokens spell nothing a JSON text needs
    vocab = Vocab(encode=lambda text: hf.encode(text, add_special_tokens=False), token_bytes=token_bytes)
    cell.rss_base_mib = _rss_mib()
    tokens = measure(engine, case, vocab, reps, cell, budget_s)
    if isinstance(engine, LLGuidanceEngine) and cell.valid_ok:
        cell.batch_step_s, cell.batch_seq_s = measure_batched(engine, case, tokens, reps)
    cell.rss_peak_mib = _rss_mib(field_name="VmHWM")  # ru_maxrss would carry the parent's peak over exec
    return cell


def spawn_cell(engine_name: str, case_name: str, *, tokenizer_dir: str, n_vocab: int, reps: int,
               budget_s: float, max_rss_mib: float) -> Cell:
    """:func:`run_cell` in a child process, killed (and reported) if it outlives ``budget_s`` plus slack
    or grows past ``max_rss_mib`` resident (the machine is shared)."""
    cmd = [sys.executable, "-m", "benches.speed.grammar_engines", "--cell", engine_name, case_name,
           "--tokenizer", tokenizer_dir, "--n-vocab", str(n_vocab), "--repeats", str(reps),
           "--budget", str(budget_s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=harness.ROOT)
        peak = 0.0
        while child.poll() is None:
            peak = max(peak, _rss_mib(child.pid))
            elapsed = time.perf_counter() - t0
            if elapsed > budget_s + 60 or peak > max_rss_mib:
                child.kill()
                child.wait()
                why = (f"past the {budget_s:.0f} s budget" if elapsed > budget_s + 60
                       else f"past the {max_rss_mib:.0f} MiB memory cap")
                return Cell(engine=engine_name, grammar=case_name, rss_peak_mib=peak, killed_after_s=elapsed,
                            note=f"killed {why}: no result after {elapsed:.0f} s, {peak:,.0f} MiB resident")
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        if child.returncode != 0 or not lines:
            tail = err.read().strip().splitlines()[-3:]
            return Cell(engine=engine_name, grammar=case_name,
                        note=f"failed (rc {child.returncode}): {' / '.join(tail)}")
    return Cell(**json.loads(lines[-1]))


# ---- report -------------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    return f"{median(values) * 1e3:.1f}" if values else "—"


def _us(values: list[float], q: str = "median") -> str:
    if not values:
        return "—"
    return f"{(median(values) if q == 'median' else p95(values)) * 1e6:.0f}"


def _compile(cell: Cell) -> str:
    if not cell.compile_s:
        return f"**did not finish** ({cell.note})" if cell.note else "—"
    runs = f" ({len(cell.compile_s)} runs)" if len(cell.compile_s) > 1 else " (1 run)"
    return _ms(cell.compile_s) + runs


def _first(cell: Cell) -> str:
    if len(cell.first_mask_s) < 2:
        return _ms(cell.first_mask_s)
    return f"{_ms(cell.first_mask_s)} (1st run {cell.first_mask_s[0] * 1e3:.1f})"


def _sanity(cell: Cell) -> str:
    if not cell.compile_s:
        return "—"
    valid = "accepts valid" if cell.valid_ok else f"REFUSES valid ({cell.note})"
    invalid = "rejects invalid" if cell.invalid_rejected else "ACCEPTS invalid"
    return f"{valid}, {invalid}"


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, repeats=5, quick_repeats=2)
    p.add_argument("--budget", type=float, help="seconds one engine may spend compiling one grammar "
                   "(its repeats together; a first compile still running at budget + 60 s is killed); "
                   "default 600, 120 with --quick")
    p.add_argument("--max-rss", type=float, default=8192.0,
                   help="MiB one measuring process may hold resident before it is killed (default 8192)")
    p.add_argument("--models-dir", type=Path, help="models folder (default: $KVMEM_HOME/models, else the bench home)")
    p.add_argument("--no-footprint", action="store_true", help="skip the pip download of each engine's wheel")
    p.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--n-vocab", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    reps = harness.repeats(args, full=5, quick=2)
    budget = args.budget or (120.0 if args.quick else 600.0)
    if args.cell:  # a child of spawn_cell
        cell = run_cell(*args.cell, tokenizer_dir=args.tokenizer, n_vocab=args.n_vocab, reps=reps, budget_s=budget)
        print(json.dumps(dataclasses.asdict(cell)))
        return

    import runtime.blas  # noqa: F401  (OpenBLAS before mlx)
    from runtime.model.loaded import load_model

    models_dir = args.models_dir or Path(os.environ.get("KVMEM_HOME", harness.BENCH_HOME)) / "models"
    res = ResultFile("grammar_engines", "Grammar engines for constrained decoding: llguidance vs outlines-core",
                     args.quick, argv or [], model=None)
    lm = load_model("kvmem-default", models_dir=models_dir)
    hf = lm.tokenizer._tokenizer
    n_vocab = int(lm.config["vocab_size"])
    tokenizer_dir = str(hf.name_or_path)
    del lm
    engines = ["llguidance"]
    have_outlines = importlib.util.find_spec("outlines_core") is not None
    if have_outlines:
        engines.append("outlines-core")
    else:
        log(f"outlines-core is not installed (it is not a kvmem dependency): `{INSTALL_HINT}` to compare it")
    versions = ", ".join(f"{e} {_version(e)}" for e in engines)
    res.setup += [
        "machine note: 2-core CPU (shared; see the load average)",
        f"model: `kvmem-default` — {harness.model_geometry(Path(tokenizer_dir))}; tokenizer `{tokenizer_dir}` "
        f"({type(hf).__name__}, {n_vocab} tokens)",
        f"engines: {versions}" + ("" if have_outlines else f"; **outlines-core not installed** (`{INSTALL_HINT}`)"),
        f"each engine x grammar in its own fresh process: vocabulary preparation, then up to {reps} cold compiles "
        f"(within a {budget:.0f} s budget and a {args.max_rss:,.0f} MiB resident cap per cell), {reps} walks of "
        "the valid instance, one of the invalid one; "
        f"batched: {BATCH} llguidance matchers in lockstep, {reps} walks",
        f"llguidance JSON options {json.dumps(LLG_OPTIONS)}; outlines-core whitespace_pattern {OUTLINES_WHITESPACE!r}",
    ]
    cells: dict[tuple[str, str], Cell] = {}
    for case in CASES:
        for engine in engines:
            log(f"{engine} on {case.name} ...")
            cell = spawn_cell(engine, case.name, tokenizer_dir=tokenizer_dir, n_vocab=n_vocab, reps=reps,
                              budget_s=budget, max_rss_mib=args.max_rss)
            cells[engine, case.name] = cell
            res.record(**raw_record(cell))
            log(f"{engine} on {case.name}: compile {_compile(cell)} ms, first mask {_ms(cell.first_mask_s)} ms, "
                f"mask median {_us(cell.mask_s)} us / p95 {_us(cell.mask_s, 'p95')} us, {_sanity(cell)} {cell.note}")
    footprint = [] if args.no_footprint else [wheel_footprint(n, v) for n, v in WHEELS]
    write_report(res, cells, engines, footprint, reps=reps, budget=budget)
    print(res.write(plot=True).read_text())


def raw_record(cell: Cell) -> dict[str, Any]:
    """A cell's numbers for the raw section: every compile, mask times summarized per cell."""
    rec: dict[str, Any] = {k: v for k, v in dataclasses.asdict(cell).items() if not isinstance(v, list)}
    rec["compile_ms"] = [round(s * 1e3, 3) for s in cell.compile_s]
    rec["first_mask_ms"] = [round(s * 1e3, 3) for s in cell.first_mask_s]
    for key, values in (("mask", cell.mask_s), ("batch_step", cell.batch_step_s), ("batch_seq", cell.batch_seq_s)):
        if values:
            us = np.array(values) * 1e6
            rec[f"{key}_us"] = {"n": len(values), "median": round(float(np.median(us)), 1),
                                "p95": round(float(np.percentile(us, 95)), 1), "max": round(float(us.max()), 1),
                                "mean": round(float(us.mean()), 1)}
    return rec


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def write_report(res: ResultFile, cells: dict[tuple[str, str], Cell], engines: list[str],
                 footprint: list[list[str]], *, reps: int, budget: float) -> None:
    """Tables, the choice that follows from them, and the chart."""
    llg = {c.name: cells["llguidance", c.name] for c in CASES}
    occ = {c.name: cells.get(("outlines-core", c.name), Cell()) for c in CASES}
    have_oc = "outlines-core" in engines
    n_params = sum(len(t["properties"]) for t in CLAUDE_CODE_TOOLS.values())
    n_required = sum(len(t["required"]) for t in CLAUDE_CODE_TOOLS.values())

    def prep(engine: str) -> list[float]:
        return [cells[engine, c.name].prep_s for c in CASES if cells[engine, c.name].prep_s > 0]

    rows = [[e, f"{median(prep(e)) * 1e3:.0f}" if prep(e) else "—", len(prep(e))] for e in engines]
    res.body += ["## 1. Vocabulary preparation (once per tokenizer)", "",
                 *table(["engine", "prep ms (median)", "cold processes"], rows), "",
                 "llguidance: `llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152)`; outlines-core: the byte "
                 "strings of all 49,152 tokens walked in Python and handed to `Vocabulary(eos, {bytes: [ids]})`.", ""]
    rows = []
    for c in CASES:
        a, b = llg[c.name], occ[c.name]
        ratio = (f"{median(b.compile_s) / median(a.compile_s):,.0f}x" if a.compile_s and b.compile_s else
                 (f"> {b.killed_after_s / median(a.compile_s):,.0f}x" if a.compile_s and b.killed_after_s else "—"))
        rows.append([c.name, len(json.dumps(c.schema)), _compile(a), _first(a),
                     f"{a.rss_peak_mib - a.rss_base_mib:.0f}" if a.compile_s else "—",
                     _compile(b) if have_oc else "not installed", _first(b),
                     f"{b.rss_peak_mib - b.rss_base_mib:.0f}" if b.compile_s else
                     (f"{b.rss_peak_mib:.0f} (whole process at the kill)" if b.rss_peak_mib else "—"), ratio])
    res.body += ["## 2. Grammar compile (cold, median of runs)", "",
                 *table(["grammar", "schema bytes", "llguidance compile ms", "llg first mask ms",
                         "llg peak RSS over base MiB", "outlines-core compile ms", "outlines first mask ms",
                         "outlines peak RSS over base MiB", "outlines / llguidance compile"], rows), "",
                 "Grammars: **tools-2** = tool calls for 2 small tools; **tools-15** = tool calls for 15 "
                 "Claude-Code-shaped tools (Bash, Read, Write, Edit, MultiEdit, Glob, Grep, LS, WebFetch, WebSearch, "
                 "TodoWrite, Task, NotebookEdit, ExitPlanMode, BashOutput; "
                 f"{n_params} top-level parameters, {n_params - n_required} of them optional; enums, integers, "
                 "booleans, arrays of objects); **json_object** = `{\"type\": \"object\"}`; **strict** = a strict "
                 "json_schema (nested "
                 "object, all fields required, enums, an array of objects). *compile* ends when a mask can be asked "
                 "for (llguidance: `grammar_from_json_schema` + `LLMatcher`; outlines-core: `build_regex_from_schema` "
                 "+ `Index`); *first mask* is the first mask after it (the process's first run, in brackets, also "
                 "pays what an engine "
                 "sets up once per tokenizer on first use). *peak RSS over base*: the process's peak "
                 "resident memory minus its resident memory after vocabulary preparation.", ""]
    rows = []
    for c in CASES:
        a, b = llg[c.name], occ[c.name]
        per_row = [s / BATCH for s in a.batch_step_s]
        rows.append([c.name, f"{a.tokens} / {b.tokens if b.compile_s else '—'}",
                     f"{_us(a.mask_s)} / {_us(a.mask_s, 'p95')}", f"{_us(b.mask_s)} / {_us(b.mask_s, 'p95')}",
                     f"{_us(a.batch_step_s)} / {_us(a.batch_step_s, 'p95')}", _us(per_row),
                     f"{_us(a.batch_seq_s)} / {_us(a.batch_seq_s, 'p95')}", a.substituted])
    res.body += ["## 3. Per-token mask (valid instance emitted token by token)", "",
                 *table(["grammar", "tokens llg / outlines", "llguidance median / p95 µs",
                         "outlines-core median / p95 µs", f"llg batched {BATCH} rows: step median / p95 µs",
                         "llg batched, per row µs", f"llg {BATCH} single calls: step median / p95 µs",
                         "tokens llguidance forced"], rows), "",
                 f"Every token of the instance gets a mask first (and one more before the end), over {reps} walks. "
                 f"*batched*: {BATCH} matchers walking the same tokens, one `fill_next_token_bitmask_par` call per "
                 f"decode step through an `LLExecutor` (default threads: 80% of {os.cpu_count()} cores), next to "
                 f"{BATCH} single `fill_next_token_bitmask` calls on the same matchers. *forced*: steps where "
                 "llguidance's mask left out the tokenizer's own next token because the grammar fixed the next bytes "
                 "(llguidance then allows only the canonical tokenization of those bytes, by design: "
                 "docs/fast_forward.md); the walk took the allowed token that spells them.", ""]
    rows = [[c.name, _sanity(llg[c.name]), _sanity(occ[c.name]) if have_oc else "not installed", c.why_invalid,
             f"`{json.dumps(c.invalid)[:60]}`"] for c in CASES]
    res.body += ["## 4. Sanity", "", *table(["grammar", "llguidance", "outlines-core", "invalid instance is",
                                              "invalid instance"], rows), ""]
    if footprint:
        res.body += ["## 5. Install footprint (`pip download --no-deps`, this platform's wheel)", "",
                     *table(["wheel", "MiB", "unpacked MiB", "required dependencies (Requires-Dist, no extras)"],
                            footprint), "",
                     "xgrammar is downloaded only to read its wheel: its METADATA requires `torch>=1.10.0` (on every "
                     "platform) and `triton` on Linux x86_64, plus `transformers` and `apache-tvm-ffi`; installing it "
                     "would pull torch (hundreds of MB to GBs) into kvmem, which runs on MLX. It is not measured.", ""]
    res.body += ["## Choice", "", choice(llg, occ, have_oc, engines, cells), ""]
    plot(res, llg, occ, have_oc, budget)


#: One decode step of kvmem-default on this machine, for scale (batching.md: 14.6 tok/s for one agent).
DECODE_STEP_MS = 1e3 / 14.6


def choice(llg: dict[str, Cell], occ: dict[str, Cell], have_oc: bool, engines: list[str],
           cells: dict[tuple[str, str], Cell]) -> str:
    """The paragraph the numbers support: which engine kvmem uses, and where the other one wins."""
    names = [c.name for c in CASES]
    comp = [median(llg[n].compile_s) * 1e3 for n in names if llg[n].compile_s]
    p95s = [p95(llg[n].mask_s) * 1e6 for n in names if llg[n].mask_s]
    sane = all(llg[n].valid_ok and llg[n].invalid_rejected for n in names)
    text = (f"llguidance compiles every grammar here in {min(comp):.1f}-{max(comp):.1f} ms and computes a mask in "
            f"at most {max(p95s):.0f} µs at p95 ({max(p95s) / 1e3 / DECODE_STEP_MS:.2%} of a "
            f"{DECODE_STEP_MS:.0f} ms kvmem-default decode step on this machine, see batching.md); it "
            f"{'accepts every valid instance and rejects every invalid one' if sane else 'FAILS a sanity check'}. ")
    steps = [v for n in names for v in llg[n].batch_step_s]
    seqs = [v for n in names for v in llg[n].batch_seq_s]
    if steps and seqs:
        text += (f"A decode step of {BATCH} constrained rows costs {median(steps) * 1e6:.0f} µs median "
                 f"(p95 {p95(steps) * 1e6:.0f} µs) through one `LLExecutor` call, against "
                 f"{median(seqs) * 1e6:.0f} µs "
                 f"(p95 {p95(seqs) * 1e6:.0f} µs) as {BATCH} single calls, all grammars together. ")
    if not have_oc:
        return text + (f"outlines-core is not installed, so nothing is compared (`{INSTALL_HINT}`); "
                       "kvmem uses llguidance" + (" on these numbers." if sane else " only once the failure is fixed."))
    slower = [n for n in names if llg[n].compile_s and occ[n].compile_s
              and median(occ[n].compile_s) > median(llg[n].compile_s)]
    unfinished = [n for n in names if not occ[n].compile_s]
    oc_sane = all(occ[n].valid_ok and occ[n].invalid_rejected for n in names if occ[n].compile_s)
    mask_wins = [n for n in names if occ[n].mask_s and llg[n].mask_s and median(occ[n].mask_s) < median(llg[n].mask_s)]
    mask_losses = [n for n in names if occ[n].mask_s and llg[n].mask_s and n not in mask_wins]
    p95_wins = [n for n in names if occ[n].mask_s and llg[n].mask_s and p95(occ[n].mask_s) < p95(llg[n].mask_s)]
    oc_prep = median([cells["outlines-core", n].prep_s for n in names if cells["outlines-core", n].prep_s > 0])
    ll_prep = median([cells["llguidance", n].prep_s for n in names if cells["llguidance", n].prep_s > 0])
    ratios = [median(occ[n].compile_s) / median(llg[n].compile_s) for n in slower]
    text += ("outlines-core compiles the same schemas into a regex and then a DFA over the whole vocabulary, "
             "eagerly: " + (f"{min(ratios):,.0f}-{max(ratios):,.0f}x slower on {', '.join(slower)}" if slower else
                            "never slower") +
             "".join(f", and on {n} it had not finished after {occ[n].killed_after_s:.0f} s "
                     f"({occ[n].rss_peak_mib:,.0f} MiB resident) and was killed" for n in unfinished) +
             ". A tool-calling request brings its own tools, so the grammar is compiled on the request's path "
             "(before its first token; a cache keyed on the schema spares repeats, not the first request with a "
             "new tool list), and Claude-Code-sized tool lists are the normal case, not the edge. ")
    llg_wins = len(slower) + len(unfinished) == len(names) and sane
    if llg_wins:
        text += "**kvmem uses llguidance.** "
    else:
        text += "**The numbers do not make llguidance the clear choice** (see the tables). "
    where = []
    if mask_wins:
        where.append(f"its per-token mask median is lower on {', '.join(mask_wins)} (it copies a precomputed "
                     "state-to-tokens table, where llguidance runs its parser)"
                     + (f", though not on {', '.join(mask_losses)}, where many tokens are allowed at once and its "
                        "copy grows with them" if mask_losses else ""))
    if p95_wins:
        where.append(f"its p95 is lower on {', '.join(p95_wins)}")
    if oc_prep < ll_prep:
        where.append(f"vocabulary preparation is faster ({oc_prep * 1e3:.0f} ms vs {ll_prep * 1e3:.0f} ms, once "
                     "per model)")
    if not oc_sane:
        where.append("(but it fails a sanity check above)")
    text += ("Where outlines-core wins: " + "; ".join(where) + ". " if where else "outlines-core wins nowhere here. ")
    text += ("Those wins are microseconds per token or once per model; its losses are seconds to minutes per new "
             "grammar, plus a JSON `{\"type\": \"object\"}` whose regex stops at nesting depth 3 (its default "
             "`max_recursion_depth`), and whitespace given only as a pattern, not as fixed separators."
             if llg_wins and where else "")
    return text


def plot(res: ResultFile, llg: dict[str, Cell], occ: dict[str, Cell], have_oc: bool, budget: float) -> None:
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [c.name for c in CASES]
    x = np.arange(len(names))
    w = 0.38
    ll_c = [median(llg[n].compile_s) * 1e3 if llg[n].compile_s else np.nan for n in names]
    groups = [(ax1.bar(x - w / 2, ll_c, w, label="llguidance"), [llg[n] for n in names])]
    if have_oc:
        oc_c = [median(occ[n].compile_s) * 1e3 if occ[n].compile_s else occ[n].killed_after_s * 1e3 for n in names]
        groups.append((ax1.bar(x + w / 2, oc_c, w, label="outlines-core"), [occ[n] for n in names]))
    for bars, group in groups:
        for cell, bar in zip(group, bars, strict=True):
            ms = bar.get_height()
            label = f"{ms:.1f} ms" if ms < 1e3 else f"{ms / 1e3:.1f} s"
            if not cell.compile_s and cell.killed_after_s:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
                label = f"> {cell.killed_after_s:.0f} s\n(killed)"
            if ms == ms:
                ax1.annotate(label, (bar.get_x() + bar.get_width() / 2, ms), ha="center", va="bottom", fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylim(top=np.nanmax([b.get_height() for bars, _ in groups for b in bars]) * 20)
    ax1.set_xticks(x, names)
    ax1.set_ylabel("compile ms (cold, median; log)")
    ax1.set_title("grammar compile")
    ax1.legend(fontsize=8)
    series = [("llguidance", [llg[n].mask_s for n in names], -w * 0.75),
              ("llg batched 8, per row", [[s / BATCH for s in llg[n].batch_step_s] for n in names], 0.0)]
    if have_oc:
        series.append(("outlines-core", [occ[n].mask_s for n in names], w * 0.75))
    for label, vals, off in series:
        med = [median(v) * 1e6 if v else np.nan for v in vals]
        hi = [p95(v) * 1e6 - m if v else 0 for v, m in zip(vals, med, strict=True)]
        ax2.bar(x + off, med, w * 0.75, yerr=[[0] * len(med), hi], capsize=3, label=label)
    ax2.set_xticks(x, names)
    ax2.set_ylabel("µs per token (median, whisker to p95)")
    ax2.set_title("per-token mask, kvmem-default tokenizer (49,152)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{res.stem}: llguidance vs outlines-core on a 2-core CPU", fontsize=10)
    harness.save_figure(res, fig)


if __name__ == "__main__":
    main(sys.argv[1:])
