"""Draft-head architectures (EAGLE-3, P-EAGLE, Medusa): their configs, the published checkpoint
layouts they load, the torch modules and their static head graphs. Training lives in training/.

May import: config, graphs.
"""
