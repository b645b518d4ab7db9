#!/usr/bin/env python3
"""Training check: the same small causal transformer trained with our attention and with
torch SDPA, from the same seed, on a synthetic task; prints both loss curves.

  python bench/train_check.py [--steps 200] [--device cuda]

Task: sequences of random tokens whose second half repeats the first half, so a model that
attends back half a sequence can predict the second half (loss well below log(vocab)).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_attn_ext as fa


class Block(nn.Module):
    def __init__(self, d_model, n_heads, attention):
        super().__init__()
        self.n_heads, self.attention = n_heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, Dh]
        a = self.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, d_model, n_heads, n_layers, seqlen, attention):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d_model), nn.Parameter(torch.zeros(seqlen, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads, attention) for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def train(attention, args):
    torch.manual_seed(0)
    model = TinyLM(args.vocab, 256, 4, 4, args.seqlen, attention).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for _ in range(args.steps):
        half = torch.randint(0, args.vocab, (args.batch, args.seqlen // 2), generator=gen)
        tokens = torch.cat([half, half], dim=1).to(args.device)
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    args = p.parse_args()
    ours = train(fa.scaled_dot_product_attention, args)
    theirs = train(F.scaled_dot_product_attention, args)
    print(f"step | loss ours | loss torch sdpa   (log(vocab) = {math.log(args.vocab):.3f})")
    for i in range(0, args.steps, max(1, args.steps // 20)):
        print(f"{i:4d} | {ours[i]:.4f} | {theirs[i]:.4f}")
    print(f"{args.steps - 1:4d} | {ours[-1]:.4f} | {theirs[-1]:.4f}")
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"max |loss difference| over {args.steps} steps: {diff:.4f}; final: {abs(ours[-1] - theirs[-1]):.4f}")


if __name__ == "__main__":
    main()
