"""Measurement of this engine on the user's device: spec-edge bench (bench: the run loop; systems, report;
guided_bench: constrained decoding), and the prompt files and schema check they share
(prompts, schema_check). The comparisons with other engines (bench/peers.py) and the accuracy study of the
weights forms (bench/accuracy.py) are scripts outside the package.

May import: config, speculation_policy, graphs, runtime, artifacts.
"""
