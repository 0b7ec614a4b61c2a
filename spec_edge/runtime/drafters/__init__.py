"""Drafters propose k tokens for the target to verify; what the loop calls on one: base.Drafter."""
