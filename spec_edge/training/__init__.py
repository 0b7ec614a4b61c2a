"""spec-edge train-draft: the target's answers as training data, the fit loop every kind shares,
and each kind's training (EAGLE-3, Medusa, P-EAGLE, a small draft model).

May import: config, graphs, heads, runtime.
"""
