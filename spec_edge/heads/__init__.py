"""Draft-head architectures (EAGLE-3, P-EAGLE, Medusa): their configs, the published checkpoint
layouts they load, the torch modules and their static head graphs. Training is its own package,
spec_edge_training/ (spec-edge-train), using these modules.

May import: config, graphs.
"""
