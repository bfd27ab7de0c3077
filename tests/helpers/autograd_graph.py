"""What ran in a backward pass: the names of the autograd nodes a tensor's gradient goes through."""
from __future__ import annotations

import torch


def backward_nodes(tensor: torch.Tensor) -> set[str]:
    """``node.name()`` of every node reachable from ``tensor.grad_fn`` (an operator's backward shows up as
    ``GeneratedBackwardFor_<namespace>_<op>_defaultBackward``)."""
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names
