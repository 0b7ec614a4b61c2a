"""spec_edge_training, its own package beside spec_edge (training/setup.py; console script
spec-edge-train): the target's answers as training data, the fit loop every kind shares,
and each kind's training (EAGLE-3, Medusa, P-EAGLE, a small draft model).

    train.py        the command: options, loading the target, dispatch by --kind
    data.py         the target's answers (cached), draft vocabulary, feature scaling, batches
    fit.py          the loop every kind shares: resume, held-out split, checkpoints, scores
    eagle3.py, medusa.py, peagle.py, draft_model.py
                    each kind's training (--kind eagle3 | medusa | peagle | draft); the heads'
                    module, initial state and saved folder come from spec_edge.heads

May import of spec_edge: config, graphs, heads, runtime; spec_edge imports nothing of it
(the serving install, ros/spec_edge, and the robot image do without it).
"""
