"""Measurement: spec-edge bench (bench: the run loop; systems, peers, report), spec-edge tune (tune),
and the prompt files they share (prompts).

May import: config, graphs, heads, device, runtime.
"""
