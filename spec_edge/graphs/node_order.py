"""Nodes in an order ONNX accepts: each after the producers of its inputs (the post-export passes
append or rewire nodes, then sort)."""
from __future__ import annotations


def topological(nodes: list, known: set[str]) -> list:
    """nodes sorted so every input is produced before it is read; known: the names that exist
    before any node (graph inputs, initializers). Raises ValueError naming a node whose input
    nothing produces (a cycle, or an input lost in a rewrite)."""
    known = set(known)
    ordered, pending = [], list(nodes)
    while pending:
        rest = []
        for node in pending:
            if all(name in known or not name for name in node.input):
                ordered.append(node)
                known.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError(rest[0].name)
        pending = rest
    return ordered
