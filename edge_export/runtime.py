"""Running exported files with the LiteRT runtime (``ai_edge_litert.interpreter``).

``LiteRTCausalLM`` drives the file litert-torch's generative export writes: signatures ``prefill_<N>`` (one per
prefill length) and ``decode``, inputs ``tokens`` (int32, (1, T)), ``input_pos`` (int32, (T,)), ``mask`` (float32,
(1, 1, T, cache_length), additive: 0 where a query may attend, -inf elsewhere) and an external KV cache
``kv_cache_{k,v}_<layer>`` passed in and returned by every call; ``decode`` also returns ``logits`` (float32,
(1, 1, vocab)).
"""

from __future__ import annotations

import os
import re
import tempfile

import numpy as np

from edge_export.errors import BAD_FILE, ExportError, explain_runtime_failure

_NEG_INF = np.float32(-np.inf)


def load_interpreter(path: str, num_threads: int = 1):
    """An allocated ``Interpreter`` for ``path``; a missing kernel becomes ``ExportError(MISSING_RUNTIME_OP)``."""
    from ai_edge_litert.interpreter import Interpreter

    try:
        interpreter = Interpreter(model_path=path, num_threads=num_threads)
        interpreter.allocate_tensors()
    except (RuntimeError, ValueError) as exc:
        raise explain_runtime_failure(exc, path) or ExportError(
            BAD_FILE, f"the LiteRT runtime cannot load {path}: {exc}"
        ) from exc
    return interpreter


def tflite_in_bundle(path: str, workdir: str) -> str:
    """Unpack a ``.litertlm`` bundle into ``workdir`` and return the path of its prefill/decode ``.tflite``."""
    from litert_lm_builder import litertlm_builder

    litertlm_builder.unpack(path, workdir)
    candidates = [
        os.path.join(root, name) for root, _, names in os.walk(workdir) for name in names if name.endswith(".tflite")
    ]
    for candidate in candidates:
        if "prefill_decode" in os.path.basename(candidate).lower():
            return candidate
    if len(candidates) == 1:
        return candidates[0]
    raise ExportError(BAD_FILE, f"{path}: found {len(candidates)} .tflite sections, none named prefill_decode")


def bundle_has_tokenizer(workdir: str) -> bool:
    """Whether an unpacked ``.litertlm`` (see ``tflite_in_bundle``) holds a tokenizer section."""
    names = [n.lower() for _, _, files in os.walk(workdir) for n in files]
    return any("tokenizer" in n or n.endswith((".spiece", ".json")) for n in names)


class TFLiteModule:
    """The single signature of a plain-module ``.tflite``, called with positional numpy arrays."""

    def __init__(self, path: str, num_threads: int = 1):
        self.interpreter = load_interpreter(path, num_threads)
        signatures = self.interpreter.get_signature_list()
        if len(signatures) != 1:
            raise ExportError(BAD_FILE, f"{path} has signatures {sorted(signatures)}; expected exactly one")
        self.runner = self.interpreter.get_signature_runner(next(iter(signatures)))
        inputs = self.runner.get_input_details()
        # litert-torch names positional inputs args_0, args_1, ... and outputs output_0, output_1, ...
        self.input_names = sorted(inputs, key=_trailing_int)
        self.input_dtypes = [inputs[name]["dtype"] for name in self.input_names]
        self.output_names = sorted(self.runner.get_output_details(), key=_trailing_int)

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray]:
        feeds = {n: np.asarray(a).astype(d) for n, a, d in zip(self.input_names, arrays, self.input_dtypes)}
        outputs = self.runner(**feeds)
        return [np.array(outputs[name]) for name in self.output_names]


def _trailing_int(name: str) -> int:
    found = re.search(r"(\d+)$", name)
    return int(found.group(1)) if found else 0


