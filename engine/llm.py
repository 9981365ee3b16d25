"""The engine's Python API: ``LLM(model).generate(requests)`` and a streaming variant.

``LLM`` ties the pieces together: the scheduler decides, the runner computes, the sampler
picks, and this module turns finished sequences into :class:`Result`s with text, usage and
timings. It holds no global state; two ``LLM`` objects in one process are independent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kvbatch.engine.block_hash import root_key
from kvbatch.engine.block_manager import BlockManager
from kvbatch.engine.config import EngineConfig, ModelConfig
from kvbatch.engine.model import LlamaModel
from kvbatch.engine.model_runner import ModelRunner
from kvbatch.engine.sampler import sample, top_logprobs
from kvbatch.engine.sampling_params import SamplingParams
from kvbatch.engine.scheduler import Scheduler
from kvbatch.engine.sequence import Sequence
from kvbatch.engine.stop_checker import StopChecker
from kvbatch.engine.tokenizer import ChatTokenizer
from kvbatch.engine.weights import Checkpoint, ModelLoadError, load_checkpoint

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


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


class LLM:
    def __init__(
        self,
        model: str | Checkpoint,
        *,
        dtype: str | torch.dtype = "fp32",
        engine_config: EngineConfig | None = None,
        seed: int = 0,
        num_threads: int | None = None,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.dtype = parse_dtype(dtype)
        self.checkpoint = model if isinstance(model, Checkpoint) else load_checkpoint(model)
        self.model_config = ModelConfig.from_hf(self.checkpoint.config)
        self.engine_config = ec = engine_config or EngineConfig()
        self.model = LlamaModel(self.model_config, self.checkpoint.tensors, self.dtype, ec.batch_invariant)
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
        num_blocks = ec.num_blocks or max(1, min(ec.kv_cache_bytes // per_block, useful))
        self.runner = ModelRunner(self.model, num_blocks, ec.block_size, self.dtype)
        dtype_name = str(self.dtype).removeprefix("torch.")
        self.kv_root_key = root_key(self.checkpoint.fingerprint, dtype_name, ec.block_size)
        self.block_manager = BlockManager(num_blocks, ec.block_size, self.kv_root_key, ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, ec.max_num_seqs, ec.max_num_batched_tokens)
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._next_seq_id = 0
        self._stops: dict[int, StopChecker] = {}
        eos = set(self.tokenizer.eos_token_ids if self.tokenizer else [])
        cfg_eos = self.checkpoint.config.get("eos_token_id")
        eos.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.stats = {"steps": 0, "prompt_tokens": 0, "computed_prompt_tokens": 0, "output_tokens": 0}

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
        gen = None
        if not p.greedy:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            gen = torch.Generator().manual_seed(seed)
        seq = Sequence(self._next_seq_id, request.request_id, ids, p, generator=gen)
        self._next_seq_id += 1
        self._stops[seq.seq_id] = StopChecker(self.tokenizer, p.stop)
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(ids)
        return seq

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Result]:
        """Schedule, compute and sample once; returns the requests that finished."""
        step = self.scheduler.schedule()
        if not step:
            return []
        logits, sampled = self.runner.execute(step)
        now = time.perf_counter()
        self.stats["steps"] += 1
        for s in step:
            if s.seq.num_computed_tokens < s.seq.num_prompt_tokens:
                self.stats["computed_prompt_tokens"] += min(s.num_new_tokens,
                                                            s.seq.num_prompt_tokens - s.seq.num_computed_tokens)
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit(s.seq)
        tokens = sample(logits, [s.seq.sampling for s in sampled], [s.seq.generator for s in sampled])
        finished: list[Result] = []
        for row, (s, tok) in enumerate(zip(sampled, tokens)):
            seq = s.seq
            seq.token_ids.append(tok)
            self.stats["output_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.sampling.logprobs is not None:
                seq.logprobs.append(top_logprobs(logits[row], tok, seq.sampling.logprobs))
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
                finished.append(self._result(seq))
        return finished

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
        )

    def stream(self, requests: Iterable[GenerationRequest], max_waiting: int | None = None) -> Iterator[Result]:
        """Yield results as requests finish, pulling new requests only as capacity frees up,
        so memory stays bounded however long the input is."""
        cap = max_waiting or 2 * self.engine_config.max_num_seqs
        it = iter(requests)
        exhausted = False
        while True:
            while not exhausted and len(self.scheduler.waiting) < cap:
                try:
                    self.add_request(next(it))
                except StopIteration:
                    exhausted = True
            if not self.scheduler.has_work():
                if exhausted:
                    return
                continue
            yield from self.step()

    def generate(self, requests: list[GenerationRequest]) -> list[Result]:
        """Run every request to completion; results come back in input order."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        by_id = {r.request_id: r for r in self.stream(requests)}
        return [by_id[i] for i in ids]
