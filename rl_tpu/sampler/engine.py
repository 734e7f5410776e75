"""The native sampler: batched, KV-cached generation for Hugging Face causal LMs with bucketed shapes.

One call to :meth:`Sampler.generate`:

1. repeats each prompt ``n`` times (prompt-major), sorts the rows by length and cuts them into batches of at most
   ``max_batch_size`` rows;
2. per batch, left-pads the prompts to the smallest prompt bucket that fits, pads the batch to a power of two
   (repeating a real row), and allocates a static KV cache of ``prompt_bucket + gen_bucket`` positions;
3. runs each distinct prompt once (prefill; the ``n`` samples of a prompt share it), then one token per step
   (decode), choosing tokens with :func:`~rl_tpu.sampler.processing.choose_tokens` (after the repetition penalty
   and min-tokens processors, :class:`~rl_tpu.sampler.processing.LogitsProcessors`, when requested). On CPU the
   distinct prompts are prefilled unpadded, packed into one sequence whose common prefix (a chat template's system
   prompt) is computed once (see :func:`rl_tpu.sampler.prefill.packed_prefill`);
4. stops when every row has met an EOS/stop token or ``max_new_tokens``; when half the rows or more are finished
   the batch shrinks to the next power of two (the finished rows' cache rows are dropped).

So a compiled (XLA/TPU) forward (``packed_prefill=False``, the default off the CPU) sees only shapes
``(batch_bucket, prompt_bucket)`` for prefill and ``(batch_bucket, 1)`` against a cache of
``prompt_bucket + gen_bucket`` for decode; :attr:`Sampler.shapes_seen` records them. With ``compile=True`` those two
steps are compiled graphs, one per shape (:mod:`rl_tpu.sampler.compiled`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from transformers import StaticCache

from rl_tpu.sampler import panel_kernel
from rl_tpu.sampler.attention import gqa_attention
from rl_tpu.sampler.compiled import CompiledSteps, compile_backend_for, model_logits
from rl_tpu.sampler.fastpaths import FastPaths
from rl_tpu.sampler.lean import LeanDecoder
from rl_tpu.sampler.packed import PackedLinears, packed_linear_supported
from rl_tpu.sampler.params import (
    SampleOutput,
    SamplerError,
    SamplingParams,
    check_request,
)
from rl_tpu.sampler.params import longrope_switch_length as longrope_switch_length  # noqa: PLC0414 (old home)
from rl_tpu.sampler.prefill import packed_prefill
from rl_tpu.sampler.processing import LogitsProcessors, choose_tokens, token_logprobs
from rl_tpu.sampler.seeds import row_uniforms, sample_seed


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _check_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted({int(b) for b in buckets}))
    if not out or out[0] < 1:
        raise SamplerError(f"{name}={tuple(buckets)!r}: give one or more positive lengths")
    return out


class Sampler:
    """Generate completions and their log-probs from a Hugging Face causal LM.

    Args:
        model: a ``transformers`` causal LM (``AutoModelForCausalLM``); put into eval mode.
        pad_token_id: token written at padded positions (never attended to).
        eos_token_ids: tokens that end a completion (in addition to ``SamplingParams.stop_token_ids``).
        prompt_buckets: allowed padded prompt lengths; a prompt longer than the largest is refused.
        gen_buckets: allowed generation lengths (KV cache room); ``max_new_tokens`` above the largest is refused.
        max_batch_size: most rows per forward pass (rows beyond are run in further batches); ``None``: no limit.
        device: device for the inputs and the cache; ``None``: the model's device.
        shrink_finished: drop finished rows (halving the batch bucket) during decoding; saves compute, adds at
            most ``log2(max batch)`` batch shapes.
        share_prefix: prefill each distinct prompt of a batch once and copy its KV cache to its ``n`` sample rows
            (with packed prefill, ``False`` prefills every row, though still their common prefix once).
        packed_weights: run the linear layers on oneDNN-packed copies of their weights
            (:class:`rl_tpu.sampler.packed.PackedLinears`: faster decode, the weights' size again in memory while
            packed); ``None``: on for a float32 model on the CPU where torch has oneDNN.
        packed_prefill: prefill the distinct prompts of a batch without padding, as one packed sequence with a
            block-diagonal causal mask whose common prefix is computed once, then scatter its KV cache into the
            batch's rows. Fewer tokens through the model (the 16 chat prompts of ``benchmarks/bench_sampler.py``:
            ~430 instead of 1,024) but one prefill shape per batch, so ``None``: on for the CPU only; used only
            while :func:`rl_tpu.sampler.attention.gqa_attention` runs the model's attention (it reads the mask).
        packed_prefill_tokens: most tokens in one packed prefill sequence (prompts beyond go to further ones); its
            attention mask is ``tokens**2`` bytes.
        lean_decode: run decode steps through :class:`rl_tpu.sampler.lean.LeanDecoder` (the same modules and
            weights without transformers' per-call overhead) when it computes the model's numbers
            (:mod:`rl_tpu.sampler.fastpaths`); ``None``: on for the CPU. Other models keep their own forward.
        compile: run prefill and decode as compiled graphs (:class:`rl_tpu.sampler.compiled.CompiledSteps`), one
            per bucket shape; packed prefill and lean decode are then off (not static graphs), and asking for one
            of them as well is refused; ``packed_weights`` then applies inside the graphs, to copies kept outside
            them (:mod:`rl_tpu.sampler.compiled_packed`). ``compile_backend``: ``torch.compile``'s backend (``None``:
            the device's, :func:`rl_tpu.sampler.compiled.compile_backend_for`).

    Log-probs are ``log_softmax(logits / temperature)`` of the chosen token over the full vocabulary, before
    repetition penalty, min tokens and top-k/top-p (see :mod:`rl_tpu.sampler.processing`): what VeRL recomputes as
    old log-probs.

    On CPU, ``generate`` runs grouped-query ``sdpa`` models through :func:`rl_tpu.sampler.attention.gqa_attention`
    (same numbers, no per-step KV expansion); the model's setting is restored afterwards, so do not run another
    forward of the same model object concurrently from another thread.

    Attributes:
        shapes_seen: set of ``(batch, query_length, cache_length)`` the model's forward was called with.
        compiled: the :class:`~rl_tpu.sampler.compiled.CompiledSteps` (graphs and compile seconds per step kind)
            with ``compile=True``, else ``None``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_ids: Iterable[int],
        prompt_buckets: Sequence[int] = (32, 64, 128, 256, 512),
        gen_buckets: Sequence[int] = (16, 32, 64, 128, 256, 512),
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        shrink_finished: bool = True,
        share_prefix: bool = True,
        packed_weights: bool | None = None,
        packed_prefill: bool | None = None,
        packed_prefill_tokens: int = 2048,
        lean_decode: bool | None = None,
        compile: bool = False,
        compile_backend=None,
    ) -> None:
        self.model = model.eval()
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.prompt_buckets = _check_buckets("prompt_buckets", prompt_buckets)
        self.gen_buckets = _check_buckets("gen_buckets", gen_buckets)
        if max_batch_size is not None and max_batch_size < 1:
            raise SamplerError(f"max_batch_size={max_batch_size!r}: give a positive row count or None")
        self.max_batch_size = max_batch_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.shrink_finished = shrink_finished
        self.share_prefix = share_prefix
        self.shapes_seen: set[tuple[int, int, int]] = set()
        self.config = model.config
        head = model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(self.config.vocab_size)
        # Parameters and persistent buffers by every name they have (tied weights appear under both names).
        self._tensors = model.state_dict(keep_vars=True)
        self.compiled: CompiledSteps | None = None
        if compile:
            asked = [k for k, v in (("packed_prefill", packed_prefill), ("lean_decode", lean_decode)) if v]
            if asked:
                raise SamplerError(
                    f"compile=True with {', '.join(asked)}=True: compiled steps run the bucketed "
                    "static shapes through the model's forward; leave those unset"
                )
            if packed_weights is None:  # inside the graphs, on copies kept outside them (see compiled_packed)
                packed_weights = self.device.type == "cpu" and packed_linear_supported()
            elif packed_weights and not (self.device.type == "cpu" and packed_linear_supported()):
                raise SamplerError(
                    f"packed_weights=True on {self.device.type}: packed weights are oneDNN's, on a "
                    "CPU whose torch has mkldnn; leave it unset"
                )
            self.compiled = CompiledSteps(
                model, compile_backend or compile_backend_for(self.device), packed_weights=bool(packed_weights)
            )
            packed_weights = packed_prefill = lean_decode = False
        if packed_weights is None:
            packed_weights = self.device.type == "cpu" and packed_linear_supported()
        self.packed = PackedLinears(model, batch_hint=16) if packed_weights else None
        if packed_prefill is None:
            packed_prefill = self.device.type == "cpu"
        self.packed_prefill = bool(packed_prefill)
        if lean_decode is None:
            lean_decode = self.device.type == "cpu"
        self.lean_decode = bool(lean_decode)
        self.lean: LeanDecoder | None = None  # built per generate: the model may be cast or resized in between
        self.lean_steps = 0  # decode steps run through the lean decoder (a batch whose cache passes a window: none)
        self.fast_paths = FastPaths(model)  # whether packed prefill and lean decode compute the model's numbers
        if packed_prefill_tokens < 1:
            raise SamplerError(f"packed_prefill_tokens={packed_prefill_tokens!r}: give a positive token count")
        self.packed_prefill_tokens = int(packed_prefill_tokens)

    def weights_changed(self) -> None:
        """Say the weights changed: the packed copies derived from them are dropped now (freeing their memory) and
        rebuilt at the next ``generate``. Required after a write this process cannot see (another process through
        shared memory); an in-place write here is also caught by the tensors' version counters."""
        if self.packed is not None:
            self.packed.release()
        if self.compiled is not None:
            self.compiled.weights_changed()

    # ----------------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def load_state_dict(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights into the model in place (weight sync); names are the model's ``state_dict`` keys.

        The parameters keep their storage, so anything holding them (a compiled graph, this sampler) stays
        valid; dtype and device are converted on copy. Per-expert names of a model that holds its experts fused go
        into their slices (:func:`rl_tpu.expert_slices.expert_slice`).

        Raises:
            SamplerError: a name the model does not have, or a shape that differs from the model's.
        """
        from rl_tpu.collectives import weight_mismatch
        from rl_tpu.expert_slices import expert_slice

        for name, src in named_tensors:
            dst = self._tensors.get(name)
            if dst is None and (piece := expert_slice(name, self._tensors.get)) is not None:
                dst = piece[1]
            problem = weight_mismatch("load_state_dict", name, dst, src, next(iter(self._tensors)))
            if problem:
                raise SamplerError(problem)
            dst.copy_(src)
        self.weights_changed()

    # ------------------------------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[SampleOutput]:
        """Sample ``params.n`` completions for each prompt.

        Each sampled completion draws from a random stream of its own (:mod:`rl_tpu.sampler.seeds`): sample ``j`` of
        prompt ``i`` from ``sample_seed(seeds[i], j)``, or without ``seeds`` from ``sample_seed(params.seed, i, j)``.
        So a completion does not depend on how the prompts are cut into batches (``max_batch_size``), on their
        order within one, or on the other prompts of the call; only on its seed, prompt and the model's numbers.
        With neither ``seeds`` nor ``params.seed`` the draws come from torch's global generator.

        Args:
            prompts: token-id lists, unpadded, each non-empty and at most ``max(prompt_buckets)`` long.
            params: sampling settings.
            seeds: one seed per prompt (any int), e.g. a rollout server's per-request seed; overrides
                ``params.seed``.

        Returns:
            ``len(prompts) * params.n`` outputs in prompt-major order (prompt 0's samples, then prompt 1's, ...).

        Raises:
            SamplerError: an empty or too long prompt, a token id outside the vocabulary, or ``max_new_tokens``
                above the largest generation bucket or past the model's context length.
        """
        check_request(prompts, params, self.prompt_buckets[-1], self.gen_buckets[-1], self.vocab_size, self.config)
        if not prompts:
            return []
        self.lean = self.fast_paths.lean() if self.lean_decode else None
        if self.lean is not None:  # a CPU fast path, as the packed weights are
            self.lean.attention_kernel = self.packed is not None and panel_kernel.backend() == "panel"
        rows = [list(map(int, p)) for p in prompts for _ in range(params.n)]  # prompt-major
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths share a prompt bucket
        step = self.max_batch_size or len(rows)
        if seeds is not None and len(seeds) != len(prompts):
            raise SamplerError(f"{len(seeds)} seeds for {len(prompts)} prompts: give one seed per prompt")
        row_seeds: list[int] | None = None  # prompt-major, as rows
        if not params.greedy and (seeds is not None or params.seed is not None):
            row_seeds = [
                sample_seed(seeds[i], j) if seeds is not None else sample_seed(params.seed, i, j)
                for i in range(len(prompts))
                for j in range(params.n)
            ]
        outputs: list[SampleOutput | None] = [None] * len(rows)
        # enable_gqa is only measured on CPU here; other devices keep transformers' sdpa
        fast_gqa = gqa_attention(self.model) if self.device.type == "cpu" else contextlib.nullcontext()
        packed = self.packed.applied() if self.packed is not None else contextlib.nullcontext()
        with torch.inference_mode(), fast_gqa, packed:
            if self.lean is not None:
                self.lean.use_packed(self.packed)
            for start in range(0, len(rows), step):
                idx = order[start : start + step]
                batch_seeds = None if row_seeds is None else [row_seeds[i] for i in idx]
                for i, out in zip(idx, self._generate_batch([rows[i] for i in idx], params, batch_seeds)):
                    outputs[i] = out
        return outputs  # type: ignore[return-value]

    def _bucket(self, buckets: tuple[int, ...], length: int) -> int:
        return next(b for b in buckets if b >= length)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: StaticCache, kv_len: int | None = None
    ) -> torch.Tensor:
        """``ids``/``pos`` ``(batch, q)``, ``mask`` ``(batch, cache_len)`` -> last-position logits ``(batch, vocab)``.

        ``kv_len``: cache slots written once this call's tokens are in, passed to
        :func:`rl_tpu.sampler.attention.sdpa_gqa_attention` (which reads only those; other attention functions
        ignore it)."""
        self.shapes_seen.add((ids.shape[0], ids.shape[1], mask.shape[1]))
        if self.compiled is not None:  # no kv_len: a compiled step reads the whole static cache, masked
            return self.compiled(ids, mask, pos, cache)
        extra = {"rl_tpu_kv_len": kv_len} if kv_len is not None and self.device.type == "cpu" else {}
        if self.packed is not None and ids.shape[1] == 1 and panel_kernel.backend() == "panel":
            extra["rl_tpu_attention_kernel"] = True  # a CPU fast path, as the packed weights are
        return model_logits(self.model, ids, mask, pos, cache, **extra)  # (batch, vocab)

    def _generate_batch(
        self, rows: list[list[int]], params: SamplingParams, row_seeds: list[int] | None
    ) -> list[SampleOutput]:
        """Sample one batch (:meth:`generate`'s steps 2 to 4): bucket and left-pad it, prefill, decode, collect.

        Args:
            rows: the batch's prompts, one per output row, unpadded (at most ``max_batch_size`` of them).
            params: sampling settings.
            row_seeds: one seed per row (:func:`rl_tpu.sampler.seeds.row_uniforms`); ``None``: torch's global
                generator draws.

        Returns:
            ``len(rows)`` outputs in the order of ``rows``.
        """
        dev = self.device
        n_real = len(rows)
        rows, prompt_len, cache_len = self._bucket_rows(rows, params.max_new_tokens)
        batch = len(rows)
        ids, mask, pos, real_len = self._left_pad(rows, prompt_len, cache_len)
        stop_ids = torch.tensor(
            sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.long, device=dev
        )
        cache = StaticCache(config=self.config, max_cache_len=cache_len)
        logits = self._prefill(rows, ids, mask, pos, cache)  # (batch, vocab)
        procs = LogitsProcessors.build(
            params.repetition_penalty, params.min_tokens, ids, mask[:, :prompt_len], stop_ids, logits.shape[-1]
        )  # None unless requested: nothing to pay
        uniforms = None  # (batch, new): each output row's own draws (rl_tpu.sampler.seeds); None: global generator
        if row_seeds is not None:
            acc = torch.float64 if dev.type == "cpu" else torch.float32  # as processing._draw sums
            uniforms = row_uniforms(row_seeds + [0] * (batch - n_real), params.max_new_tokens, dev, acc)
        out_tokens, out_logp, out_len, stopped = self._decode(
            logits, cache, mask, real_len, prompt_len, stop_ids, params, procs, uniforms, n_real
        )
        return [
            self._output(out_tokens[i], out_logp[i] if params.logprobs else None, int(out_len[i]), bool(stopped[i]))
            for i in range(n_real)
        ]

    def _bucket_rows(self, rows: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], int, int]:
        """The batch's buckets: ``rows`` topped up to the batch bucket (a power of two, at most ``max_batch_size``)
        with filler rows (copies of ``rows[0]``, their results dropped), and the prompt bucket and KV cache length.

        Returns:
            ``(rows, prompt_len, cache_len)``: the padded rows (real ones first), the smallest prompt bucket that fits
            the longest prompt, and ``prompt_len`` + the smallest generation bucket that fits ``max_new_tokens``
            (cache slots).
        """
        n_real = len(rows)
        batch = _next_pow2(n_real)
        if self.max_batch_size is not None:
            batch = min(batch, self.max_batch_size)
        rows = rows + [rows[0]] * (batch - n_real)  # filler rows: results dropped
        prompt_len = self._bucket(self.prompt_buckets, max(len(r) for r in rows))
        cache_len = prompt_len + self._bucket(self.gen_buckets, max_new_tokens)
        return rows, prompt_len, cache_len

    def _left_pad(
        self, rows: list[list[int]], prompt_len: int, cache_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill's inputs on the sampler's device: the prompts left-padded to ``prompt_len``.

        Returns:
            ``(ids, mask, pos, real_len)``: ``ids`` ``(batch, prompt_len)`` int64 (``pad_token_id`` at the padding);
            ``mask`` ``(batch, cache_len)`` int64 over the whole KV cache, 1 = a real token (future slots are hidden
            by causality until written); ``pos`` ``(batch, prompt_len)`` int64 position ids from 0 per row (0 at the
            padding); ``real_len`` ``(batch,)`` int64 prompt tokens per row.
        """
        batch = len(rows)
        ids = torch.full((batch, prompt_len), self.pad_token_id, dtype=torch.long)  # (batch, prompt)
        mask = torch.ones((batch, cache_len), dtype=torch.long)  # (batch, cache)
        for i, r in enumerate(rows):
            ids[i, prompt_len - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, : prompt_len - len(r)] = 0
        ids, mask = ids.to(self.device), mask.to(self.device)
        real_len = mask[:, :prompt_len].sum(-1)  # (batch,) prompt tokens per row
        pos = (mask[:, :prompt_len].cumsum(-1) - 1).clamp(min=0)  # (batch, prompt) positions from 0 per row
        return ids, mask, pos, real_len

    def _choice_settings(self, params: SamplingParams, procs: LogitsProcessors | None) -> dict:
        """Keyword arguments of :func:`~rl_tpu.sampler.processing.choose_tokens` for a batch's decode steps (the
        decode loop adds each step's ``uniforms``); log-probs come from it only when no processor changes the
        logits."""
        fast = self.packed is not None or (self.compiled is not None and self.compiled.packs is not None)
        return {
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "generator": None,
            "logprobs": params.logprobs and procs is None,
            "kernel": fast,
        }  # rl-tpu's greedy token kernel: a CPU fast path, as the packed weights are

    def _decode(
        self,
        logits: torch.Tensor,
        cache: StaticCache,
        mask: torch.Tensor,
        real_len: torch.Tensor,
        prompt_len: int,
        stop_ids: torch.Tensor,
        params: SamplingParams,
        procs: LogitsProcessors | None,
        uniforms: torch.Tensor | None,
        n_real: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode loop: choose a token per row, record it and run it through the model until every real row has
        met a stop token or ``params.max_new_tokens``, shrinking the batch as rows finish (``shrink_finished``).

        Args:
            logits: ``(batch, vocab)`` the prefill's last-token logits.
            cache: the batch's KV cache, prompt slots ``[0, prompt_len)`` written; updated in place.
            mask: ``(batch, cache_len)`` int64 attention mask over the cache; ``real_len`` ``(batch,)`` int64 prompt
                tokens per row; ``prompt_len``: the prompt bucket (the first generated token's cache slot).
            stop_ids: ``(stops,)`` int64 EOS and stop token ids.
            procs: the logits processors (repetition penalty, min tokens), or ``None``.
            uniforms: ``(batch, max_new_tokens)`` each output row's draws; ``None``: torch's global generator.
            n_real: the real rows (the first ones; filler rows after them never write).

        Returns:
            ``(tokens, logprobs, lengths, stopped)`` per output row: ``(batch, max_new_tokens)`` int64
            (``pad_token_id`` past a row's end) and float32 (0 unless ``params.logprobs``), ``(batch,)`` int64
            tokens generated and bool ended on a stop token.
        """
        dev = self.device
        batch, max_new = mask.shape[0], params.max_new_tokens
        out_tokens = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long, device=dev)  # (rows, new)
        out_logp = torch.zeros((batch, max_new), dtype=torch.float32, device=dev)  # (rows, new); 0 unless asked
        out_len = torch.zeros(batch, dtype=torch.long, device=dev)  # tokens generated per row
        stopped = torch.zeros(batch, dtype=torch.bool, device=dev)  # ended on a stop token
        row_ids = torch.arange(batch, device=dev)  # current batch row -> output row
        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        done[n_real:] = True  # filler rows never write
        lean = self.fast_paths.lean_for(self.lean, mask.shape[1])  # None past a sliding window (said once)
        lean_mask = mask.bool()[:, None, None, :] if lean is not None else None  # (batch, 1, 1, cache)
        sample = self._choice_settings(params, procs)
        for t in range(max_new):
            if uniforms is not None:
                sample["uniforms"] = uniforms[row_ids, t]  # (batch,): the rows still in the batch
            if procs is None:
                tok, logp = choose_tokens(logits, **sample)  # (batch,), (batch,) or None
            else:  # chosen from the processed logits; the log-prob stays the model's (processing module doc)
                tok, _ = choose_tokens(procs(logits, t), **sample)
                logp = token_logprobs(logits, tok, params.temperature) if params.logprobs else None
                procs.chose(tok)
            alive = ~done
            out_tokens[row_ids, t] = torch.where(alive, tok, self.pad_token_id)
            if logp is not None:
                out_logp[row_ids, t] = torch.where(alive, logp, 0.0)
            out_len[row_ids] += alive.long()
            hit = alive & torch.isin(tok, stop_ids)
            stopped[row_ids] |= hit
            done |= hit
            n_alive = int((~done).sum())
            if n_alive == 0 or t == max_new - 1:
                break
            if self.shrink_finished and n_alive <= done.shape[0] // 2:
                keep = self._shrink(done, n_alive)
                self._reorder(cache, keep)
                tok, done, row_ids, mask, real_len = tok[keep], done[keep], row_ids[keep], mask[keep], real_len[keep]
                if lean_mask is not None:
                    lean_mask = lean_mask[keep]
                if procs is not None:
                    procs.keep(keep)
            # the token chosen at step t sits at position real_len + t of its row and at cache slot prompt_len + t
            if lean is not None:
                self.shapes_seen.add((tok.shape[0], 1, mask.shape[1]))
                logits = lean.step(tok, real_len + t, cache, prompt_len + t, lean_mask)  # (batch, vocab)
                self.lean_steps += 1
            else:
                logits = self._forward(tok[:, None], mask, (real_len + t)[:, None], cache, kv_len=prompt_len + t + 1)
        return out_tokens, out_logp, out_len, stopped

    def _prefill(
        self, rows: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: StaticCache
    ) -> torch.Tensor:
        """Run the prompts once; rows with the same prompt (the ``n`` samples) share one prefill.

        The distinct prompts are prefilled as a smaller power-of-two batch, then their cache rows and last logits
        are copied out to every row that has that prompt. Returns ``(batch, vocab)`` logits.
        """
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(r), i) for i, r in enumerate(rows)]  # row -> first row with its prompt
        uniq = sorted(set(src))
        if self.packed_prefill and self.fast_paths.packed_prefill(cache, mask.shape[1]):  # else said once, padded
            if not self.share_prefix:
                src, uniq = list(range(len(rows))), list(range(len(rows)))
            return packed_prefill(
                self.model,
                rows,
                src,
                uniq,
                ids.shape[1],
                cache,
                max_tokens=self.packed_prefill_tokens,
                shapes_seen=self.shapes_seen,
                device=self.device,
            )
        if not self.share_prefix or len(uniq) == len(rows):
            return self._forward(ids, mask, pos, cache)
        sub = uniq + [uniq[0]] * (_next_pow2(len(uniq)) - len(uniq))  # pad to a power of two
        sel = torch.tensor(sub, device=ids.device)
        logits = self._forward(ids[sel], mask[sel], pos[sel], cache)  # (sub batch, vocab)
        where = {row: j for j, row in enumerate(sub[: len(uniq)])}
        expand = torch.tensor([where[s] for s in src], device=ids.device)  # (batch,) row -> prefill row
        self._reorder(cache, expand)
        return logits[expand]

    @staticmethod
    def _reorder(cache: StaticCache, index: torch.Tensor) -> None:
        """Make the cache's batch rows ``cache[index]`` (copies; the batch size becomes ``len(index)``)."""
        cache.reorder_cache(index)
        for layer in cache.layers:  # reorder_cache re-sizes the tensors, not this bookkeeping field
            if hasattr(layer, "max_batch_size"):
                layer.max_batch_size = index.shape[0]

    @staticmethod
    def _shrink(done: torch.Tensor, n_alive: int) -> torch.Tensor:
        """Rows to keep: the unfinished ones, topped up with finished ones to a power of two. ``(new_batch,)``."""
        new_batch = _next_pow2(n_alive)
        alive_idx = (~done).nonzero().squeeze(-1)
        fill_idx = done.nonzero().squeeze(-1)[: new_batch - n_alive]
        return torch.cat([alive_idx, fill_idx])

    @staticmethod
    def _output(tokens: torch.Tensor, logp: torch.Tensor | None, length: int, stopped: bool) -> SampleOutput:
        return SampleOutput(
            token_ids=tokens[:length].tolist(),
            logprobs=logp[:length].tolist() if logp is not None else None,
            finish_reason="stop" if stopped else "length",
        )
