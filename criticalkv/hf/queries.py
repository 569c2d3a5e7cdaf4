"""Post-RoPE queries recomputed from an attention module's input (the selection's window, KVzip's reconstruction)."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def window_queries(module, hidden_states: torch.Tensor, position_embeddings, w: int) -> torch.Tensor:
    """Post-RoPE queries [B, H, w, d_h] of the last w positions, recomputed from the attention input.

    Llama, Mistral, Qwen2 and Qwen3 share Llama's ``apply_rotary_pos_emb``; Qwen3 first normalises every query head
    (``q_norm``, an RMSNorm over d_h) as its attention does, before RoPE.
    """
    batch = hidden_states.shape[0]
    head_dim = module.head_dim
    q = module.q_proj(hidden_states[:, -w:]).view(batch, w, -1, head_dim)
    q_norm = getattr(module, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -w:], sin[:, -w:])
    return q
