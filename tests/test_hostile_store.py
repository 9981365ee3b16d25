"""A KV store someone else can write into: hostile or corrupt index files and names are
skipped and counted, nothing outside the store is ever deleted (issue 19, item 1), and a read
through a lying index is a counted miss, not a crash."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from kvbatch.cli.main import main
from kvbatch.io.kvstore.block_format import LAYOUT_VERSION, digest, pack_blocks
from kvbatch.io.kvstore.index_files import IndexInvalid, PackManifest, fingerprint_id
from kvbatch.io.kvstore.object_layout import LAYOUT_MARKER
from kvbatch.io.kvstore.object_tier import ObjectStoreTier
from kvbatch.io.kvstore.tiers import DiskTier, check_key

FP = "tiny-fingerprint"
FPID = fingerprint_id(FP)
HOUR = 3600.0


def _key(i: int) -> str:
    return f"{i:064x}"


def _blocks(n: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(_key(seed * 100 + i), torch.randn(2, 4, 8, generator=g)) for i in range(n)]


def _write_pack(root: Path, blocks, created_s: float) -> PackManifest:
    """A well-formed pack written at `created_s`, the way ObjectStoreTier writes one."""
    data, entries = pack_blocks(FP, blocks)
    pack = f"{int(created_s * 1000):013d}-{digest(data)}"
    m = PackManifest(pack, FP, FPID, len(data), created_s, entries)
    (root / "objects" / FPID).mkdir(parents=True, exist_ok=True)
    if not (root / LAYOUT_MARKER).exists():  # a store of this layout, as ObjectStoreTier marks one
        (root / LAYOUT_MARKER).write_text(json.dumps({"format": "kvbatch.kv-store", "layout_version": LAYOUT_VERSION}))
    (root / "index" / FPID).mkdir(parents=True, exist_ok=True)
    (root / "objects" / FPID / f"{pack}.arrow").write_bytes(data)
    (root / "index" / FPID / f"{pack}.json").write_bytes(m.to_json())
    return m


def _index(pack: object, **over: object) -> bytes:
    """An index file that is well-formed except for what `over` changes (its object is missing)."""
    d = {"format": "kvbatch.kvpack-index", "version": LAYOUT_VERSION, "pack": pack, "fingerprint": FP, "fingerprint_id": FPID,
         "object_bytes": 4096, "created_s": 1.0,
         "blocks": [{"key": _key(1), "offset": 8, "length": 512, "checksum": "0" * 32, "range_checksum": "0" * 32,
                     "dtype": "float32", "shape": [2, 4, 8]}]}
    for k, v in over.items():
        if k.startswith("block_"):
            d["blocks"][0][k.removeprefix("block_")] = v
        else:
            d[k] = v
    return json.dumps(d).encode()


def _name(i: int) -> str:
    """A well-formed pack name, old enough for any TTL (the index file's own name)."""
    return f"{1000 + i:013d}-{i:032x}"


def _hostile_store(tmp_path: Path) -> tuple[Path, dict[Path, bytes], list[Path], PackManifest, PackManifest]:
    """A store with one expired and one fresh real pack plus hostile entries aimed at victim
    files outside it (and at the fresh pack). Returns (root, victims by content, hostile paths,
    expired pack, fresh pack)."""
    root = tmp_path / "store"
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    old = _write_pack(root, _blocks(2, 1), time.time() - 5 * HOUR)
    fresh = _write_pack(root, _blocks(2, 2), time.time())
    victims = {}
    for name in ("name.json", "name.arrow", "abs.json", "abs.arrow", "fp.json", "fp.arrow", f"{_name(90)}.arrow",
                 f"{_name(91)}.json"):
        victims[victim_dir / name] = f"precious {name}".encode()
    for p, data in victims.items():
        p.write_bytes(data)
    idx = root / "index" / FPID
    rel = os.path.relpath(victim_dir, root / "index" / FPID)  # ../../../victim, from index/<fpid>
    hostile = {
        idx / f"{_name(1)}.json": _index(f"{rel}/name"),                            # ../ in the pack name
        idx / f"{_name(2)}.json": _index(str(victim_dir / "abs")),                  # an absolute path
        idx / f"{_name(3)}.json": _index(_name(3)[:-1] + "\x00"),                   # NUL
        idx / f"{_name(4)}.json": _index("..\\..\\..\\victim\\name"),               # backslashes
        idx / f"{_name(5)}.json": _index(_name(5), fingerprint_id=f"{rel}/fp"),     # ../ in the fingerprint id
        idx / f"{_name(6)}.json": _index(_name(6), block_offset=2**70),             # a huge offset
        idx / f"{_name(7)}.json": _index(_name(7), block_length=-512),              # a negative length
        idx / f"{_name(8)}.json": _index(123),                                      # wrong types
        idx / f"{_name(9)}.json": _index(_name(9), blocks="all of them"),
        idx / f"{_name(10)}.json": _index(_name(10), object_bytes="4096"),
        idx / f"{_name(11)}.json": _index(_name(11), version=True),
        idx / f"{_name(12)}.json": _index(_name(12), block_offset=True),
        idx / f"{_name(13)}.json": b"\xff\xfe not json",
        idx / f"{_name(14)}.json": b"[1, 2, 3]",
        # Named for one pack, describing the fresh real one (every field of it consistent).
        idx / f"{_name(15)}.json": _index(fresh.pack, created_s=fresh.created_s),
        # Names the store never makes, in the index folder itself.
        idx / "evil\\..\\name.json": _index(_name(16)),
        idx / "newline\n.json": _index(_name(17)),
        root / "index" / "not-a-fingerprint-id" / f"{_name(18)}.json": _index(_name(18)),
    }
    for p, data in hostile.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    # A folder of the store that is a symlink out of it: an "orphan" object reached through it.
    os.symlink(victim_dir, root / "objects" / ("f" * 32))
    return root, victims, list(hostile), old, fresh


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().out


def _cli_json(capsys, argv: list[str]) -> dict:
    code, out = _cli(capsys, argv)
    assert code == 0, out
    return json.loads(out)


def test_gc_of_a_hostile_store_deletes_nothing_outside_it(tmp_path, capsys):
    root, victims, hostile, old, fresh = _hostile_store(tmp_path)
    code, text = _cli(capsys, ["kv", "gc", "--store", str(root), "--ttl-hours", "1"])
    for p, data in victims.items():
        assert p.exists() and p.read_bytes() == data, f"gc deleted or changed {p}"
    assert code == 0, text
    out = json.loads(text)
    assert out["invalid_index_files"] == len(hostile)
    assert out["packs_expired"] == 1 and out["packs_kept"] == 1  # gc still did its job on the real packs
    assert out["deletes_refused"] == 1  # the "orphan" behind the symlinked objects folder: refused
    assert not (root / "index" / FPID / f"{old.pack}.json").exists()
    assert not (root / "objects" / FPID / f"{old.pack}.arrow").exists()
    # The fresh pack that a hostile index file named is whole, and the hostile files are left as found.
    assert (root / "index" / FPID / f"{fresh.pack}.json").exists()
    assert (root / "objects" / FPID / f"{fresh.pack}.arrow").exists()
    assert all(p.exists() for p in hostile)
    stats = _cli_json(capsys, ["kv", "stats", "--store", str(root)])
    assert stats["invalid_index_files"] == len(hostile)
    assert stats["packs"] == 1  # the fresh real pack, nothing else counted

    # gc compacted the index: the hostile files were counted and left out of the generation, so
    # a reader, which reads only the generation and the files written since, never meets them.
    assert out["compaction"]["invalid_index_files"] == len(hostile)
    tier = ObjectStoreTier(str(root))
    got = tier.get_many([k for k, _ in _blocks(2, 2)], FP)
    assert all(lk.tensor is not None for lk in got)  # the fresh pack still serves
    assert tier.stats()["invalid_index_files"] == 0


def test_gc_refuses_a_pack_folder_that_leads_out_of_the_store(tmp_path, capsys):
    """An index folder that is a symlink out of the store: its well-formed, expired index files
    name victims outside; gc refuses to delete through it and counts the refusals."""
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    m = _write_pack(outside, _blocks(1, 3), time.time() - 5 * HOUR)  # outside/index/<fpid>/..., objects/...
    (root / "index").mkdir(parents=True)
    (root / LAYOUT_MARKER).write_bytes((outside / LAYOUT_MARKER).read_bytes())
    os.symlink(outside / "index" / FPID, root / "index" / FPID)
    os.symlink(outside / "objects", root / "objects")
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    out = _cli_json(capsys, ["kv", "gc", "--store", str(root), "--ttl-hours", "1"])
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
    assert out["packs_expired"] == 1 and out["deletes_refused"] == 2, out  # index file and object, both refused
    assert (outside / "index" / FPID / f"{m.pack}.json").exists()


def test_every_hostile_index_is_refused_with_the_file_and_field_named(tmp_path):
    _, _, hostile, _, _ = _hostile_store(tmp_path)
    for p in hostile:
        if p.name.endswith(".json") and p.parent.name == FPID and "\n" not in p.name and "\\" not in p.name:
            with pytest.raises(IndexInvalid) as exc:
                PackManifest.from_json(p.read_bytes(), source=str(p), where=(FPID, p.name[: -len(".json")]))
            assert str(p) in str(exc.value) and exc.value.field


def test_a_read_through_an_index_with_ranges_outside_its_object_is_a_counted_miss(tmp_path):
    root = tmp_path / "store"
    real = _write_pack(root, _blocks(1, 4), time.time() - 60)
    (key,) = real.entries
    data = (root / "objects" / FPID / f"{real.pack}.arrow").read_bytes()

    def lying_pack(i: int, object_bytes: int, offset: int) -> None:
        pack = _name(40 + i)
        (root / "objects" / FPID / f"{pack}.arrow").write_bytes(data)
        d = json.loads(real.to_json())
        d.update(pack=pack, created_s=int(pack.split("-")[0]) / 1000, object_bytes=object_bytes)
        d["blocks"][0]["offset"] = offset
        (root / "index" / FPID / f"{pack}.json").write_text(json.dumps(d))

    (root / "index" / FPID / f"{real.pack}.json").unlink()  # only the lying index files tell where the block is
    lying_pack(0, len(data), len(data) + 100)  # past the size the index itself gives: refused on load
    tier = ObjectStoreTier(str(root))
    (miss,) = tier.get_many([key], FP)
    assert miss.tensor is None and miss.reason == "missing"
    assert tier.stats()["invalid_index_files"] == 1  # read when the key was looked for

    lying_pack(1, 10**12, len(data) + 100)  # claims a far bigger object: passes the index check, not the read
    tier = ObjectStoreTier(str(root))
    (miss,) = tier.get_many([key], FP)
    assert miss.tensor is None and miss.reason == "truncated"
    assert tier.stats()["misses_by_reason"] == {"truncated": 1}


def test_disk_tier_never_sweeps_through_a_symlinked_folder(tmp_path):
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    stale = victim_dir / ".tmp-precious"
    stale.write_bytes(b"precious")
    os.utime(stale, (time.time() - 10 * HOUR, time.time() - 10 * HOUR))  # old enough for the temp sweep
    folder = tmp_path / "disk"
    folder.mkdir()
    os.symlink(victim_dir, folder / "ab")
    DiskTier(str(folder), byte_budget=1 << 20)
    assert stale.read_bytes() == b"precious"


def test_keys_are_whole_names_from_the_alphabet():
    assert check_key(_key(7)) == _key(7)
    for bad in (_key(7) + "\n", "../x", "a/b", "a\x00", "", "a" * 257, 7):
        with pytest.raises(ValueError):
            check_key(bad)  # type: ignore[arg-type]
