"""Nested-dict pytrees addressed by key paths: the parameter tree's plumbing (`flatten` in sorted key order,
`get_path`, `set_path`) and its size."""
from __future__ import annotations

from typing import Iterator

import jax
import numpy as np


Path = tuple[str, ...]


def flatten(tree: dict, prefix: Path = ()) -> Iterator[tuple[Path, object]]:
    for k in sorted(tree):
        if isinstance(tree[k], dict):
            yield from flatten(tree[k], prefix + (k,))
        else:
            yield prefix + (k,), tree[k]


def get_path(tree: dict, path: Path):
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: Path, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
