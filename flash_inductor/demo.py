"""``python -m flash_inductor.demo``: a small transformer trained through the ``flashoptim`` backend.

Prints the loss of each step and the optimizer's memory by component. CPU or GPU (``--device``).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, dim=128, heads=4, layers=2, seq=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def lm_train_step(model, optimizer, **options):
    """The training step: next-token cross-entropy of ``model`` (tokens -> logits), backward and
    optimizer step, compiled by ``@flash_inductor.train_step`` with ``options``."""

    @flash_inductor.train_step(model=model, optimizer=optimizer, **options)
    def step(x, y):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyGPT().to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    # Repeating text so the loss visibly falls within a few steps.
    text = torch.tensor(list(b"flash_inductor trains with split weights and 8-bit states. " * 64), device=args.device)

    step = lm_train_step(model, optimizer)
    seq = model.pos.shape[0]
    for i in range(args.steps):
        starts = torch.randint(0, text.numel() - seq - 1, (args.batch,), device=args.device)
        idx = starts[:, None] + torch.arange(seq, device=args.device)
        t0 = time.perf_counter()
        loss = step(text[idx], text[idx + 1])
        print(f"step {i}: loss {loss.item():.4f}  ({time.perf_counter() - t0:.2f} s)")
    print(flash_inductor.memory_report(model, optimizer))
    if args.device.startswith("cuda"):
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
