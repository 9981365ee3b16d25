"""A record batch of prompts to its token id and block key columns, without rendering the chat
template or tokenizing per row.

The shard step spent its time in per-row Python: a jinja render per row, a sha256 per KV block
through numpy, and dicts in and out of every row. :class:`ColumnarTokenizer` does per distinct
thing what must be done, and the rest with Arrow:

- **The template is rendered once per conversation shape** (the sequence of roles), with a
  sentinel in place of each content: the render is then template text around content slots,
  and a row's render is that text with its contents spliced in. This is exact only for a
  template that copies content verbatim and does not branch on it, so: the template's syntax
  tree must use content only to print it (:func:`content_printed_only`: no test, filter,
  method call or assignment on it), and each shape is checked by rendering probe
  conversations (whitespace at the ends, empty content, quotes, text that looks like markup)
  and the first real conversation of the shape in full, against the splice. A template or
  shape that fails, or whose sentinels do not come back once each and in order, takes the
  per-row path (:class:`~kvbatch.ops.shards.prompt_tokens.CachedChatEncoder`) for every row.
- **The ids are the concatenation of the ids of the pieces between control tokens**, as in
  :mod:`kvbatch.ops.shards.prompt_tokens` (same conditions: no added token strips whitespace, and no
  content spells or can complete a control token with the template text beside it; a content
  that could goes per row). Distinct pieces not seen before are tokenized together with the
  Rust tokenizer's ``encode_batch``, which uses every core; the rest come from a bounded cache.
- **A distinct conversation is tokenized and hashed once per batch**: contents are
  dictionary-encoded by Arrow, rows that repeat a conversation share its ids and block keys,
  and the per-row columns are an Arrow ``take`` of the per-conversation ones.
- **A ``/v1/completions`` row has no conversation**: its raw prompt (``prompt`` text or ``prompt_ids``)
  skips the chat template, so those rows take the per-row path and join the others' columns.
- **A tool row takes the per-row path too**: a row whose ``response_format`` is a tools spec (the
  template renders the tools) or whose messages hold a tool-call history (the template renders the
  calls) is tokenized as :func:`~kvbatch.ops.jobs.prompt_ids` does it for ``kvbatch generate``;
  finding them is a few Arrow passes, so a table without tool rows pays nothing more.
- **Block keys** chain sha256 over raw digests and the ids' little-endian int32 bytes: the
  bytes :func:`~kvbatch.engine.runtime.block_hash.block_key` hashes, without numpy per block.

tests/test_shard_columnar.py holds the columns equal to the per-row path (generated
conversations, hypothesis) and the shard files to those of ``build_shards(path="rows")``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvbatch.engine.text.tokenizer import ChatTokenizer
from kvbatch.engine.text.tool_calls import is_tools_spec
from kvbatch.io.batch_requests import CHAT_COMPLETIONS_URL, ChatRequest, RejectedRow, SamplingParams
from kvbatch.io.endpoints import prompt_field
from kvbatch.io.prompt_table import record_messages, record_request
from kvbatch.ops.jobs import prompt_ids
from kvbatch.ops.shards.prompt_tokens import DEFAULT_CACHE_PIECES, CachedChatEncoder

# Probe contents a content-transparent template renders verbatim (a template that trims,
# escapes or branches on content renders one of them differently from the splice).
_PROBES = ("x", "", "  padded both ends \n", "\n", "<think>\nstep\n</think>\n\nanswer", "{{ not jinja }}",
           "ünïcödé 数据 'quoted' \"double\"")

TOKEN_IDS_TYPE = pa.list_(pa.int32())
BLOCK_KEYS_TYPE = pa.list_(pa.string())


def content_printed_only(template: str | None) -> bool:
    """Whether a chat template uses message content only to print it (alone or joined with
    ``+``/``~`` inside an output), so that a render is the template text with the contents
    spliced in. A test (``'x' in content``), a filter (``| trim``), a method call
    (``content.split(...)``) or an assignment makes the template branch on or rewrite
    content: never spliced."""
    if not template:
        return False
    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    ok = True

    def visit(node: jinja2.nodes.Node, parents: tuple[jinja2.nodes.Node, ...]) -> None:
        nonlocal ok
        is_content = ((isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
                       and node.arg.value == "content")
                      or (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"))
        if is_content:
            chain = list(reversed(parents))
            while chain and isinstance(chain[0], (jinja2.nodes.Add, jinja2.nodes.Concat)):
                chain.pop(0)
            if not chain or not isinstance(chain[0], jinja2.nodes.Output):
                ok = False
        for child in node.iter_child_nodes():
            visit(child, (*parents, node))

    visit(tree, ())
    return ok


@dataclass(frozen=True)
class _Shape:
    """How one sequence of roles renders: items alternate template text (str) and content
    slots (int: the message index); ``None`` instead of a _Shape: not spliceable."""

    items: tuple[str | int, ...]
    # The template text right before and after each slot (for the control-token boundary check).
    before: tuple[str, ...]
    after: tuple[str, ...]


@dataclass
class BatchTokens:
    """One batch's outcome. Per row: ``ok`` (tokenized) or rejected (``rejects``, in row order).
    The ids and keys are per distinct conversation (``token_ids``, ``block_keys``); row ``i``
    (when ok) has those at ``conversation[i]``, so a caller takes the rows it wants in the order
    it wants with one ``take`` (:meth:`take`)."""

    ok: np.ndarray
    conversation: np.ndarray
    token_ids: pa.Array
    block_keys: pa.Array
    rejects: list[RejectedRow]
    fast_rows: int = 0  # rows whose conversation was spliced (the rest took the per-row path)

    def take(self, rows: np.ndarray) -> tuple[pa.Array, pa.Array]:
        """(token ids, block keys) of the given ok rows, in that order."""
        index = pa.array(self.conversation[rows])
        return self.token_ids.take(index), self.block_keys.take(index)


class ColumnarTokenizer:
    """Tokenizes ``PROMPTS_SCHEMA`` record batches as :func:`~kvbatch.ops.jobs.prompt_ids` does per row."""

    def __init__(self, encoder: CachedChatEncoder, max_model_len: int, kv_root_key: str, block_size: int,
                 max_pieces: int = DEFAULT_CACHE_PIECES) -> None:
        self.encoder = encoder
        self.tokenizer: ChatTokenizer = encoder.tokenizer
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_pieces = max_pieces
        self._root = bytes.fromhex(kv_root_key)
        self._inner = encoder._inner
        self._special_ids = encoder._special_ids
        self._split = encoder._split
        self._shapes: dict[tuple[str, ...], _Shape | None] = {}
        self._verified: set[tuple[str, ...]] = set()
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._max_special = max((len(t) for t in self._special_ids), default=0)
        # Splicing needs the piece-wise tokenizing of CachedChatEncoder and a template that
        # only prints content; otherwise every row takes the per-row path.
        self.splices = encoder.fast and content_printed_only(self.tokenizer.chat_template)

    # ------------------------------------------------------------ shapes

    def _shape(self, roles: tuple[str, ...]) -> _Shape | None:
        if roles not in self._shapes:
            self._shapes[roles] = self._learn_shape(roles) if self.splices else None
        return self._shapes[roles]

    def _learn_shape(self, roles: tuple[str, ...]) -> _Shape | None:
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(roles))]
        try:
            marked = self.tokenizer.render_chat([{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)])
        except ValueError:
            return None
        items: list[str | int] = []
        rest = marked
        for index, mark in enumerate(marks):
            head, found, rest = rest.partition(mark)
            if not found or mark in rest:
                return None
            items += [head, index]
        items.append(rest)
        if any(isinstance(t, str) and "\ue000" + nonce in t for t in items):
            return None
        texts = [t for t in items if isinstance(t, str)]
        shape = _Shape(tuple(items), tuple(texts[:-1]), tuple(texts[1:]))
        for probe in _PROBES:
            contents = [probe] * len(roles)
            if self._splice(shape, contents) != self._render(roles, contents):
                return None
        return shape

    def _render(self, roles: tuple[str, ...], contents: list[str]) -> str | None:
        try:
            return self.tokenizer.render_chat([{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)])
        except ValueError:
            return None

    @staticmethod
    def _splice(shape: _Shape, contents: list[str]) -> str:
        return "".join(item if isinstance(item, str) else contents[item] for item in shape.items)

    def _content_safe(self, shape: _Shape, slot: int, content: str) -> bool:
        """No control token inside ``content`` or across its edges with the template text beside it."""
        if self._split is None:
            return False
        if self._split.search(content):
            return False
        if content.endswith(self.encoder._prefixes) or content.startswith(self.encoder._suffixes):
            return False
        if len(content) < self._max_special:  # a short content could sit inside a token spanning both sides
            edge = self._max_special
            before, after = shape.before[slot][-edge:], shape.after[slot][:edge]
            for m in self._split.finditer(before + content + after):
                if m.start() < len(before) + len(content) and m.end() > len(before):
                    return False
        return True

    # ------------------------------------------------------------ pieces

    def _segments(self, shape: _Shape, contents: list[str]) -> list[str | int] | None:
        """The row's render cut at control tokens: text pieces (str) and control token ids (int)."""
        out: list[str | int] = []
        buffer = ""
        for item in shape.items:
            if isinstance(item, int):
                content = contents[item]
                if not self._content_safe(shape, item, content):
                    return None
                buffer += content
                continue
            for index, piece in enumerate(self._split.split(item)):  # type: ignore[union-attr]
                if index % 2:
                    if buffer:
                        out.append(buffer)
                    out.append(self._special_ids[piece])
                    buffer = ""
                else:
                    buffer += piece
        if buffer:
            out.append(buffer)
        return out

    def _encode_pieces(self, pieces: set[str]) -> None:
        """Tokenize the pieces not cached yet, together (encode_batch runs on every core)."""
        missing = []
        for piece in pieces:
            if piece in self._pieces:
                self._pieces.move_to_end(piece)  # this batch needs it: not the one to evict
                self.encoder.hits += 1
            else:
                missing.append(piece)
        if missing:
            for piece, enc in zip(missing, self._inner.encode_batch(missing, add_special_tokens=False), strict=True):
                self._pieces[piece] = enc.ids
            self.encoder.misses += len(missing)
        while len(self._pieces) > max(self.max_pieces, len(pieces)):
            self._pieces.popitem(last=False)

    def _ids(self, segments: list[str | int]) -> list[int]:
        ids: list[int] = []
        for seg in segments:
            if isinstance(seg, int):
                ids.append(seg)
            else:
                ids += self._pieces[seg]
        return ids

    def _block_keys(self, ids: list[int]) -> list[str]:
        data = np.asarray(ids, dtype="<i4").tobytes()
        step = 4 * self.block_size
        keys, parent = [], self._root
        for start in range(0, (len(ids) // self.block_size) * step, step):
            parent = hashlib.sha256(parent + data[start:start + step]).digest()
            keys.append(parent.hex())
        return keys

    # ------------------------------------------------------------ a batch

    def _tokenize_rows(self, batch: pa.RecordBatch | pa.Table) -> BatchTokens:
        """Every row through :func:`~kvbatch.ops.jobs.prompt_ids`, as the per-row path reads it."""
        outcomes = []
        for rec in batch.to_pylist():
            if rec.get("prompt") is not None or rec.get("prompt_ids") is not None:
                req = record_request(rec)  # a raw completions prompt: no template
            else:  # the response format holds a tool row's tools, which the template renders
                req = ChatRequest(rec["row"], rec["custom_id"], record_messages(rec["messages"]),
                                  SamplingParams(response_format=rec.get("response_format")), None,
                                  endpoint=rec.get("endpoint") or CHAT_COMPLETIONS_URL)
            outcomes.append(prompt_ids(self.encoder, self.max_model_len, req))
        ok = np.array([not isinstance(o, RejectedRow) for o in outcomes], dtype=bool)
        good = [o for o in outcomes if not isinstance(o, RejectedRow)]
        return BatchTokens(ok, np.where(ok, np.cumsum(ok) - 1, -1), pa.array(good, TOKEN_IDS_TYPE),
                           pa.array([self._block_keys(o) for o in good], BLOCK_KEYS_TYPE),
                           [o for o in outcomes if isinstance(o, RejectedRow)])

    def tokenize(self, batch: pa.RecordBatch | pa.Table) -> BatchTokens:
        """Token ids and block keys of every row of a ``PROMPTS_SCHEMA`` batch (or why not)."""
        raw = _raw_prompt_rows(batch) | _tool_rows(batch)
        if raw.any():
            return self._tokenize_mixed(batch, raw)
        return self._tokenize_chat(batch)

    def _tokenize_mixed(self, batch: pa.RecordBatch | pa.Table, raw: np.ndarray) -> BatchTokens:
        """Plain chat rows columnar, the ``raw`` ones (``/v1/completions``, tool rows) per row,
        joined in row order."""
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        chat_rows, raw_rows = np.flatnonzero(~raw), np.flatnonzero(raw)
        chat = self._tokenize_chat(table.take(pa.array(chat_rows))) if len(chat_rows) else None
        parts = [(chat_rows, chat), (raw_rows, self._tokenize_rows(table.take(pa.array(raw_rows))))]
        ok = np.zeros(len(raw), dtype=bool)
        conversation = np.full(len(raw), -1, dtype=np.int64)
        ids, keys, rejects, base = [], [], [], 0
        for rows, part in parts:
            if part is None:
                continue
            ok[rows] = part.ok
            conversation[rows] = np.where(part.ok, part.conversation + base, -1)
            ids.append(part.token_ids)
            keys.append(part.block_keys)
            rejects += zip(rows[~part.ok].tolist(), part.rejects, strict=True)
            base += len(part.token_ids)
        return BatchTokens(ok, conversation, pa.concat_arrays(ids), pa.concat_arrays(keys),
                           [r for _, r in sorted(rejects, key=lambda x: x[0])],
                           chat.fast_rows if chat is not None else 0)

    def _tokenize_chat(self, batch: pa.RecordBatch | pa.Table) -> BatchTokens:
        n = batch.num_rows
        messages = batch.column("messages")
        if isinstance(messages, pa.ChunkedArray):
            messages = messages.combine_chunks()
        offsets = np.asarray(messages.offsets)
        offsets = offsets - offsets[0]
        flat = pc.list_flatten(messages)
        if messages.null_count or flat.null_count or flat.field("role").null_count or flat.field("content").null_count:
            return self._tokenize_rows(batch)  # not a table ingest wrote: take no shortcut
        roles_enc = pc.dictionary_encode(flat.field("role"))
        contents_enc = pc.dictionary_encode(flat.field("content"))
        role_names = roles_enc.dictionary.to_pylist()
        contents = contents_enc.dictionary.to_pylist()
        n_roles = max(len(role_names), 1)
        codes = (np.asarray(contents_enc.indices, dtype=np.int64) * n_roles
                 + np.asarray(roles_enc.indices, dtype=np.int64)).tolist()
        # Distinct conversations of the batch (a conversation: its (content, role) codes).
        first_of: dict[tuple[int, ...], int] = {}
        row_conv = np.empty(n, dtype=np.int64)
        bounds = offsets.tolist()
        for i in range(n):
            key = tuple(codes[bounds[i]:bounds[i + 1]])
            row_conv[i] = first_of.setdefault(key, len(first_of))
        convs = list(first_of)
        # Each conversation: its segments (spliced), or None (the per-row path).
        segs: list[list[str | int] | None] = []
        for key in convs:
            roles = tuple(role_names[c % n_roles] for c in key)
            texts = [contents[c // n_roles] for c in key]
            shape = self._shape(roles)
            seg = self._segments(shape, texts) if shape is not None else None
            if seg is not None and roles not in self._verified:
                full = self._render(roles, texts)
                if full is None or full != self._splice(shape, texts):  # type: ignore[arg-type]
                    self._shapes[roles] = None
                    seg = None
                self._verified.add(roles)
            segs.append(seg)
        self._encode_pieces({s for seg in segs if seg is not None for s in seg if isinstance(s, str)})
        conv_ids: list[list[int] | RejectedRow] = []
        for key, seg in zip(convs, segs, strict=True):
            if seg is not None:
                ids = self._ids(seg)
                if len(ids) >= self.max_model_len:
                    conv_ids.append(RejectedRow(0, None, "body.messages", f"prompt is {len(ids)} tokens; the "
                                                f"context window is {self.max_model_len}"))
                else:
                    conv_ids.append(ids)
                continue
            msgs = [{"role": role_names[c % n_roles], "content": contents[c // n_roles]} for c in key]
            out = prompt_ids(self.encoder, self.max_model_len, ChatRequest(0, "", msgs, SamplingParams(), None))
            conv_ids.append(out)
        conv_ok = np.array([not isinstance(x, RejectedRow) for x in conv_ids], dtype=bool)
        ok = conv_ok[row_conv]
        good = [x for x in conv_ids if not isinstance(x, RejectedRow)]
        remap = np.cumsum(conv_ok) - 1  # conversation index -> index among the ok ones
        lengths = np.fromiter((len(x) for x in good), dtype=np.int64, count=len(good))
        conv_offsets = np.zeros(len(good) + 1, dtype=np.int32)
        np.cumsum(lengths, out=conv_offsets[1:])
        flat_ids = np.fromiter((t for x in good for t in x), dtype=np.int32, count=int(lengths.sum()))
        ids_arr = pa.ListArray.from_arrays(pa.array(conv_offsets), pa.array(flat_ids, pa.int32()))
        keys_arr = pa.array([self._block_keys(x) for x in good], BLOCK_KEYS_TYPE)
        rejects = []
        if not ok.all():
            rows, cids = batch.column("row").to_pylist(), batch.column("custom_id").to_pylist()
            endpoints = _endpoints(batch)
            for i in np.flatnonzero(~ok):
                r = conv_ids[row_conv[i]]
                # A conversation is shared by rows of any endpoint: each names its own prompt field.
                field = prompt_field(endpoints[i]) if r.field == "body.messages" else r.field  # type: ignore[union-attr]
                rejects.append(RejectedRow(rows[i], cids[i], field, r.reason))  # type: ignore[union-attr]
        spliced = np.array([s is not None for s in segs], dtype=bool)
        return BatchTokens(ok, np.where(ok, remap[row_conv], -1), ids_arr, keys_arr, rejects,
                           int(spliced[row_conv].sum()))


def _raw_prompt_rows(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    """Which rows have a raw prompt (``/v1/completions``: ``prompt`` or ``prompt_ids`` set)."""
    raw = np.zeros(batch.num_rows, dtype=bool)
    for name in ("prompt", "prompt_ids"):
        if name in batch.schema.names:
            raw |= np.asarray(pc.is_valid(batch.column(name)), dtype=bool)
    return raw


def _tool_rows(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    """Which rows have tools (a tools spec as ``response_format``) or a tool-call history (a
    message with ``tool_calls``, or of role ``tool``)."""
    n = batch.num_rows
    rows = np.zeros(n, dtype=bool)
    if "response_format" in batch.schema.names:
        formats = batch.column("response_format")
        if formats.null_count < n:  # each distinct format tested once
            if isinstance(formats, pa.ChunkedArray):
                formats = formats.combine_chunks()
            encoded = pc.dictionary_encode(formats)
            tools = np.array([is_tools_spec(f) for f in encoded.dictionary.to_pylist()] + [False], dtype=bool)
            rows |= tools[np.asarray(encoded.indices.fill_null(len(encoded.dictionary)), dtype=np.int64)]
    messages = batch.column("messages")
    if isinstance(messages, pa.ChunkedArray):
        messages = messages.combine_chunks()
    flat = pc.list_flatten(messages)
    if not len(flat):
        return rows
    history = pc.fill_null(pc.equal(flat.field("role"), "tool"), False)
    if flat.type.get_field_index("tool_calls") >= 0:
        history = pc.or_(history, pc.is_valid(flat.field("tool_calls")))
    if pc.any(history).as_py():
        rows[np.asarray(pc.list_parent_indices(messages))[np.asarray(history, dtype=bool)]] = True
    return rows


def _endpoints(batch: pa.RecordBatch | pa.Table) -> list[str | None]:
    """Each row's endpoint (None: chat completions, as in a table without the column)."""
    if "endpoint" not in batch.schema.names:
        return [None] * batch.num_rows
    return batch.column("endpoint").to_pylist()
