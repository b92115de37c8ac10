"""FP8-LM's precision-decoupling ablation on a small model (CPU): why ``state_format="fp8lm"`` keeps
the second moment in fp16.

FP8-LM (arXiv 2310.18313, Fig. 8) reports that Adam's first moment trains fine in FP8 e4m3 but a
second moment in FP8 diverges. This script trains one small model with AdamW whose states are
stored, after every step, in each of these formats (one scale per tensor, ``formats/tensor_scaled.py``):

    fp32           no quantization (the reference)
    fp8lm          the preset: first moment e4m3, second moment fp16 (with the package's floor)
    v_e4m3         the second moment in e4m3 too, rounded as FP8-LM does (no floor): the ablation
    v_e4m3_floor   the same, with the package's floor (a positive v stores the smallest code at least)

Only the states are quantized: parameters stay fp32 and every run sees the same batches, so the
differences are the state formats'. The model: an embedding of 32 tokens, a 2-layer MLP and an
output layer predicting the next token of a fixed random Markov chain (its entropy is the floor of
the loss). Columns: mean loss over windows of ``--window`` steps; ``first non-finite`` is the first
step whose loss was nan or inf.

    python benchmarks/fp8lm_ablation.py --seeds 0 1 2 > benchmarks/results/fp8lm_ablation_cpu.log
"""

import argparse
import functools
import math

import torch
import torch.nn as nn

from flash_inductor.formats import tensor_scaled

E4M3, FP16 = tensor_scaled.E4M3, torch.float16
# variant -> (first moment dtype, second moment dtype, floor on the second moment); None: fp32
VARIANTS = {
    "fp32": (None, None, False),
    "fp8lm": (E4M3, FP16, True),
    "v_e4m3": (E4M3, E4M3, False),
    "v_e4m3_floor": (E4M3, E4M3, True),
}
VOCAB, CONTEXT, WIDTH = 32, 16, 64


def _stored(x, dtype, floor):
    """``x`` after a round trip through the per-tensor format (``dtype`` None: unchanged)."""
    if dtype is None:
        return x
    rows = nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % 32)).view(-1, 32)
    starts = torch.zeros(1, dtype=torch.int64)
    codes, scales = tensor_scaled.encode(rows, starts, dtype, floor)
    return tensor_scaled.decode(codes, scales, starts).view(-1)[:x.numel()].view(x.shape)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Flatten(), nn.Linear(WIDTH * CONTEXT, 256), nn.GELU(),
        nn.Linear(256, 256), nn.GELU(), nn.Linear(256, VOCAB),
    )


def _chain(seed):
    """Next-token logits of a random Markov chain, and its entropy rate (the best loss possible)."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(10_000 + seed)) * 2
    probs = logits.softmax(-1)
    stationary = torch.linalg.matrix_power(probs, 256)[0]
    entropy = -(stationary[:, None] * probs * probs.log()).sum()
    return logits, float(entropy)


@functools.lru_cache(maxsize=4)
def _batches(seed, steps, size=64):
    """``steps`` batches (context, next token) of the chain of ``seed``: the same for every variant."""
    logits, _ = _chain(seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.empty(steps, size, CONTEXT + 1, dtype=torch.int64)
    x[:, :, 0] = torch.randint(0, VOCAB, (steps, size), generator=generator)
    for t in range(CONTEXT):
        x[:, :, t + 1] = torch.multinomial(logits[x[:, :, t].reshape(-1)].softmax(-1), 1, generator=generator).view(steps, size)
    return x[:, :, :-1], x[:, :, -1]


def train(variant, seed=0, steps=600, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
    """Losses of ``steps`` AdamW steps with the states stored as ``variant`` says (nan from the
    first non-finite loss on: a diverged run is not continued)."""
    m_dtype, v_dtype, floor = VARIANTS[variant]
    model = _model(seed)
    inputs, targets = _batches(seed, steps)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = betas
    losses = []
    for t in range(1, steps + 1):
        loss = nn.functional.cross_entropy(model(inputs[t - 1]), targets[t - 1])
        if not math.isfinite(loss.item()):
            return losses + [math.nan] * (steps - len(losses))
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():  # torch.optim.AdamW's update, the states stored after each step
            for i, p in enumerate(params):
                g = p.grad
                m[i] = _stored(b1 * m[i] + (1 - b1) * g, m_dtype, False)
                v[i] = _stored(b2 * v[i] + (1 - b2) * g * g, v_dtype, floor)
                p.mul_(1 - lr * weight_decay)
                denom = (v[i] / (1 - b2**t)).sqrt() + eps
                p.sub_(lr / (1 - b1**t) * m[i] / denom)
    return losses


def summarize(losses, window):
    first_bad = next((i + 1 for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
    means = [sum(losses[i:i + window]) / window for i in range(0, len(losses), window)]
    return means, first_bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--window", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        _, entropy = _chain(seed)
        print(f"seed {seed}: {args.steps} steps, mean loss per {args.window} steps (best possible {entropy:.3f})")
        for variant in VARIANTS:
            means, first_bad = summarize(train(variant, seed, args.steps), args.window)
            print(f"  {variant:13s} " + " ".join(f"{x:7.3f}" for x in means)
                  + f"   first non-finite: {first_bad if first_bad else '-'}", flush=True)


if __name__ == "__main__":
    main()
