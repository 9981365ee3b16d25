"""CPU prefill attention of long chunks: query heads folded under one boolean mask, against by head.

    python benchmarks/bench_prefill_attention.py            # 2 threads, 3 rounds, every case
    python benchmarks/bench_prefill_attention.py --quick    # 2 rounds, the short cases

One layer of SmolLM2-135M's prefill attention (fp32; 9 query heads over 3 KV heads of dim 64, block
size 16), the paged cache's blocks placed at random, for each case's chunks:

- *masked*: the reference path as it was before (``masked_long_chunks`` below, kept here as the
  baseline): each chunk's query heads folded into rows per KV head (``[3, 3 * n_new, 64]``) and a
  boolean ``[3 * n_new, context]`` causal mask built for it, so torch's CPU flash kernel computes
  every block of the rectangle, the ones above the diagonal too;
- *by head*: ``reference.prefill_attention`` now: ``[1, 9, n_new, 64]`` queries over the gathered
  ``[1, 3, context, 64]`` keys and values (``enable_gqa``); a chunk without a cached prefix runs
  SDPA's ``is_causal`` (the flash kernel skips the blocks above the diagonal), one over a cached
  prefix reads a ``[n_new, context]`` mask of its own rows, built with the plan.

Cases: a prompt prefilled whole (no cached prefix) at 300, 1,000 and 2,000 tokens; one 89-token
chunk over 341 positions (the typical chat prompt after its prefix-cache hit); and the
end-of-turn workload's prefill: the 275 chunks (22,769 new tokens, 255 of them long) that
``bench_engine.py``'s 256-request chat workload (``chat_workload(None, 256, seed=1)``, SmolLM2's
chat template, prefix cache on) prefilled in 12 forward passes, recorded 2026-12-05 as
``(new tokens, context)`` below, so this file needs neither the datasets nor the model. Chunks of
up to ``reference.SHORT_CHUNK`` tokens take the batched short path in both columns.

Both paths get the same plan (``reference.plan_prefill``, built once per case, not timed: the
engine builds it once per forward pass) and the old path its masks, built once too. The paths
alternate within each round (their order reversed every round), the ratio is of the medians, and
the outputs are compared. The CPU model, its SIMD flags and the load average are printed with
the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvbatch.kernels import reference as R  # noqa: E402
from kvbatch.kernels.cpu.machine import cpu_identity, isa_limits  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
# (new tokens, context) of each chunk the end-of-turn workload prefilled (see the docstring).
EOT_CHUNKS = (
    (358, 358), (41, 41), (31, 351), (34, 354), (51, 371), (37, 53), (32, 48), (68, 84), (91, 411), (79, 399),
    (23, 343), (108, 428), (56, 72), (34, 50), (37, 53), (82, 98), (42, 362), (29, 349), (31, 351), (47, 367),
    (89, 105), (52, 68), (27, 43), (73, 89), (17, 337), (33, 353), (24, 344), (70, 390), (26, 42), (40, 56),
    (29, 45), (94, 110), (33, 353), (70, 390), (83, 403), (54, 374), (21, 37), (31, 47), (62, 78), (98, 114),
    (38, 358), (41, 361), (16, 336), (15, 335), (121, 457), (53, 388), (571, 587), (55, 71), (86, 102),
    (62, 78), (302, 622), (106, 426), (36, 356), (40, 360), (48, 64), (43, 59), (92, 108), (74, 90), (82, 402),
    (29, 349), (31, 351), (94, 414), (47, 63), (54, 70), (16, 32), (6, 22), (8, 40), (67, 89), (329, 649),
    (266, 586), (76, 396), (126, 446), (167, 183), (38, 54), (18, 34), (120, 136), (59, 379), (63, 383),
    (171, 491), (63, 383), (94, 110), (90, 106), (24, 40), (89, 105), (28, 348), (61, 381), (47, 367),
    (32, 352), (12, 28), (30, 382), (16, 44), (227, 243), (265, 281), (51, 67), (30, 350), (150, 470),
    (26, 346), (115, 435), (19, 35), (386, 402), (30, 46), (51, 67), (16, 336), (28, 348), (31, 351),
    (74, 394), (43, 59), (52, 68), (41, 57), (55, 71), (63, 383), (213, 533), (32, 352), (4, 324), (11, 363),
    (46, 370), (38, 54), (49, 65), (369, 385), (82, 98), (45, 365), (223, 543), (23, 343), (99, 419), (22, 38),
    (33, 49), (24, 40), (86, 102), (21, 341), (24, 344), (426, 746), (67, 387), (26, 42), (71, 87), (30, 46),
    (69, 85), (25, 345), (51, 371), (69, 389), (16, 336), (3, 19), (41, 377), (30, 49), (44, 60), (34, 50),
    (93, 109), (29, 349), (42, 362), (76, 396), (109, 429), (33, 49), (38, 54), (23, 39), (118, 134),
    (38, 358), (190, 510), (19, 339), (76, 396), (136, 152), (66, 82), (72, 88), (48, 64), (16, 336),
    (353, 673), (248, 568), (71, 391), (5, 21), (51, 72), (69, 85), (21, 37), (100, 116), (21, 341), (32, 352),
    (43, 363), (39, 359), (38, 54), (84, 100), (43, 59), (61, 77), (14, 334), (66, 386), (49, 369), (111, 431),
    (36, 52), (229, 245), (28, 44), (93, 109), (157, 477), (32, 352), (152, 472), (72, 392), (52, 68),
    (76, 92), (44, 60), (75, 91), (21, 341), (44, 364), (24, 344), (64, 384), (7, 23), (40, 424), (180, 203),
    (90, 106), (352, 368), (86, 102), (23, 343), (39, 359), (272, 592), (54, 374), (26, 42), (122, 138),
    (373, 389), (43, 59), (35, 355), (58, 378), (240, 560), (15, 335), (386, 946), (44, 379), (36, 52),
    (41, 57), (25, 41), (90, 106), (23, 343), (49, 369), (423, 743), (83, 403), (46, 62), (26, 42), (61, 77),
    (96, 112), (48, 368), (24, 344), (31, 351), (75, 395), (23, 39), (44, 60), (368, 384), (6, 22), (296, 680),
    (106, 128), (611, 931), (32, 352), (29, 349), (153, 473), (24, 40), (26, 42), (580, 596), (54, 70),
    (27, 347), (65, 385), (32, 352), (13, 333), (73, 425), (50, 383), (24, 40), (85, 101), (186, 202),
    (48, 64), (24, 344), (43, 363), (32, 352), (65, 385), (34, 50), (172, 188), (34, 50), (100, 116),
    (14, 334), (27, 347), (160, 480), (52, 372), (384, 400), (32, 48), (137, 153), (114, 130),
)


class Case:
    """One layer's inputs for a list of chunks: a paged cache holding every chunk's context (blocks
    at random places), block tables, queries, the plan, and the old path's masks."""

    def __init__(self, chunks: list[tuple[int, int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        need = [-(-ctx // BLOCK) for _, ctx in chunks]
        perm = torch.randperm(sum(need) + 8, generator=gen)
        self.tables = torch.zeros(len(chunks), max(need), dtype=torch.int32)
        used = 0
        for s, n in enumerate(need):
            self.tables[s, :n] = perm[used:used + n]
            used += n
        shape = (len(perm), BLOCK, KV_HEADS, HEAD_DIM)
        self.k, self.v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        news = torch.tensor([n for n, _ in chunks])
        self.cu = torch.cat([torch.zeros(1, dtype=torch.int64), news.cumsum(0)]).to(torch.int32)
        self.lens = torch.tensor([ctx for _, ctx in chunks], dtype=torch.int32)
        self.q = torch.randn(int(news.sum()), HEADS, HEAD_DIM, generator=gen)
        self.plan = R.plan_prefill(self.tables, self.cu, self.lens, BLOCK, HEADS // KV_HEADS)
        self.masks = [_grouped_mask(c.end - c.start, len(c.slots)) for c in self.plan.long]
        self.new_tokens = int(news.sum())

    def by_head(self) -> torch.Tensor:
        return R.prefill_attention(self.q, self.k, self.v, self.tables, self.cu, self.lens, HEAD_DIM ** -0.5,
                                   self.plan)

    def masked(self) -> torch.Tensor:
        return masked_long_chunks(self.q, self.k, self.v, self.plan, self.masks, HEAD_DIM ** -0.5)


def _grouped_mask(n_new: int, n_ctx: int) -> torch.Tensor:
    q_pos = torch.arange(n_ctx - n_new, n_ctx)
    return (torch.arange(n_ctx)[None, :] <= q_pos[:, None]).repeat(HEADS // KV_HEADS, 1)


def masked_long_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: R.PrefillPlan,
                       masks: list[torch.Tensor], scale: float) -> torch.Tensor:
    """``reference.prefill_attention`` as it was (commit 1a4a013): the long chunks' query heads
    folded into rows per KV head, a boolean mask over the whole rectangle."""
    _, Hq, D = q.shape
    Hkv = k_cache.shape[-2]
    group = Hq // Hkv
    out = torch.empty_like(q)
    for g in plan.short:
        R._short_chunks_attention(q, out, k_cache, v_cache, g, scale)
    k_flat, v_flat = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    for c, mask in zip(plan.long, masks):
        n_new = c.end - c.start
        k = k_flat.index_select(0, c.slots).transpose(0, 1)
        v = v_flat.index_select(0, c.slots).transpose(0, 1)
        qs = q[c.start:c.end].view(n_new, Hkv, group, D).permute(1, 2, 0, 3).reshape(Hkv, group * n_new, D)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[c.start:c.end] = o.view(Hkv, group, n_new, D).permute(2, 0, 1, 3).reshape(n_new, Hq, D)
    return out


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def run_case(name: str, chunks: list[tuple[int, int]], rounds: int) -> dict:
    case = Case(chunks)
    paths = {"masked": case.masked, "by head": case.by_head}
    diff = (case.masked() - case.by_head()).abs().max().item()  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(rounds):
        for path, run in (list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]):
            t = time.perf_counter()
            run()
            times[path].append((time.perf_counter() - t) * 1e3)
    old, new = (statistics.median(times[p]) for p in paths)
    print(f"  {name:<44} {case.new_tokens:>7} {old:11.2f} {new:11.2f} {old / new:7.2f}x "
          f"{old * LAYERS / 1e3:9.2f} {new * LAYERS / 1e3:9.2f} {diff:10.1e}")
    return {"case": name, "new_tokens": case.new_tokens, "masked_ms": old, "by_head_ms": new,
            "ratio": old / new, "max_abs_diff": diff}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 rounds; the whole prompts up to 1,000 tokens and the "
                                                        "89-token chunk (not the 2,000-token prompt or the workload)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.rounds = 2
    torch.set_num_threads(args.threads)
    cpu_model, flags = cpu_identity()
    print(f"prefill attention, SmolLM2-135M shapes ({HEADS}/{KV_HEADS} heads, dim {HEAD_DIM}, block {BLOCK}), "
          f"fp32, one layer; torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}); "
          f"CPU: {cpu_model}; SIMD flags: {' '.join(f for f in SIMD_FLAGS if f in flags)}; "
          f"{args.threads} thread(s); {args.rounds} rounds; load average before {load()}")
    if isa_limits():
        print(f"instruction set capped: {', '.join(f'{k}={v}' for k, v in isa_limits().items())}")
    cases = [("whole prompt, 300 tokens", [(300, 300)]), ("whole prompt, 1,000 tokens", [(1000, 1000)]),
             ("89 new tokens over 341 positions", [(89, 341)])]
    if not args.quick:
        cases += [("whole prompt, 2,000 tokens", [(2000, 2000)]),
                  (f"end-of-turn workload, {len(EOT_CHUNKS)} chunks", list(EOT_CHUNKS))]
    print(f"  {'case':<44} {'tokens':>7} {'masked ms':>11} {'by head ms':>11} {'ratio':>8} "
          f"{'masked s':>9} {'by head s':>9} {'max |diff|':>10}")
    for name, chunks in cases:
        run_case(name, chunks, args.rounds)
    print(f"  (ms: one layer; s: x{LAYERS}, the layers of a forward pass); load average after {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
