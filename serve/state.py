"""The server's durable state: one JSON record per file and per batch on the object store, under
``<KVBATCH_ROOT>/batch_api/`` (``files/<id>.json`` next to ``files/<id>.jsonl``,
``batches/<id>.json``, and each batch's work folder ``work/<id>/``).

A record is written whole (a temp name, then a commit), so a server killed at any moment leaves
either the old record or the new one. One server writes the records; on start it reads them
all back, so a restarted server reports the same files and batches.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from fsspec.core import url_to_fs

from kvbatch.io.batch_output import AtomicSink
from kvbatch.io.shard_tables import write_json


class StateStore:
    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs, self._root = url_to_fs(self.url, **self.storage_options)
        self._lock = threading.Lock()

    def join(self, *names: str) -> str:
        return "/".join([self.url, *names])

    def _path(self, *names: str) -> str:
        return "/".join([self._root.rstrip("/"), *names])

    def put_record(self, kind: str, id_: str, record: Mapping[str, Any]) -> None:
        with self._lock:
            write_json(record, self.join(kind, f"{id_}.json"), storage_options=self.storage_options)

    def records(self, kind: str) -> Iterator[dict[str, Any]]:
        try:
            paths = self._fs.ls(self._path(kind), detail=False)
        except FileNotFoundError:
            return
        for p in sorted(paths):
            name = p.rsplit("/", 1)[-1]
            if name.endswith(".json") and not name.startswith("."):
                yield json.loads(self._fs.cat_file(p))

    def delete(self, kind: str, name: str) -> None:
        try:
            self._fs.rm_file(self._path(kind, name))
        except FileNotFoundError:
            pass

    def open_blob(self, kind: str, name: str) -> Any:
        return self._fs.open(self._path(kind, name), "rb")

    def sink(self, kind: str, name: str) -> AtomicSink:
        return AtomicSink(self.join(kind, name), self.storage_options)
