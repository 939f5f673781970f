"""The seed's model (seed 000, xformers_attention.py): xFormers attention imported by name,
so patching the xformers module alone would not reach it."""

import torch
from xformers.ops import memory_efficient_attention


class XformersAttentionModel(torch.nn.Module):
    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        self.dropout_p = dropout_p

    def forward(self, query, key, value, attn_bias=None):
        return memory_efficient_attention(query, key, value, attn_bias=attn_bias, p=self.dropout_p)
