"""Deterministic benchmark workloads built from the real prompt sets in ``../shared/datasets``.

That folder sits beside the repository (``/work/shared/datasets`` here, and in CI) and is not
part of it; without it every workload stops at once with :class:`DatasetsMissing`, naming the
folder and the files it looked for. (The test suite does not need it: it reads the small subsets
in ``tests/data/``.)

A workload is a list of :class:`WorkloadPrompt` (an id, where it came from and its chat
messages). Nothing here touches the network or a model; the same arguments always give the
same prompts, in the same order, so two engines (or two runs) see identical input.

The chat workload mixes three sources in a fixed pattern (ShareGPT, MT-Bench turn 1, ShareGPT,
GSM8K, repeated), so any prefix of it is also a mix, and gives every other group of four
requests the same ~300-token support-desk system prompt, so part of the batch shares a long
prefix (the case a prefix cache is for) while the rest carries the model's default one.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COPY_TASKS", "DATASET_FILES", "SUPPORT_SYSTEM_PROMPT", "DatasetsMissing", "WorkloadPrompt",
           "chat_workload", "copy_workload", "datasets_root", "default_datasets_dir"]

# A realistic operator system prompt (~300 tokens with SmolLM2's tokenizer).
SUPPORT_SYSTEM_PROMPT = """\
You are Nova, the virtual support assistant for Brightline Cloud, a company that sells managed \
databases, object storage and virtual machines to small and medium-sized businesses. Follow \
this policy in every conversation.

1. Tone. Be friendly, calm and concise. Use plain language, avoid jargon unless the customer \
uses it first, and never blame the customer.
2. Scope. Answer questions about Brightline products, billing, account settings and general \
technical topics. For anything unrelated, help briefly if you can and say so when you cannot.
3. Accuracy. If you are not sure of an answer, say so and suggest where to check (the status \
page, the documentation or a human agent). Never invent prices, limits, dates or features.
4. Security. Never ask for or repeat passwords, full card numbers or API secrets. If a customer \
pastes a secret, tell them to rotate it at once. Do not confirm whether an email address has an account.
5. Billing. You may explain invoices and plans, but refunds, credits and plan exceptions must be \
approved by a human agent: collect the account ID and a short description, then offer a handoff.
6. Escalation. Offer a human agent when the customer asks for one, is upset after two replies, \
or the issue involves an outage, legal, privacy or data-loss questions.
7. Format. Use short paragraphs and numbered steps for procedures. Put commands and code in code \
blocks. End each answer by asking whether the issue is resolved."""

# The pattern that picks the source of request i (i modulo its length).
_SOURCE_PATTERN = ("sharegpt", "mt_bench", "sharegpt", "gsm8k")


@dataclass(frozen=True)
class WorkloadPrompt:
    request_id: str
    source: str  # "sharegpt", "mt_bench" or "gsm8k"
    messages: list[dict]
    shares_system_prompt: bool


def default_datasets_dir() -> Path:
    """``../shared/datasets`` relative to the repository root (``/work/shared/datasets`` here)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


# Where each source lives under the datasets folder (the layout of ../shared/datasets).
DATASET_FILES = {
    "sharegpt": "sharegpt_500/ShareGPT_V3_filtered_500.json",
    "mt_bench": "mt_bench/question.jsonl",
    "gsm8k": "gsm8k_test/test.jsonl",
}


class DatasetsMissing(FileNotFoundError):
    """The prompt sets a benchmark reads are not where it looked."""


def datasets_root(datasets_dir: str | Path | None, sources: tuple[str, ...] = tuple(DATASET_FILES)) -> Path:
    """The datasets folder (``datasets_dir``, or :func:`default_datasets_dir`), checked to hold
    the file of every source in ``sources``. Benchmarks call it before loading a model, so a
    missing folder costs nothing and says what to do."""
    root = Path(datasets_dir) if datasets_dir is not None else default_datasets_dir()
    missing = [DATASET_FILES[s] for s in sources if not (root / DATASET_FILES[s]).is_file()]
    if missing:
        where = "folder not found" if not root.is_dir() else f"missing {', '.join(missing)}"
        raise DatasetsMissing(
            f"{root}: prompt sets {where}. The benchmarks read the real prompt sets (ShareGPT, MT-Bench, "
            f"GSM8K) from ../shared/datasets beside the repository, which a clone does not include; pass "
            f"--datasets DIR with that layout ({', '.join(DATASET_FILES[s] for s in sources)}).")
    return root


