"""The engine's Python API: ``LLM(model).generate(requests)`` and a streaming variant.

``LLM`` ties the pieces together: the scheduler decides, the runner computes, the sampler
picks, and this module turns finished sequences into :class:`Result`s with text, usage and
timings. It holds no global state; two ``LLM`` objects in one process are independent.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.factory import build_model
from kvbatch.engine.models.llama import LlamaModel
from kvbatch.engine.models.weights import Checkpoint, ModelLoadError, load_checkpoint
from kvbatch.engine.runtime.block_hash import chain_keys, kv_layout_dtype, root_key, window_key
from kvbatch.engine.runtime.block_manager import BlockManager
from kvbatch.engine.runtime.engine_config import DTYPE_NAMES, EngineConfig, default_dtype_name, resolve_device
from kvbatch.engine.runtime.grammar_mask import apply_token_bitmask, fill_draft_bitmask
from kvbatch.engine.runtime.kv_connector import BlockStore, KVConnector
from kvbatch.engine.runtime.model_runner import ModelRunner
from kvbatch.engine.runtime.sampler import (
    HostReadback,
    host_to_device,
    logprob_entry,
    logprobs_on_device,
    sample_on_device,
)
from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.runtime.scheduler import Scheduler
from kvbatch.engine.runtime.sequence import Sequence
from kvbatch.engine.runtime.window_blocks import NULL_BLOCK, WindowPool, window_pool_blocks
from kvbatch.engine.speculative.controller import SpecConfig, SpecController
from kvbatch.engine.speculative.drafters import DraftRequest, build_drafter
from kvbatch.engine.speculative.verifier import VerifyRow, penalize_positions, verify_batch
from kvbatch.engine.text.stop_checker import StopChecker
from kvbatch.engine.text.structured import GrammarCompiler, draft_length
from kvbatch.engine.text.tokenizer import ChatTokenizer


class Admitted(enum.Enum):
    """Why :meth:`LLM.admit` stopped queueing requests."""

    FULL = "full"  # ``cap`` requests wait
    EXHAUSTED = "exhausted"  # the requests ran out
    TICK = "tick"  # a None: the caller wants control back before the next step


DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}


def configure_matmul(device: torch.device, precision: str) -> None:
    """fp32 matmul precision, set explicitly: ``highest`` keeps IEEE fp32 (no TF32) on CUDA GEMMs
    and convolutions alike; ``high`` allows TF32."""
    torch.set_float32_matmul_precision(precision)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision != "highest"
        torch.backends.cudnn.allow_tf32 = precision != "highest"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (use fp32 or bf16)")
    return DTYPES[dtype]


@dataclass
class GenerationRequest:
    """One prompt: either chat ``messages`` (rendered with the model's template) or token ids."""

    request_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    # Compute the KV of the prompt's full blocks (written to the store), sample nothing.
    prefill_only: bool = False


@dataclass
class Result:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    ttft_s: float
    tpot_s: float | None  # mean seconds per output token after the first
    num_preemptions: int = 0
    logprobs: list[dict] | None = None
    num_loaded_tokens: int = 0  # prompt tokens loaded from the external KV store
    block_keys: list[str] = field(default_factory=list)  # content keys of the prompt's full blocks
    # Speculative decoding (zeros without it): tokens drafted, drafts the target kept, and
    # target forward passes that decoded for this request.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_target_steps: int = 0
    # Why the request ended without an answer (finish_reason "error"): a response_format whose
    # schema cannot compile, or whose grammar allows no token at some step. None otherwise.
    error: str | None = None


class LLM:
    def __init__(
        self,
        model: str | Checkpoint,
        *,
        dtype: str | torch.dtype | None = None,
        engine_config: EngineConfig | None = None,
        kv_store: BlockStore | None = None,
        kv_store_write: bool = True,
        seed: int = 0,
        num_threads: int | None = None,
        speculative: SpecConfig | None = None,
        built_model: LlamaModel | None = None,
    ) -> None:
        """``built_model``: the model an earlier engine of this process built from this checkpoint
        with this dtype, device and engine config (``ops.engine_build`` keeps it, keyed by those):
        its weights are used as they are instead of being transposed and packed again."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.engine_config = ec = engine_config or EngineConfig()
        # The device first: an unavailable one is refused before any weight is read.
        self.device = resolve_device(ec.device)
        if self.device.type == "cuda" and ec.batch_invariant:
            raise ValueError("batch-invariant (deterministic) mode is implemented for the CPU only "
                             "(its fixed-order attention and GEMM padding are CPU kernels); use device cpu")
        self.dtype = parse_dtype(dtype if dtype is not None else default_dtype_name(self.device))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        configure_matmul(self.device, ec.matmul_precision)
        self.checkpoint = (model if isinstance(model, Checkpoint)
                           else load_checkpoint(model, keep_fp8=self.device.type == "cuda"))
        self.model_config = ModelConfig.from_hf(self.checkpoint.config)
        self.model = built_model if built_model is not None else build_model(
            self.model_config, self.checkpoint.tensors, self.dtype, ec.batch_invariant, self.device,
            self.checkpoint.expert_ids, ec.linear, ec.weights, self.checkpoint.gguf_blocks,
            self.checkpoint.fp8_weights, self.checkpoint.mxfp4_experts)
        self.tokenizer: ChatTokenizer | None = None
        self._tokenizer_error = ""
        try:
            self.tokenizer = ChatTokenizer.from_checkpoint(self.checkpoint)
        except ModelLoadError as exc:  # a checkpoint without a tokenizer still serves token ids
            self._tokenizer_error = str(exc)
        self.max_model_len = ec.max_model_len or self.model_config.max_position_embeddings
        per_block = ModelRunner.bytes_per_block(self.model, ec.block_size, self.dtype)
        # No more blocks than max_num_seqs full-length sequences can use: a tiny model must not
        # allocate (and zero) a whole kv_cache_bytes budget it can never fill.
        useful = ec.max_num_seqs * -(-self.max_model_len // ec.block_size)
        # Sliding layers hold only windows (window_blocks.py): their pool is sized for max_num_seqs
        # windows and comes off the budget first; the full layers' blocks get the rest.
        window = getattr(self.model, "cache_window", 0)
        window_block_bytes = ModelRunner.window_bytes_per_block(self.model, ec.block_size, self.dtype)
        window_blocks = (min(window_pool_blocks(window, ec.block_size, ec.max_num_seqs, ec.max_num_batched_tokens),
                             useful + 1) if window_block_bytes else 0)
        window_bytes = window_blocks * window_block_bytes
        if ec.num_blocks:
            num_blocks = ec.num_blocks
        elif self.device.type == "cuda":
            from kvbatch.engine.runtime.cuda_graphs import blocks_after_warmup

            fit = blocks_after_warmup(self.model, ec, max(per_block, 1), self.dtype, self.max_model_len)
            num_blocks = max(1, min(useful, fit - -(-window_bytes // max(per_block, 1))))
        else:
            num_blocks = max(1, min((ec.kv_cache_bytes - window_bytes) // max(per_block, 1), useful))
        window_blocks = min(window_blocks, num_blocks + 1)
        self.runner = ModelRunner(self.model, num_blocks, ec.block_size, self.dtype, window_blocks or None)
        self.readback = HostReadback(self.device)  # a step's one device-to-host read, counted
        # The weight format is part of the layout: int8 or GGUF weights give other K/V than full ones.
        self.kv_root_key = root_key(self.checkpoint.fingerprint, kv_layout_dtype(self.dtype, ec.weights),
                                    ec.block_size)
        self.block_manager = BlockManager(
            num_blocks, ec.block_size, self.kv_root_key, ec.enable_prefix_caching,
            WindowPool(window_blocks, ec.block_size, window, ec.enable_prefix_caching) if window_blocks else None)
        self.block_bytes = per_block
        self.connector = (KVConnector(kv_store, ec.block_size, per_block, write=kv_store_write,
                                      window=window if window_blocks else 0)
                          if kv_store is not None else None)
        self.scheduler = Scheduler(self.block_manager, ec.max_num_seqs, ec.max_num_batched_tokens, self.connector)
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._next_seq_id = 0
        self._stops: dict[int, StopChecker] = {}
        eos = set(self.tokenizer.eos_token_ids if self.tokenizer else [])
        cfg_eos = self.checkpoint.config.get("eos_token_id")
        eos.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.stats = {"steps": 0, "prompt_tokens": 0, "computed_prompt_tokens": 0, "output_tokens": 0,
                      "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_target_steps": 0,
                      "draft_s": 0.0, "step_s": 0.0}
        self.grammars: GrammarCompiler | None = None  # structured outputs: built at the first such request
        self.spec: SpecController | None = None
        self.drafter = None
        if speculative is not None:
            self.spec = SpecController(speculative)
            draft = self._draft_engine(speculative.draft_model, seed) if speculative.method == "draft" else None
            self.drafter = build_drafter(speculative, self, draft)
        if self.device.type == "cuda" and not ec.enforce_eager and self.spec is None:
            from kvbatch.engine.runtime.cuda_graphs import CudaGraphRunner

            self.runner.graphs = CudaGraphRunner.capture(self.runner, ec.max_num_seqs, self.max_model_len)

    def _draft_engine(self, model: str, seed: int) -> LLM:
        """The draft model of draft-model speculation: an engine of its own with this one's
        cache geometry, batch limits and numerics mode."""
        ec = self.engine_config
        return LLM(model, dtype=self.dtype, seed=seed, engine_config=EngineConfig(
            block_size=ec.block_size, max_num_seqs=ec.max_num_seqs, kv_cache_bytes=ec.kv_cache_bytes,
            max_model_len=self.max_model_len, batch_invariant=ec.batch_invariant, device=str(self.device),
            # On CUDA the target's cache already holds its share of memory: the draft gets as many
            # blocks as the target (the same sequences), not a share of what is left.
            num_blocks=len(self.block_manager.blocks) if self.device.type == "cuda" else None,
            enforce_eager=True, matmul_precision=ec.matmul_precision, linear=ec.linear, weights=ec.weights))

    # -- requests --------------------------------------------------------------------------
    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.messages is None:
            raise ValueError(f"request {request.request_id!r} has neither messages nor prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError(f"this checkpoint has no usable tokenizer ({self._tokenizer_error}): pass prompt_token_ids")
        return self.tokenizer.encode_chat(request.messages)

    def add_request(self, request: GenerationRequest, prompt_ids: list[int] | None = None) -> Sequence:
        ids = prompt_ids if prompt_ids is not None else self.prompt_ids(request)
        if not ids:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {len(ids)} tokens, the context window is "
                f"{self.max_model_len}")
        p = request.sampling
        if p.logit_bias and p.logit_bias[-1][0] >= self.model_config.vocab_size:
            raise ValueError(f"request {request.request_id!r}: logit_bias token {p.logit_bias[-1][0]} is outside "
                             f"the vocabulary (0..{self.model_config.vocab_size - 1})")
        gen = None
        if not p.greedy:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            gen = torch.Generator().manual_seed(seed)
        if request.prefill_only:
            ids = ids[: len(ids) // self.engine_config.block_size * self.engine_config.block_size]
            if not ids:
                raise ValueError(f"request {request.request_id!r}: prompt is shorter than one KV block")
        seq = Sequence(self._next_seq_id, request.request_id, ids, p, generator=gen,
                       prefill_only=request.prefill_only)
        self._next_seq_id += 1
        if p.response_format is not None:
            seq.matcher, seq.error = self._grammar_matcher(p.response_format)
        self._stops[seq.seq_id] = StopChecker(self.tokenizer, p.stop)
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(ids)
        return seq

    def _grammar_matcher(self, response_format: str) -> tuple[object | None, str | None]:
        """A constrained request's matcher (its schema compiled once per engine), or why not."""
        if self.tokenizer is None:
            return None, "response_format needs a model with a tokenizer"
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.tokenizer.vocab_size,
                                            sorted(self.eos_token_ids))
        return self.grammars.matcher(response_format)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Result]:
        """Schedule, (draft,) compute and sample once; returns the requests that finished."""
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.plan(self.scheduler.running, self.max_model_len, self.drafter.outlook)
        step = self.scheduler.schedule()
        if not step:
            return []
        if self.connector is not None:
            step = self._load_external(step)
            if not step:
                return []
            self.connector.before_step(step)  # no block still being saved is overwritten
        drafted_at = time.perf_counter()
        slots_offered = sum(s.num_spec for s in step)
        if self.drafter is not None:
            self._draft(step)
        started = time.perf_counter()
        logits, sampled = self.runner.execute(step)
        if self.connector is not None:
            self.connector.poll()  # store writes of landed saves, while the device computes
        now = time.perf_counter()
        self.stats["steps"] += 1
        # A decode-only step: a sample of what target passes and drafting cost (fed after sampling).
        decode_only = self.spec is not None and all(s.seq.num_computed_tokens >= s.seq.num_prompt_tokens for s in step)
        prompt_tokens = 0
        for s in step:
            seq = s.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            # Drafted tokens count as computed only once the verifier keeps them.
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec
            new_blocks = self.block_manager.commit(seq)
            if self.connector is not None:
                # Write through the prompt's newly completed blocks, except those just loaded.
                full_prompt_blocks = seq.num_prompt_tokens // self.engine_config.block_size
                first = len(seq.block_hashes) - len(new_blocks)
                loaded = {k for k, _ in seq.pending_loads}
                self._save_blocks([(k, b) for i, (k, b) in enumerate(new_blocks, start=first)
                                   if i < full_prompt_blocks and k not in loaded])
                computed_before = seq.num_computed_tokens - (s.num_new_tokens - s.num_spec)
                if self.runner.kv_window is not None and computed_before < seq.num_prompt_tokens <= seq.num_computed_tokens:
                    self._save_window(seq)
                seq.pending_loads = []
                seq.pending_window_loads = []
        self.stats["computed_prompt_tokens"] += prompt_tokens
        if self.connector is not None:
            self.connector.observe_prefill(prompt_tokens, now - started)
        finished: list[Result] = []
        # Logits rows per sampled entry: one, or one per draft plus the bonus row.
        offsets = [0]
        for s in sampled:
            offsets.append(offsets[-1] + s.num_spec + 1)
        plain: list[int] = []
        verified: list[int] = []
        undrafted: list[tuple[Sequence, int]] = []  # speculative rows sampled as plain ones, tokens before
        for i, s in enumerate(sampled):
            if s.seq.prefill_only:
                s.seq.finish_time = now
                self._finish(s.seq, "prefilled")
                finished.append(self._result(s.seq))
            elif self.spec is not None and s.seq.num_output_tokens > 0:
                if s.num_spec or not s.seq.sampling.greedy:
                    verified.append(i)
                else:
                    # A greedy row without drafts: the verifier would emit the argmax of its one
                    # row, which is what the plain sampler picks, without the verdict's [N, 1, V]
                    # tensors (most of a batched step's speculative overhead when few rows draft).
                    # A sampled row stays with the verifier, whose random draws it has been making.
                    plain.append(i)
                    undrafted.append((s.seq, s.seq.num_tokens))
                    self._count_verdict(s.seq, 0, 0)
            else:
                plain.append(i)
        if plain or verified:
            self._sample_and_verify(sampled, logits, offsets, plain, verified, now, finished)
        for seq, before in undrafted:
            if seq.finish_reason is None:
                self._roll_back(seq, before, 0)
        if self.spec is not None and decode_only:
            # The step's cost as the controller must weigh it: the target pass, and the sampling
            # and verification after it (the verifier's tensors grow with the drafting rows).
            self.spec.observe_step(sum(s.num_new_tokens for s in step), time.perf_counter() - started,
                                   slots_offered, started - drafted_at, drafted=any(s.num_spec for s in step))
        self.stats["step_s"] += time.perf_counter() - t0
        return finished

    def _sample_and_verify(self, sampled: list, logits: torch.Tensor, offsets: list[int], plain: list[int],
                           verified: list[int], now: float, finished: list[Result]) -> None:
        """Sample the plain entries and verify the speculative ones (one batched verifier call)
        on the logits' device, compute the logprobs asked for there too, then read all of it to
        the host in one copy: the step's one device-to-host sync (``self.readback.syncs``)."""
        if any(s.seq.sampling.penalized for s in sampled):  # logit bias and penalties, before any mask
            logits = penalize_positions(logits, [(s.seq.sampling, s.seq.output_token_ids,
                                                  s.seq.spec_token_ids[:s.num_spec]) for s in sampled])
        dead: dict[int, int] = {}  # verified entry -> the draft position where its grammar allows nothing
        if any(sampled[i].seq.sampling.response_format is not None for i in plain + verified):
            logits, dead = self._constrain(logits, sampled, offsets, plain, verified)
        # A verified entry's rows: one per draft it still has (a dead end cut some) plus the bonus row.
        ends = {i: offsets[i] + len(sampled[i].seq.spec_token_ids) + 1 for i in verified}
        rb = self.readback
        lp_rows: list[torch.Tensor] = []  # logits rows whose logprobs are wanted, and their tokens
        lp_tokens: list[torch.Tensor] = []
        lp_k = 0
        # Verified entries first, then plain ones: the order their logprob rows are queued and read.
        if verified:
            verdict = verify_batch([VerifyRow(logits[offsets[i]:ends[i]], sampled[i].seq.spec_token_ids,
                                              sampled[i].seq.spec_draft_probs, sampled[i].seq.sampling,
                                              sampled[i].seq.generator) for i in verified])
            at_acc, at_tok = rb.add(verdict.num_accepted), rb.add(verdict.tokens)
            for n, i in enumerate(verified):
                if sampled[i].seq.sampling.logprobs is not None:
                    # Every row of the entry: the host keeps those of the tokens it emits.
                    lp_rows.append(logits[offsets[i]:ends[i]])
                    lp_tokens.append(verdict.tokens[n, :ends[i] - offsets[i]])
                    lp_k = max(lp_k, sampled[i].seq.sampling.logprobs)
        if plain:
            wanted = [offsets[i] for i in plain]
            # Usually every row is a plain sample: no gather (and no index upload) needed then.
            rows = logits if wanted == list(range(logits.shape[0])) else logits.index_select(
                0, host_to_device(torch.tensor(wanted, dtype=torch.long), logits.device))
            entries = [sampled[i] for i in plain]
            ids = sample_on_device(rows, [s.seq.sampling for s in entries], [s.seq.generator for s in entries])
            at_ids = rb.add(ids)
            for row, s in enumerate(entries):
                if s.seq.sampling.logprobs is not None:
                    lp_rows.append(rows[row:row + 1])
                    lp_tokens.append(ids[row:row + 1])
                    lp_k = max(lp_k, s.seq.sampling.logprobs)
        at_lp = rb.add(logprobs_on_device(torch.cat(lp_rows), torch.cat(lp_tokens), lp_k)) if lp_rows else -1
        host = rb.read()
        lp_host = host[at_lp] if at_lp >= 0 else []
        lp_next = 0

        def logprobs(seq: Sequence, tokens: list[int], n_rows: int) -> list[dict] | None:
            """Entries for ``tokens`` from the next ``n_rows`` logprob rows read (None if not asked for)."""
            nonlocal lp_next
            k = seq.sampling.logprobs
            if k is None:
                return None
            got = [logprob_entry(lp_host[lp_next + j], tok, k) for j, tok in enumerate(tokens)]
            lp_next += n_rows
            return got

        if verified:
            for n, i in enumerate(verified):
                seq, rows, accepted = sampled[i].seq, ends[i] - offsets[i], int(host[at_acc][n])
                tokens = [int(t) for t in host[at_tok][n][:accepted + 1]]
                lp = logprobs(seq, tokens, rows)
                if dead.get(i) == accepted:  # the kept drafts reach a state that allows no token
                    self._apply_verdict(seq, tokens[:accepted], accepted, lp, now, finished)
                    if seq.finish_reason is None:
                        seq.error = self._no_token_error(seq)
                        self._fail(seq, now, finished)
                    continue
                self._apply_verdict(seq, tokens, accepted, lp, now, finished)
        if plain:
            for s, tok in zip(entries, host[at_ids]):
                lp = logprobs(s.seq, [int(tok)], 1)
                if s.seq.error is not None:  # its mask allowed nothing (or it never had a grammar)
                    self._fail(s.seq, now, finished)
                    continue
                self._emit(s.seq, [int(tok)], lp, now, finished)

    def _constrain(self, logits: torch.Tensor, sampled: list, offsets: list[int], plain: list[int],
                   verified: list[int]) -> tuple[torch.Tensor, dict[int, int]]:
        """``logits`` with each constrained entry's grammar masks applied (tensor ops over the whole
        step; only the bitmask's filling is per row, in llguidance): a plain entry's row gets its
        matcher's mask, a verified entry's row ``j`` the mask after its first ``j`` drafts.

        A plain entry whose mask allows nothing gets ``seq.error`` and an open mask: it is ended, not
        sampled. A verified entry whose mask at draft position ``j`` allows nothing keeps only
        ``drafts[:j]`` (nothing after that state may be verified) and is returned as ``{entry: j}``:
        it ends in error if the verifier keeps all ``j``, as plain decoding would after emitting them."""
        vocab = self.grammars.vocab_size if self.grammars is not None else logits.shape[1]
        rows = [(sampled[i].seq.matcher, offsets[i], sampled[i].seq.spec_token_ids if i in verified else [])
                for i in plain + verified if sampled[i].seq.matcher is not None and sampled[i].seq.error is None]
        bitmask, empty = fill_draft_bitmask(rows, logits.shape[0], vocab, logits.shape[1])
        owner = {r: i for i in plain + verified for r in range(offsets[i], offsets[i + 1])}
        dead: dict[int, int] = {}
        for row in sorted(empty):
            i = owner[row]
            seq = sampled[i].seq
            if i not in verified:
                seq.error = self._no_token_error(seq)
            elif i not in dead:  # its first dead end: the drafts after it are not verified
                dead[i] = row - offsets[i]
                seq.spec_token_ids = seq.spec_token_ids[:dead[i]]
                if seq.spec_draft_probs is not None:
                    seq.spec_draft_probs = seq.spec_draft_probs[:dead[i]]
        return apply_token_bitmask(logits, bitmask), dead

    @staticmethod
    def _no_token_error(seq: Sequence) -> str:
        return (f"response_format: the grammar allows no token after {seq.num_output_tokens} output "
                f"tokens ({seq.matcher.get_error() or 'no token of this model continues it'})")

    def _fail(self, seq: Sequence, now: float, finished: list[Result]) -> None:
        """End a request with its ``seq.error`` (finish_reason ``error``); the batch goes on."""
        seq.finish_time = now
        self._finish(seq, "error")
        finished.append(self._result(seq))

    def _save_blocks(self, blocks: list[tuple[str, int]]) -> None:
        """Write blocks through to the KV store. The connector copies them out of the cache
        through its staging pool (on CUDA: a side stream, no sync here); the store gets host
        tensors, so saved bytes are the same whatever the device."""
        assert self.connector is not None
        self.connector.save(blocks, self.runner.kv_cache)

    def _save_window(self, seq: Sequence) -> None:
        """A prompt just ended: write its sliding layers' last window to the KV store, the part of
        them a later hit on this prompt (a decode stage's) needs. Earlier blocks' sliding parts
        left the window pool as the prompt went; a prompt's full layers are saved whole."""
        assert self.connector is not None and self.block_manager.window is not None
        window = self.block_manager.window
        loaded = {k for k, _ in seq.pending_window_loads}
        blocks = []
        for i in range(window.first_kept(seq.num_prompt_tokens), seq.num_prompt_tokens // window.block_size):
            key, bid = window_key(seq.block_hashes[i]), seq.window_table[i]
            if bid != NULL_BLOCK and key not in loaded:
                blocks.append((key, bid))
        self.connector.save(blocks, self.runner.kv_window)

    def _draft(self, step: list) -> None:
        """Fill the reserved draft slots; a step entry shrinks to the drafts it actually got."""
        assert self.drafter is not None
        t0 = time.perf_counter()
        wanted = [s for s in step if s.num_spec]
        assert self.spec is not None
        drafts = self.drafter.propose([DraftRequest(s.seq, s.num_spec, self.spec.alpha(s.seq)) for s in wanted])
        for s, d in zip(wanted, drafts):
            if s.seq.matcher is not None and d.tokens:  # a constrained row verifies only what its grammar allows
                p = s.seq.sampling
                n = draft_length(s.seq.matcher, d.tokens, self.grammars.vocab_size, self.eos_token_ids, p.ignore_eos,
                                 d.probs is not None and not p.greedy)
                d.tokens, d.probs = d.tokens[:n], d.probs[:n] if d.probs is not None else None
            s.seq.spec_token_ids = d.tokens
            s.seq.spec_draft_probs = d.probs
            s.num_new_tokens -= s.num_spec - len(d.tokens)
            s.num_spec = len(d.tokens)
        self.stats["draft_s"] += time.perf_counter() - t0

    def _apply_verdict(self, seq: Sequence, tokens: list[int], num_accepted: int, logprobs: list[dict] | None,
                       now: float, finished: list[Result]) -> None:
        """Emit the kept drafts plus the target's token (``tokens``, from the batched verifier),
        and roll the rest back: counters, cache slots and the draft model's own cache."""
        drafts = seq.spec_token_ids
        before = seq.num_tokens
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        self._count_verdict(seq, len(drafts), num_accepted)
        if self._emit(seq, tokens, logprobs, now, finished):
            return
        self._roll_back(seq, before, num_accepted)

    def _count_verdict(self, seq: Sequence, drafted: int, num_accepted: int) -> None:
        """Count one target pass of a speculative row (before its tokens are emitted: a row that
        finishes now reports it) and tell the controller how its drafts fared."""
        seq.spec_draft_tokens += drafted
        seq.spec_accepted_tokens += num_accepted
        seq.spec_target_steps += 1
        self.stats["spec_draft_tokens"] += drafted
        self.stats["spec_accepted_tokens"] += num_accepted
        self.stats["spec_target_steps"] += 1
        assert self.spec is not None
        self.spec.observe(seq, drafted, num_accepted)

    def _roll_back(self, seq: Sequence, before: int, num_accepted: int) -> None:
        """After a speculative row's pass (it had ``before`` tokens): the kept drafts' K/V were
        written by this pass; later slots held rejected drafts (or draft slots nothing filled)."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.commit(seq)
        self.block_manager.trim(seq)
        self.drafter.after_verify(seq, before, num_accepted)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None, now: float,
              finished: list[Result]) -> bool:
        """Append tokens one by one (``logprobs[i]``: token i's entry, when asked for), stopping
        at the first that ends the request; True when it finished."""
        for i, tok in enumerate(tokens):
            if seq.matcher is not None and not seq.matcher.consume_token(tok):
                seq.error = f"response_format: token {tok} was refused by the grammar ({seq.matcher.get_error()})"
                self._fail(seq, now, finished)
                return True
            seq.token_ids.append(tok)
            self.stats["output_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                seq.finish_time = now
                self._finish(seq, reason)
                finished.append(self._result(seq))
                return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.release(seq)
            self.drafter.release(seq)

    def _load_external(self, step: list) -> list:
        """Fetch the stored blocks the scheduler planned to load; a block that does not arrive
        intact is recomputed, with everything after it (the counters simply move back). With
        sliding layers a stored prefix loads whole or not at all (its window belongs to its end):
        a sequence whose load fails is put back in the queue to recompute, and leaves this step.
        Returns the step that runs."""
        assert self.connector is not None
        bs = self.engine_config.block_size
        kept = []
        for s in step:
            seq = s.seq
            if not seq.pending_loads:
                kept.append(s)
                continue
            keys = [k for k, _ in seq.pending_loads]
            ok = self.connector.load(keys, [b for _, b in seq.pending_loads], self.runner.kv_cache)
            if self.runner.kv_window is not None:
                window_keys = [k for k, _ in seq.pending_window_loads]
                if ok == len(keys) and self.connector.load(window_keys, [b for _, b in seq.pending_window_loads],
                                                           self.runner.kv_window, tokens=False) == len(window_keys):
                    seq.num_loaded_tokens += ok * bs
                    kept.append(s)
                else:
                    seq.pending_loads, seq.pending_window_loads = [], []
                    self.scheduler.recompute(seq)
                continue
            seq.num_loaded_tokens += ok * bs
            if ok < len(keys):
                seq.num_computed_tokens -= (len(keys) - ok) * bs
                seq.pending_loads = seq.pending_loads[:ok]
            kept.append(s)
        return kept

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.sampling
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if self._stops[seq.seq_id].add(tok):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _result(self, seq: Sequence) -> Result:
        stop = self._stops.pop(seq.seq_id)
        out = seq.output_token_ids
        # The stop token itself (EOS, a stop id) is not part of the text, as in OpenAI's API.
        if seq.finish_reason == "stop" and not stop.matched and out and (
                out[-1] in self.eos_token_ids or out[-1] in seq.sampling.stop_token_ids):
            text_ids = out[:-1]
        else:
            text_ids = out
        text = stop.text if stop.matched else (self.tokenizer.decode(text_ids) if self.tokenizer else "")
        first = seq.first_token_time or seq.finish_time or seq.arrival_time
        n = len(out)
        tpot = (seq.finish_time - first) / (n - 1) if n > 1 and seq.finish_time else None
        return Result(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=list(out),
            text=text,
            finish_reason=seq.finish_reason or "length",
            num_cached_tokens=seq.num_cached_tokens,
            ttft_s=first - seq.arrival_time,
            tpot_s=tpot,
            num_preemptions=seq.num_preemptions,
            logprobs=seq.logprobs if seq.sampling.logprobs is not None else None,
            num_loaded_tokens=seq.num_loaded_tokens,
            block_keys=self.prompt_block_keys(seq.prompt_token_ids),
            spec_draft_tokens=seq.spec_draft_tokens,
            spec_accepted_tokens=seq.spec_accepted_tokens,
            spec_target_steps=seq.spec_target_steps,
            error=seq.error,
        )

    def prompt_block_keys(self, prompt_token_ids: list[int]) -> list[str]:
        """Content keys of every full block of a prompt, rooted at this model's fingerprint."""
        return chain_keys(self.kv_root_key, prompt_token_ids, self.engine_config.block_size)

    def stream(self, requests: Iterable[GenerationRequest | None],
               max_waiting: int | None = None) -> Iterator[Result | None]:
        """Yield results as requests finish, pulling new requests only as capacity frees up,
        so memory stays bounded however long the input is.

        A None among ``requests`` is a tick: it comes back as a None among the results once the
        requests before it are queued, before the next step. A caller that answers some rows
        itself (the response cache's hits) yields one whenever it has answers waiting, and so
        gets control back to hand them out however long the engine's next result takes."""
        cap = max_waiting or 2 * self.engine_config.max_num_seqs
        it = iter(requests)
        exhausted = False
        while True:
            if not exhausted:
                admitted = self.admit(it, cap)
                exhausted = admitted is Admitted.EXHAUSTED
                if admitted is Admitted.TICK:
                    yield None
            if not self.scheduler.has_work():
                if exhausted:
                    if self.connector is not None:
                        self.connector.drain()  # the last steps' saves reach the store
                    return
                continue
            yield from self.step()

    def admit(self, requests: Iterator[GenerationRequest | None], cap: int) -> Admitted:
        """Queue requests from ``requests`` until ``cap`` wait (``FULL``), it is exhausted
        (``EXHAUSTED``) or it yields a tick, a None (``TICK``: see :meth:`stream`)."""
        while len(self.scheduler.waiting) < cap:
            try:
                request = next(requests)
            except StopIteration:
                return Admitted.EXHAUSTED
            if request is None:
                return Admitted.TICK
            self.add_request(request)
        return Admitted.FULL

    def generate(self, requests: list[GenerationRequest]) -> list[Result]:
        """Run every request to completion; results come back in input order."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        by_id = {r.request_id: r for r in self.stream(requests)}
        return [by_id[i] for i in ids]
