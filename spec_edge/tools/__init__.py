"""Measurement: spec-edge bench (systems, peers, report), spec-edge tune, and the prompt files they
share.

May import: config, graphs, heads, device, runtime.
"""
