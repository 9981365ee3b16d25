"""A generated sample dataset: realistic batch chat requests with shared system prompts.

Nightly batches look like this: a handful of long system prompts (a policy, a rubric, a
style guide) shared by thousands of rows that differ only in the user turn. The generator is
seeded and needs no download, so the README's first command works on a fresh machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import fsspec

SYSTEM_PROMPTS = {
    "support": (
        "You are the customer support assistant of Northwind Outfitters, an online shop for "
        "hiking and camping gear. Answer in a friendly, concise tone. Policies: orders ship "
        "within two business days; standard shipping is free above 50 dollars; returns are "
        "accepted within 30 days if the item is unused and in its original packaging; "
        "sleeping bags and tents carry a two-year warranty against manufacturing defects; "
        "worn boots can be exchanged once within 14 days if they do not fit. Never promise "
        "refunds outside these rules, never ask for a full card number, and offer to connect "
        "the customer with a human agent when they are upset or the case is unusual. When you "
        "do not know an order's status, ask for the order number, which starts with NW and has "
        "eight digits. End every answer with one short sentence offering more help."
    ),
    "classify": (
        "You label customer messages for a routing system. Read the message and answer with "
        "exactly one label from this list, and nothing else: BILLING (charges, invoices, "
        "refunds, payment methods), SHIPPING (delivery times, tracking, lost parcels, "
        "addresses), PRODUCT (questions about features, sizes, materials, compatibility), "
        "ACCOUNT (login problems, passwords, personal data, newsletters), COMPLAINT (anger, "
        "threats to leave, reports of rude staff), OTHER (anything else). If a message fits "
        "several labels, pick the one the customer most needs solved first. Do not explain "
        "your choice. Do not add punctuation. Answer in upper case."
    ),
    "summarise": (
        "You are an editor who writes summaries for a busy engineering manager. Summarise the "
        "text the user gives you in at most three bullet points. Each bullet starts with a "
        "verb, keeps numbers and names exactly as written, and is at most twenty words long. "
        "Leave out greetings, speculation and anything the text does not state. If the text "
        "contains a decision, the first bullet states it; if it contains a deadline, the last "
        "bullet states it. Do not add a title or a closing remark."
    ),
}

SUPPORT_QUESTIONS = [
    "My tent arrived with a broken pole. What can I do?",
    "Can I return hiking boots I wore once on a trail?",
    "How long does shipping take to Denver?",
    "I was charged twice for order NW12345678. Please fix it.",
    "Do you ship to Canada, and what does it cost?",
    "The zipper of my sleeping bag broke after 18 months. Is that covered?",
    "I want to change the delivery address of my order.",
    "Is the Ridgeline 2 tent suitable for winter camping?",
    "Your last delivery was late and the driver was rude. I am very unhappy.",
    "Can I get a discount if I order ten backpacks for my scout group?",
]

CLASSIFY_MESSAGES = [
    "I never received my parcel and tracking says delivered.",
    "Why is there a 4.99 fee on my invoice?",
    "What size should I take in the Trailrunner shoes if I am usually a 43?",
    "I can't log in since I changed my email address.",
    "This is the third time you mess up my order. I'm done with you.",
    "Is the water filter compatible with 28 mm bottle threads?",
    "Please remove me from the newsletter.",
    "Do you have a physical store in Portland?",
    "The refund for my returned jacket hasn't arrived after two weeks.",
    "Can you deliver to a pickup point instead of my home?",
]

SUMMARY_TEXTS = [
    "Team sync, Tuesday. We agreed to move the storage migration to the new cluster in March "
    "instead of February because the vendor delayed the hardware by three weeks. Priya will own "
    "the runbook. The load tests showed 18 percent lower latency on the new disks. Budget stays "
    "at 120k. Final sign-off is due on February 28.",
    "Incident report: on Saturday the payment service returned errors for 42 minutes after a "
    "configuration change raised the connection pool limit beyond what the database allows. "
    "About 3,100 checkouts failed. The change was rolled back by the on-call engineer. We will "
    "add a validation step to the deploy pipeline by next Friday.",
    "Hiring update: we interviewed five candidates for the data engineer role. Two passed the "
    "system design round. Marco prefers the candidate with streaming experience; Lena prefers "
    "the one with stronger SQL. We decided to make an offer to the streaming candidate and keep "
    "the other warm. The offer must go out by Thursday.",
    "Quarterly review: revenue grew 12 percent, mostly from the new camping line. Returns fell "
    "from 8 to 6 percent after the sizing guide launched. Customer support backlog doubled in "
    "December. The board approved two extra support hires starting in April.",
]

OPEN_QUESTIONS = [
    "Explain what a hash function is to a ten-year-old.",
    "Write a short poem about morning fog over a lake.",
    "Give three tips for staying focused while working from home.",
    "What is the difference between weather and climate?",
    "Suggest a name for a coffee shop run by cats.",
    "How do I boil an egg so the yolk stays soft?",
    "Why is the sky blue? Answer in two sentences.",
    "List four uses of a paperclip besides holding paper.",
]


def sample_rows(n: int, seed: int = 0, max_tokens: int = 48) -> Iterator[dict[str, Any]]:
    """``n`` OpenAI Batch request rows; about 85% share one of three long system prompts."""
    rng = random.Random(seed)
    for i in range(n):
        kind = rng.choices(["support", "classify", "summarise", "open"], weights=[4, 4, 3, 2])[0]
        if kind == "support":
            messages = [{"role": "system", "content": SYSTEM_PROMPTS["support"]},
                        {"role": "user", "content": rng.choice(SUPPORT_QUESTIONS)}]
        elif kind == "classify":
            messages = [{"role": "system", "content": SYSTEM_PROMPTS["classify"]},
                        {"role": "user", "content": rng.choice(CLASSIFY_MESSAGES)}]
        elif kind == "summarise":
            messages = [{"role": "system", "content": SYSTEM_PROMPTS["summarise"]},
                        {"role": "user", "content": rng.choice(SUMMARY_TEXTS)}]
        else:
            messages = [{"role": "user", "content": rng.choice(OPEN_QUESTIONS)}]
        body: dict[str, Any] = {"model": "smollm2-135m", "messages": messages,
                                "max_tokens": 8 if kind == "classify" else max_tokens}
        if rng.random() < 0.7:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.7, top_p=0.9, seed=rng.randrange(1 << 31))
        yield {"custom_id": f"sample-{seed}-{i:06d}-{kind}", "method": "POST",
               "url": "/v1/chat/completions", "body": body}


def write_sample_dataset(url: str, n: int, seed: int = 0, max_tokens: int = 48) -> int:
    """Write ``n`` rows as JSONL to ``url`` (local path or fsspec URL); returns rows written."""
    with fsspec.open(url, "w", auto_mkdir=True) as f:
        for row in sample_rows(n, seed, max_tokens):
            f.write(json.dumps(row) + "\n")
    return n