def _sharegpt(root: Path, max_chars: int) -> list[str]:
    path = datasets_root(root, ("sharegpt",)) / DATASET_FILES["sharegpt"]
    records = json.loads(path.read_text(encoding="utf-8"))
    texts = [r["conversations"][0]["value"] for r in records if r.get("conversations")]
    # Drop one-word openers ("hi") and the longest prompts, which would dominate the padding of a
    # left-padded reference batch rather than measure anything.
    return [t for t in texts if 16 <= len(t.strip()) <= max_chars]


def _mt_bench(root: Path, max_chars: int) -> list[str]:
    path = datasets_root(root, ("mt_bench",)) / DATASET_FILES["mt_bench"]
    texts = [json.loads(line)["turns"][0] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [t for t in texts if len(t) <= max_chars]


def _gsm8k(root: Path, max_chars: int) -> list[str]:
    path = datasets_root(root, ("gsm8k",)) / DATASET_FILES["gsm8k"]
    texts = [json.loads(line)["question"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [t for t in texts if len(t) <= max_chars]


_LOADERS = {"sharegpt": _sharegpt, "mt_bench": _mt_bench, "gsm8k": _gsm8k}


def chat_workload(
    datasets_dir: str | Path | None = None,
    num_requests: int = 64,
    *,
    system_prompt: str = SUPPORT_SYSTEM_PROMPT,
    max_prompt_chars: int = 2400,
    seed: int = 0,
) -> list[WorkloadPrompt]:
    """``num_requests`` single-turn chats of mixed length from ShareGPT, MT-Bench and GSM8K.

    Each source's records are drawn without replacement in an order fixed by ``seed``. Requests
    in groups 0, 2, 4, ... of four (0-3, 8-11, ...) start with ``system_prompt``; the others get
    the chat template's default system prompt.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    root = datasets_root(datasets_dir, tuple(_LOADERS))
    pools: dict[str, list[str]] = {}
    for name, load in _LOADERS.items():
        texts = load(root, max_prompt_chars)
        random.Random(f"{name}-{seed}").shuffle(texts)  # str seeds are hashed deterministically
        pools[name] = texts
    taken = {name: 0 for name in pools}
    prompts: list[WorkloadPrompt] = []
    for i in range(num_requests):
        source = _SOURCE_PATTERN[i % len(_SOURCE_PATTERN)]
        pool = pools[source]
        if taken[source] >= len(pool):
            raise ValueError(f"{source}: only {len(pool)} prompts of <= {max_prompt_chars} chars")
        text = pool[taken[source]]
        taken[source] += 1
        shares = (i // 4) % 2 == 0
        messages = ([{"role": "system", "content": system_prompt}] if shares else []) + [
            {"role": "user", "content": text}
        ]
        prompts.append(WorkloadPrompt(f"{source}-{i:03d}", source, messages, shares))
    return prompts


# Copy-heavy tasks: the answer reuses long stretches of the given text, the case n-gram
# drafting is for. ``{text}`` is a real prompt from ShareGPT or GSM8K used as the document.
COPY_TASKS = (
    "Repeat the following text exactly, word for word.\n\nText:\n{text}",
    "Fix any spelling or grammar mistakes in the following text and return the whole corrected "
    "text.\n\nText:\n{text}",
    "Rewrite the following text with every sentence on its own line.\n\nText:\n{text}",
    "Quote the sentences of the following text that contain the most important facts.\n\nText:\n{text}",
)


def copy_workload(
    datasets_dir: str | Path | None = None,
    num_requests: int = 16,
    *,
    min_chars: int = 300,
    max_chars: int = 1200,
    seed: int = 0,
) -> list[WorkloadPrompt]:
    """``num_requests`` summarise / edit / extract requests over a given text (ShareGPT prompts
    and GSM8K questions of ``min_chars`` to ``max_chars`` characters), tasks in turn."""
    root = datasets_root(datasets_dir, ("sharegpt", "gsm8k"))
    texts = [t for t in _sharegpt(root, max_chars) + _gsm8k(root, max_chars) if len(t) >= min_chars]
    random.Random(f"copy-{seed}").shuffle(texts)
    if len(texts) < num_requests:
        raise ValueError(f"only {len(texts)} texts of {min_chars}-{max_chars} chars")
    return [WorkloadPrompt(f"copy-{i:03d}", "copy",
                           [{"role": "user", "content": COPY_TASKS[i % len(COPY_TASKS)].format(text=texts[i])}],
                           False)
            for i in range(num_requests)]
