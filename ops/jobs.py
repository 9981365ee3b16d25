"""The unit of work every step hands the engine: a request rendered, tokenized and checked
against the context window (:class:`Job`), or the reason it cannot run (:class:`Rejected`).

``kvbatch generate``, the shard builder and the decode of manifests all make jobs here, so a
row is refused for the same reason, with the same words, whichever path it takes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbatch.engine.runtime.sampling_params import SamplingParams
from kvbatch.engine.text.structured import schema_error, tools_error
from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.engine.text.tool_calls import MARKERS, ToolsSpec, history_for_format, is_tools_spec, with_format
from kvbatch.io.batch_requests import (
    CHAT_COMPLETIONS_URL,
    RESPONSES_URL,
    ChatRequest,
    InputStreamError,
    RejectedRow,
    reject,
)
from kvbatch.io.endpoints import prompt_field, schema_field
from kvbatch.io.tools import has_tool_history
from kvbatch.io.urls import redact
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
    n: int = 1  # choices: n engine requests over this one prompt, gathered into one answer
    # A completions row's ``echo``: the prompt's text, put before each choice's text in the output
    # line (ops.decode.generate.answer_line); None: no echo. Output only, so not in ``sampling``: the
    # engine and the response cache's key are those of the same row without it.
    echo: str | None = None


def choice_request_id(index: int, choice: int) -> str:
    """The engine request id of a row's ``choice``: the row's index for choice 0 (what a row of one
    choice has always had), ``<index>.<choice>`` for the others."""
    return str(index) if choice == 0 else f"{index}.{choice}"


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` (> 0) of a row seeded with ``seed``: a 64-bit signed integer
    hashed from both, so each choice draws its own reproducible stream, unrelated to its
    neighbours' (``seed + i`` would make choice 1 of seed s choice 0 of seed s + 1)."""
    digest = hashlib.sha256(f"kvbatch-choice:{seed}:{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The sampling parameters of a row's ``choice``. Choice 0 is the row's own (so choice 0 of a
    seeded row of n choices is the answer the row gives with n = 1); a seeded sampled row's choice
    i > 0 draws from :func:`choice_seed`. A row without a seed gets a fresh seed per request from
    the engine, and a greedy one draws nothing: both keep their parameters, so n greedy choices
    are n equal answers (and one response-cache key)."""
    if choice == 0 or sampling.seed is None or sampling.greedy:
        return sampling
    return dataclasses.replace(sampling, seed=choice_seed(sampling.seed, choice))


@dataclass
class Rejected:
    index: int
    row: RejectedRow


def to_engine_sampling(req: ChatRequest) -> SamplingParams:
    """The row's sampling fields as the engine's :class:`SamplingParams` (every field: the edge's
    dataclass mirrors the engine's, ``logit_bias`` and the penalties included). A tools spec whose
    ``tool_choice`` is ``none`` constrains nothing: the tools are in the prompt, the engine gets no grammar."""
    params = SamplingParams(**dataclasses.asdict(req.sampling))
    if is_tools_spec(params.response_format) and ToolsSpec.parse(params.response_format).choice == "none":
        params = dataclasses.replace(params, response_format=None)
    return params


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
    if is_tools_spec(item.sampling.response_format):  # a tool schema the grammar engine refuses: this row's 400
        bad_tool = tools_error(item.sampling.response_format)
        if bad_tool is not None:
            flat = item.endpoint == RESPONSES_URL  # a Responses tool spells its fields flat
            where = f"body.tools.{bad_tool[0]}.{'' if flat else 'function.'}parameters"
            return Rejected(index, reject(item, where, bad_tool[1]))
    elif item.sampling.response_format is not None:  # a schema the grammar engine refuses: this row's 400
        problem = schema_error(item.sampling.response_format)
        if problem is not None:
            return Rejected(index, reject(item, schema_field(item.endpoint), problem))
    problem = logit_bias_problem(tokenizer, item)
    if problem is not None:
        return Rejected(index, reject(item, "body.logit_bias", problem))
    ids = prompt_ids(tokenizer, max_model_len, item)
    if isinstance(ids, RejectedRow):
        return Rejected(index, ids)
    item = with_tool_format(item, tokenizer.tokenizer if isinstance(tokenizer, CachedChatEncoder) else tokenizer)
    return request_job(index, item, ids, echo=echo_text(tokenizer, item))


def request_job(index: int, item: ChatRequest, ids: list[int], *, echo: str | None = None) -> Job:
    """The job of a valid, tokenized row: every field of the request the engine and the answer need
    (its sampling, model, endpoint and choices), so no path that makes jobs can drop one. ``echo``:
    the text :func:`echo_text` gives (it needs the tokenizer; a row without ``echo`` has none)."""
    return Job(index, item.custom_id, item.line_no, ids, to_engine_sampling(item), item.model, item.endpoint,
               n=item.n, echo=echo)


def echo_text(tokenizer: ChatTokenizer | CachedChatEncoder, item: ChatRequest) -> str | None:
    """The text a completions row with ``echo`` puts before its answer, or None (no ``echo``): the
    prompt as written, or the decoding of a prompt given as token ids, special tokens kept (vLLM
    echoes such a prompt as ``tokenizer.decode(ids)``, which keeps them too)."""
    if not item.echo or item.prompt is None:
        return None
    if isinstance(item.prompt, str):
        return item.prompt
    chat = tokenizer.tokenizer if isinstance(tokenizer, CachedChatEncoder) else tokenizer
    return chat.decode(item.prompt, skip_special_tokens=False)


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
        tools = ToolsSpec.parse(item.sampling.response_format).tools if is_tools_spec(item.sampling.response_format) else None
        try:
            if tools is not None or has_tool_history(item.messages):  # only a template with a tool-call format
                chat = tokenizer.tokenizer if isinstance(tokenizer, CachedChatEncoder) else tokenizer
                if chat.tool_call_format is None:
                    return reject(item, "body.tools" if tools is not None else field, no_tool_format(chat))
                ids = chat.encode_chat(history_for_format(item.messages, chat.tool_call_format), tools=tools)
            else:
                ids = tokenizer.encode_chat(item.messages)
        except ValueError as exc:  # a template that raises for this conversation
            return reject(item, field, f"chat template failed: {exc}")
    if len(ids) >= max_model_len:
        return reject(item, field, f"prompt is {len(ids)} tokens; the context window is {max_model_len}")
    return ids


def no_tool_format(chat: ChatTokenizer) -> str:
    """The reason a row with tools (or a tool-call history) cannot run on this model."""
    return (f"tool calling needs a chat template that renders tools and tool calls; the chat template of "
            f"{redact(chat.source) if chat.source else 'this model'} has no tool-call format (known: Hermes, '<tool_call>' JSON "
            f"'</tool_call>', as Qwen2.5 and Qwen3 templates write it; Llama 3.1+'s bare JSON call; Mistral's "
            f"'[TOOL_CALLS] [...]')")


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


def with_tool_format(item: ChatRequest, chat: ChatTokenizer) -> ChatRequest:
    """The row with its tools spec in the template's tool-call format (and its marker's control
    token, where the vocabulary has one): the request reader knows no model, and the grammar and the
    output parser read them from the spec. Other rows, and any row of a template without a format
    (prompt_ids refuses its tool rows), as they are."""
    rf, fmt = item.sampling.response_format, chat.tool_call_format
    if fmt is None or rf is None or not is_tools_spec(rf):
        return item
    spec = with_format(rf, fmt, tool_control_token(chat, fmt))
    if spec == rf:
        return item
    return dataclasses.replace(item, sampling=dataclasses.replace(item.sampling, response_format=spec))


def tool_control_token(chat: ChatTokenizer, fmt: str) -> int | None:
    """The id of the format's marker (``[TOOL_CALLS]``, ``<|python_tag|>``) when it is a control
    token of the vocabulary, or None: the grammar lets the model write it as it was trained to."""
    marker = MARKERS.get(fmt)
    token_id = None if marker is None else chat.token_id(marker)
    return token_id if token_id in chat.special_token_ids else None
