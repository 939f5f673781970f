"""A model in its own module that imports xFormers' attention by name, as seed 000's does."""

import torch
from xformers.ops import memory_efficient_attention


class XformersAttentionModel(torch.nn.Module):
    def forward(self, query, key, value):
        return memory_efficient_attention(query, key, value)
