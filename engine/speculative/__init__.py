"""Speculative decoding: drafters propose (``drafters``: n-gram prompt lookup, a draft model,
early exit), the controller decides how many tokens each request drafts (``controller``), and
the verifier accepts or rejects them against the target's distribution (``verifier``)."""
