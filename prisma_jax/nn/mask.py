"""Which keys a query may attend to: `Mask` (segment ids, a causal start, a ragged cache length), built on the
host's segment order and read by every attention implementation (attention.py, attention_blocked.py)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Mask(NamedTuple):
    q_segment: jax.Array              # [B, Sq] int32, 0 = padding
    kv_segment: jax.Array             # [B, Sk] int32
    causal_start: int | jax.Array | None = 0   # slot of query 0 ([] or [B]); None = bidirectional
    kv_len: jax.Array | None = None   # [B] int32: each row's keys are exactly slots [0, kv_len) (a ragged cache)

    def dense(self) -> jax.Array:
        """[B, Sq, Sk] bool, True = may attend."""
        allowed = self.q_segment[:, :, None] == self.kv_segment[:, None, :]
        if self.causal_start is None:
            return allowed
        sq, sk = self.q_segment.shape[1], self.kv_segment.shape[1]
        q_slot = jnp.reshape(self.causal_start, (-1, 1)) + jnp.arange(sq)            # [1 or B, Sq]
        return allowed & (jnp.arange(sk) <= q_slot[:, :, None])


def segments_in_order(row) -> np.ndarray:
    """The nonzero segment ids of one host row `[S]`, in the order of their first tokens (0 = padding)."""
    ids, first = np.unique(np.asarray(row), return_index=True)
    ids = ids[np.argsort(first)]
    return ids[ids != 0]


def causal(key_segment: jax.Array, write_pos=0, n_query: int | None = None) -> Mask:
    """Causal self-attention over `key_segment [B, S_k]` (int segment ids, or bool validity = segment 1), the
    queries being the `n_query` slots from `write_pos` on (all of them when None)."""
    kv = key_segment.astype(jnp.int32)
    if n_query is None or n_query == kv.shape[1]:
        q = kv
    else:
        q = jax.lax.dynamic_slice_in_dim(kv, write_pos, n_query, axis=1)
    return Mask(q, kv, write_pos)
