"""Drafters propose k tokens for the target to verify. The interface (base.Drafter):

    start(prompt_ids)                   after the target's prefill, once per request
    propose(seq, k, sampler) -> Draft | None   None: nothing worth verifying, take a plain step
    observe(n_proposed, n_accepted)     the verify outcome, for drafters that adapt

seq is the whole sequence so far (prompt + generated); its last token is the target's pending token,
not yet in the target's cache (it sits at position len(seq) - 1).
"""
