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
from kvbatch.io.batch_requests import ChatRequest, InputStreamError, RejectedRow, reject
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


@dataclass
class Rejected:
    index: int
    row: RejectedRow


def to_engine_sampling(req: ChatRequest) -> SamplingParams:
    return SamplingParams(**dataclasses.asdict(req.sampling))


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
            return Rejected(index, reject(item, "body.response_format.json_schema.schema", problem))
    ids = prompt_ids(tokenizer, max_model_len, item)
    if isinstance(ids, RejectedRow):
        return Rejected(index, ids)
    return Job(index, item.custom_id, item.line_no, ids, to_engine_sampling(item), item.model)


def prompt_ids(tokenizer: ChatTokenizer | CachedChatEncoder, max_model_len: int,
               item: ChatRequest) -> list[int] | RejectedRow:
    """The prompt's token ids, or why it cannot run (the shard builder needs no more than this)."""
    try:
        ids = tokenizer.encode_chat(item.messages)
    except ValueError as exc:  # a template that raises for this conversation
        return reject(item, "body.messages", f"chat template failed: {exc}")
    if len(ids) >= max_model_len:
        return reject(item, "body.messages", f"prompt is {len(ids)} tokens; the context window is {max_model_len}")
    return ids


class IncompleteInput(Exception):
    """The input broke part-way; everything read before the break was answered and the output
    committed (its last line says where the input ended). ``report`` is the run's report."""

    def __init__(self, error: InputStreamError, report: Any) -> None:
        self.error = error
        self.report = report
        super().__init__(str(error))
