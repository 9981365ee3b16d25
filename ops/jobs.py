"""The unit of work every step hands the engine: a request rendered, tokenized and checked
against the context window (:class:`Job`), or the reason it cannot run (:class:`Rejected`).

``kvbatch generate``, the shard builder and the decode of manifests all make jobs here, so a
row is refused for the same reason, with the same words, whichever path it takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.text.structured import schema_error
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.io.batch_requests import CHAT_COMPLETIONS_URL, ChatRequest, InputStreamError, RejectedRow, reject
from kvbatch.io.endpoints import prompt_field, schema_field
from kvbatch.ops.shards.prompt_tokens import CachedChatEncoder

if TYPE_CHECKING:  # tokenizing steps import this module without torch
    from kvbatch.engine.runtime.llm import LLM


@dataclass
class Job:
    """One request ready for the engine: its place in the output and what to run."""

    index: int
    custom_id: str
    line_no: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    model: str | None = None
    endpoint: str = CHAT_COMPLETIONS_URL  # the API the row was written for: the answer's shape


@dataclass
class Rejected:
    index: int
    row: RejectedRow


def to_engine_sampling(req: ChatRequest) -> SamplingParams:
    """The row's sampling fields as the engine's :class:`SamplingParams` (every field: the edge's
    dataclass mirrors the engine's, ``logit_bias`` and the penalties included)."""
    return SamplingParams(**dataclasses.asdict(req.sampling))


def logit_bias_problem(tokenizer: ChatTokenizer | CachedChatEncoder, req: ChatRequest) -> str | None:
    """Why the row's ``logit_bias`` names a token the model does not have, or None. Checked here,
    where the tokenizer is, like the prompt's length (the edge parser has no vocabulary)."""
    if not req.sampling.logit_bias:
        return None
    vocab = getattr(tokenizer, "tokenizer", tokenizer).vocab_size
    bad = [tok for tok, _ in req.sampling.logit_bias if tok >= vocab]
    if not bad:
        return None
    names = ", ".join(map(str, bad))
    which = f"tokens {names} are" if len(bad) > 1 else f"token {names} is"
    return f"{which} outside the model's vocabulary (ids 0 to {vocab - 1})"


def tokenize_requests(llm: LLM, items: Iterator[ChatRequest | RejectedRow]) -> Iterator[Job | Rejected]:
    """Render and tokenize each valid row; a row the template refuses or that does not fit the
    context window becomes a rejection, like any other bad row."""
    if llm.tokenizer is None:
        raise ValueError("chat requests need a model with a tokenizer")
    for index, item in enumerate(items):
        yield tokenize_request(llm.tokenizer, llm.max_model_len, index, item)


def tokenize_request(tokenizer: ChatTokenizer | CachedChatEncoder, max_model_len: int, index: int,
                     item: ChatRequest | RejectedRow) -> Job | Rejected:
    """One row of :func:`tokenize_requests`; needs only the tokenizer, so a worker process that
    rebuilt it from the checkpoint's tokenizer source gives exactly the same answer."""
    if isinstance(item, RejectedRow):
        return Rejected(index, item)
    if item.sampling.response_format is not None:  # a schema the grammar engine refuses: this row's 400
        problem = schema_error(item.sampling.response_format)
        if problem is not None:
            return Rejected(index, reject(item, schema_field(item.endpoint), problem))
    problem = logit_bias_problem(tokenizer, item)
    if problem is not None:
        return Rejected(index, reject(item, "body.logit_bias", problem))
    ids = prompt_ids(tokenizer, max_model_len, item)
    if isinstance(ids, RejectedRow):
        return Rejected(index, ids)
    return Job(index, item.custom_id, item.line_no, ids, to_engine_sampling(item), item.model, item.endpoint)


def prompt_ids(tokenizer: ChatTokenizer | CachedChatEncoder, max_model_len: int,
               item: ChatRequest) -> list[int] | RejectedRow:
    """The prompt's token ids, or why it cannot run (the shard builder needs no more than this):
    the messages rendered by the chat template, or a ``/v1/completions`` row's raw prompt as it is."""
    field = prompt_field(item.endpoint)
    if item.prompt is not None:
        ids = raw_prompt_ids(tokenizer, item.prompt)
        if isinstance(ids, str):
            return reject(item, field, ids)
    else:
        try:
            ids = tokenizer.encode_chat(item.messages)
        except ValueError as exc:  # a template that raises for this conversation
            return reject(item, field, f"chat template failed: {exc}")
    if len(ids) >= max_model_len:
        return reject(item, field, f"prompt is {len(ids)} tokens; the context window is {max_model_len}")
    return ids


def raw_prompt_ids(tokenizer: ChatTokenizer | CachedChatEncoder, prompt: str | tuple[int, ...]) -> list[int] | str:
    """A completions prompt's ids, or why it cannot run: token ids as given (each in the
    tokenizer's vocabulary), text tokenized as Hugging Face's ``tokenizer(prompt)`` and vLLM's
    ``/v1/completions`` do: control tokens written in the text are control tokens (a raw prompt
    may spell its own template) and the tokenizer's own additions (a BOS) are made. No chat template."""
    chat = tokenizer.tokenizer if isinstance(tokenizer, CachedChatEncoder) else tokenizer
    if isinstance(prompt, tuple):
        vocab = chat.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the model's vocabulary (ids 0 to {vocab - 1})"
        return list(prompt)
    # ChatTokenizer.encode tokenizes control-token spellings as characters (right for message
    # content, wrong for a raw prompt): the inner tokenizer that parses them is the one to use.
    ids = chat._tok.encode(prompt, add_special_tokens=True).ids
    return ids if ids else "the prompt is empty: it has no tokens to continue"


class IncompleteInput(Exception):
    """The input broke part-way; everything read before the break was answered and the output
    committed (its last line says where the input ended). ``report`` is the run's report."""

    def __init__(self, error: InputStreamError, report: Any) -> None:
        self.error = error
        self.report = report
        super().__init__(str(error))