class LiteRTCausalLM:
    """Greedy prefill/decode over a generative-export ``.tflite`` (or the one inside a ``.litertlm``)."""

    def __init__(self, path: str, num_threads: int = 1):
        self._tmp = None
        if path.endswith(".litertlm"):
            self._tmp = tempfile.TemporaryDirectory(prefix="litertlm-")
            path = tflite_in_bundle(path, self._tmp.name)
        self.interpreter = load_interpreter(path, num_threads)
        signatures = self.interpreter.get_signature_list()
        if "decode" not in signatures:
            raise ExportError(
                BAD_FILE, f"{path} has no 'decode' signature (has {sorted(signatures)}); not a generative export"
            )
        self.prefill_lengths = sorted(
            int(m.group(1)) for name in signatures if (m := re.fullmatch(r"prefill_(\d+)", name))
        )
        self._prefill = {n: self.interpreter.get_signature_runner(f"prefill_{n}") for n in self.prefill_lengths}
        self._decode = self.interpreter.get_signature_runner("decode")
        details = self._decode.get_input_details()
        self.cache_length = int(details["mask"]["shape"][-1])
        self._cache_shapes = {
            name: (tuple(d["shape"]), d["dtype"]) for name, d in details.items() if name.startswith("kv_cache")
        }

    def empty_cache(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in self._cache_shapes.items()}

    def _mask(self, start: int, rows: int) -> np.ndarray:
        """(1, 1, rows, cache_length) causal mask for queries at positions start .. start+rows-1."""
        keys = np.arange(self.cache_length)[None, :]
        queries = np.arange(start, start + rows)[:, None]
        return np.where(keys <= queries, np.float32(0), _NEG_INF).astype(np.float32)[None, None]

    def _call(self, runner, tokens: list[int], start: int, cache: dict) -> dict:
        outputs = runner(
            tokens=np.asarray([tokens], np.int32),
            input_pos=np.arange(start, start + len(tokens), dtype=np.int32),
            mask=self._mask(start, len(tokens)),
            **cache,
        )
        return {name: np.array(value) for name, value in outputs.items()}

    def prefill(self, tokens: list[int], cache: dict, start: int = 0) -> dict:
        """Write ``tokens`` at positions ``start..`` into ``cache``; returns the new cache.

        Uses the smallest ``prefill_<N>`` bucket that holds the tokens (padded with 0: the pad rows write cache
        slots that later steps overwrite and the causal mask hides), chunking when none is long enough, and
        ``decode`` for a tail that no bucket fits inside the cache.
        """
        position = start
        while position < start + len(tokens):
            rest = tokens[position - start :]
            room = self.cache_length - position
            fitting = [n for n in self.prefill_lengths if n <= room]
            if not fitting:  # too close to the end of the cache for any bucket: one token at a time
                cache = {k: v for k, v in self._call(self._decode, rest[:1], position, cache).items() if k != "logits"}
                position += 1
                continue
            bucket = next((n for n in fitting if n >= len(rest)), fitting[-1])
            chunk = rest[:bucket]
            outputs = self._call(self._prefill[bucket], chunk + [0] * (bucket - len(chunk)), position, cache)
            cache = {k: v for k, v in outputs.items() if k.startswith("kv_cache")}
            position += len(chunk)
        return cache

    def decode(self, token: int, position: int, cache: dict) -> tuple[np.ndarray, dict]:
        """One step: (logits float32 (vocab,), new cache)."""
        outputs = self._call(self._decode, [token], position, cache)
        logits = outputs.pop("logits").reshape(-1)
        return logits, outputs

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
        """Greedy-decode ``steps`` tokens after ``prompt``.

        Returns:
            (tokens, logits): the ``steps`` generated ids and float32 logits (steps, vocab), where row i is the
            distribution that chose tokens[i].
        Raises:
            ExportError(BAD_FILE): prompt + steps exceeds the cache length.
        """
        if not prompt or len(prompt) - 1 + steps > self.cache_length:
            raise ExportError(
                BAD_FILE,
                f"prompt ({len(prompt)} tokens) + {steps} steps does not fit the cache length {self.cache_length}",
            )
        cache = self.prefill(prompt[:-1], self.empty_cache()) if len(prompt) > 1 else self.empty_cache()
        token, position = prompt[-1], len(prompt) - 1
        tokens, rows = [], []
        for _ in range(steps):
            logits, cache = self.decode(token, position, cache)
            token = int(np.argmax(logits))
            tokens.append(token)
            rows.append(logits)
            position += 1
        return tokens, np.stack(rows)
