"""End-to-end training benchmark (issue 5): a GPT-style decoder, one process, several configurations.

The model is a plain-PyTorch GPT-2-style decoder (pre-norm blocks, learned positions, untied LM
head) over bytes (vocabulary 256). The corpus is the Python standard library's own ``*.py`` files,
present on every machine without network: read sorted by path, concatenated, split 98% / 2% by
position into training and held-out text. Every configuration sees the same initial weights and
the same batches (same seed), one after another in this one process:

    fp32_fused_autocast  fp32 params, torch AdamW (fused on CUDA), bf16 autocast; torch.compile
    bf16_adamw           bf16 params, stock torch AdamW (no master weights); torch.compile
    flashoptim           flash_inductor: bf16 + 24-bit split masters, 8-bit states; @train_step
    flashoptim_fp8       flashoptim + FP8 (tensorwise) linears, embedding and LM head excluded
    flashoptim_release   flashoptim with gradient release (each parameter updated in backward)
    flashoptim_no_masters  flashoptim with master_weight_bits=None: bf16 weights, no error terms, 8-bit states
    flashoptim_fp8lm     flashoptim with FP8-LM's optimizer states (state_format="fp8lm": e4m3 first moment,
                         fp16 second moment, one scale per tensor)
    flashoptim_fp8grads  flashoptim with FP8 gradients (gradient_format="e5m2": 1 B/param, one scale per tensor)
    flashoptim_fp8lm_fp8grads  flashoptim_fp8lm with FP8 gradients: FP8-LM's optimizer (issue 16, item 4)
    flashoptim_pypi      peer: the ``flashoptim`` package's FlashAdamW (CUDA only); compiled model
    torchao_adamw8bit    peer: torchao.optim.AdamW8bit on bf16 params (stochastic rounding);
                         compiled model

Peers are skipped with a note when their package is missing or refuses this machine. Model sizes
(``--config``): tiny (~0.9M parameters, CPU smoke test), 124m (GPT-2 small's shape: 12 layers,
d=768; 86M parameters with a 256-byte vocabulary), 350m (24 x 1024), 1b (24 x 2048, 1.2B);
``--layers/--dim/--heads/--seq`` override. The learning rate is constant (no schedule);
``--grad-clip`` clips the gradients' total norm (off by default). benchmarks/quality.py runs these
configurations over several seeds with a schedule and clipping (issue 15).

    python benchmarks/train_gpt.py --config tiny --steps 20                      # CPU smoke run
    python benchmarks/train_gpt.py --config 124m --steps 1000 --plot plots/      # GPU comparison
    python benchmarks/train_gpt.py --config 1b --find-largest                    # GPU only

Per configuration the JSON (``--out``) holds: peak memory (CUDA), memory by component from
``flash_inductor.memory_report`` plus activations (= peak - baseline - components, CUDA only),
median step time and tokens/s after ``--warmup`` steps, compile time (first step minus median),
the training loss of every step and the held-out loss every ``--eval-every`` steps (mean over
``--eval-batches`` fixed held-out batches, computed eagerly: without FP8 for flashoptim_fp8).
"""

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import pathlib
import platform
import statistics
import subprocess
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor import inspection

# ---------------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    layers: int
    dim: int
    heads: int
    seq: int  # context length (size of the learned position table)
    vocab: int = 256


SIZES = {  # name -> (model shape, default batch, default learning rate)
    "tiny": (GPTConfig(layers=4, dim=128, heads=4, seq=128), 8, 3e-3),
    "124m": (GPTConfig(layers=12, dim=768, heads=12, seq=1024), 16, 6e-4),
    "350m": (GPTConfig(layers=24, dim=1024, heads=16, seq=1024), 8, 3e-4),
    "1b": (GPTConfig(layers=24, dim=2048, heads=16, seq=1024), 8, 2e-4),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv, self.proj = nn.Linear(cfg.dim, 3 * cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.fc, self.fc_proj = nn.Linear(cfg.dim, 4 * cfg.dim), nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok_embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: residual projections scaled down with depth
            for proj in (block.proj, block.fc_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens):
        x = self.tok_embed(tokens) + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


# ----------------------------------------------------------------------------------------- data


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor  # uint8 bytes
    heldout: torch.Tensor
    info: dict


def stdlib_sources():
    """Every ``*.py`` of the standard library (not site-packages), sorted by path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    third_party = {"site-packages", "dist-packages"}
    return root, sorted(p for p in root.rglob("*.py") if not third_party & set(p.relative_to(root).parts))


def load_corpus(heldout_fraction=0.02):
    root, files = stdlib_sources()
    text = b"".join(p.read_bytes() for p in files)
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(text) * (1 - heldout_fraction))
    info = dict(root=str(root), files=len(files), bytes=len(text), sha256=hashlib.sha256(text).hexdigest(),
                train_tokens=split, heldout_tokens=len(text) - split)
    return Corpus(tokens[:split], tokens[split:], info)


def batch(data, starts, seq):
    """Inputs and next-byte targets of the windows starting at ``starts``."""
    window = data[starts[:, None] + torch.arange(seq + 1, device=data.device)].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def train_starts(n_tokens, steps, batch_size, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - seq - 1, (steps, batch_size), generator=gen)


def heldout_starts(n_tokens, n_batches, batch_size, seq):
    """Evenly spaced windows over the held-out text: the same for every configuration and step."""
    starts = torch.linspace(0, n_tokens - seq - 2, n_batches * batch_size).long()
    return starts.view(n_batches, batch_size)


# ------------------------------------------------------------------------------- configurations


class Skip(Exception):
    """A configuration that cannot run here (a peer package missing, or no CUDA for it)."""


@dataclasses.dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: object  # (x, y) -> loss: forward, backward, optimizer step, zero_grad
    autocast: bool = False  # forward under bf16 autocast (training and held-out evaluation)
    memory: object = None  # (model, optimizer) -> bytes by component; default memory_report
    record_fp8: bool = False  # record which linears became FP8 during the first step


def autocast(device, enabled):
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def make_step(model, optimizer, use_autocast=False, grad_clip=None, fp8_gradients=False):
    """Forward, backward, clipping of the gradients' total norm to ``grad_clip`` (None: none), step.
    ``fp8_gradients``: clip with ``flash_inductor.clip_grad_norm_`` (torch's would not see them)."""
    device = next(model.parameters()).device

    def step(x, y):
        with autocast(device, use_autocast):
            loss = lm_loss(model, x, y)
        loss.backward()
        if grad_clip is not None and fp8_gradients:
            flash_inductor.clip_grad_norm_(optimizer, grad_clip)
        elif grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def adamw_args(args):
    return dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)


def compiled(fn, args):
    """``fn`` (a step or a model) compiled by Inductor, or as it is under ``--no-inductor``."""
    return fn if args.no_inductor else torch.compile(fn, backend="inductor")


def build_fp32_fused_autocast(model, args):
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args), fused=model.lm_head.weight.is_cuda)
    return Setup(model, opt, compiled(make_step(model, opt, True, args.grad_clip), args), autocast=True)


def build_bf16_adamw(model, args):
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args))
    return Setup(model, opt, compiled(make_step(model, opt, grad_clip=args.grad_clip), args))


def build_flashoptim(model, args, gradient_release=False, master_weight_bits=24, state_format="companded",
                     gradient_format=None, **options):
    opt = torch.optim.AdamW(model.parameters(), **adamw_args(args))
    step = make_step(model, opt, grad_clip=args.grad_clip, fp8_gradients=gradient_format is not None)
    prepare_args = dict(gradient_release=gradient_release, master_weight_bits=master_weight_bits, state_format=state_format,
                        gradient_format=gradient_format)
    if args.no_inductor:  # eager model; the prepared step runs the rewritten graph op by op
        flash_inductor.prepare(model, opt, compile_options={**options, "compiler": "eager"}, **prepare_args)
        return Setup(model, opt, step)
    step = flash_inductor.train_step(step, model=model, optimizer=opt, **prepare_args, **options)
    return Setup(model, opt, step, record_fp8="fp8" in options)


def build_flashoptim_release(model, args):
    return build_flashoptim(model, args, gradient_release=True)


def build_flashoptim_no_masters(model, args):
    return build_flashoptim(model, args, master_weight_bits=None)


def build_flashoptim_fp8lm(model, args):
    return build_flashoptim(model, args, state_format="fp8lm")


def build_flashoptim_fp8grads(model, args):
    return build_flashoptim(model, args, gradient_format="e5m2")


def build_flashoptim_fp8lm_fp8grads(model, args):
    return build_flashoptim(model, args, state_format="fp8lm", gradient_format="e5m2")


def build_flashoptim_fp8(model, args):
    options = dict(fp8="tensorwise", fp8_exclude=("tok_embed", "pos_embed", "lm_head"))
    if args.fp8_min_weight_numel is not None:
        options["fp8_min_weight_numel"] = args.fp8_min_weight_numel
    return build_flashoptim(model, args, **options)


def build_flashoptim_pypi(model, args):
    try:
        from flashoptim import FlashAdamW, cast_model
    except ImportError as e:
        raise Skip(f"package flashoptim not importable ({e})") from None
    if not model.lm_head.weight.is_cuda:
        raise Skip("flashoptim's FlashAdamW needs CUDA (quantized states and error bits are Triton kernels)")
    cast_model(model, dtype=torch.bfloat16)
    opt = FlashAdamW(model.parameters(), **adamw_args(args), master_weight_bits=24)
    return Setup(model, opt, make_step(compiled(model, args), opt, grad_clip=args.grad_clip), memory=peer_memory)


def build_torchao_adamw8bit(model, args):
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise Skip(f"torchao.optim.AdamW8bit not importable ({e})") from None
    model.to(torch.bfloat16)
    opt = AdamW8bit(model.parameters(), **adamw_args(args), bf16_stochastic_round=True)
    return Setup(model, opt, make_step(compiled(model, args), opt, grad_clip=args.grad_clip), memory=peer_memory)


CONFIGURATIONS = {  # name -> builder(model with fp32 params on the device, args) -> Setup
    "fp32_fused_autocast": build_fp32_fused_autocast,
    "bf16_adamw": build_bf16_adamw,
    "flashoptim": build_flashoptim,
    "flashoptim_fp8": build_flashoptim_fp8,
    "flashoptim_release": build_flashoptim_release,
    "flashoptim_no_masters": build_flashoptim_no_masters,
    "flashoptim_fp8lm": build_flashoptim_fp8lm,
    "flashoptim_fp8grads": build_flashoptim_fp8grads,
    "flashoptim_fp8lm_fp8grads": build_flashoptim_fp8lm_fp8grads,
    "flashoptim_pypi": build_flashoptim_pypi,
    "torchao_adamw8bit": build_torchao_adamw8bit,
}


def _nbytes(t):
    return t.numel() * t.element_size()


def _state_parts(value):
    """name -> tensor, for one optimizer state of a peer: a plain tensor, a tensor subclass
    (torchao's codes + scale + qmap) or flashoptim's _MaybeQuantizedTensor (codes + scales)."""
    if hasattr(value, "is_quantized") and not isinstance(value, torch.Tensor):
        return {"codes": value.quantized, "scales": value.scales} if value.is_quantized() else {"values": value.data}
    if isinstance(value, torch.Tensor) and hasattr(type(value), "__tensor_flatten__"):
        return {name: getattr(value, name) for name in value.__tensor_flatten__()[0]}
    return {"values": value} if isinstance(value, torch.Tensor) else {}


def peer_memory(model, optimizer):
    """memory_report's weights and grads; states, scales and error bits read off a peer's state."""
    sizes = flash_inductor.memory_report(model, optimizer).bytes
    sizes.update(error_terms=0, states=0, state_scales=0)
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step":
                continue
            for name, tensor in _state_parts(value).items():
                kind = "error_terms" if key == "error_bits" else "state_scales" if "scale" in name else "states"
                sizes[kind] += _nbytes(tensor)
    return sizes


# ------------------------------------------------------------------------------------- training


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_step(setup, x, y, device, first):
    """One train step, from a synchronized start until its loss is on the host: (loss, seconds, the
    FP8 decisions when it is the ``first`` and the setup records them, else None)."""
    synchronize(device)
    t0 = time.perf_counter()
    decisions = None
    if first and setup.record_fp8:
        loss, decisions = first_step_recording_fp8(setup, x, y)
    else:
        loss = setup.step(x, y)
    loss = loss.item()  # waits for the step
    return loss, time.perf_counter() - t0, decisions


@torch.no_grad()
def heldout_loss(setup, corpus, starts, seq, device):
    losses = []
    for rows in starts:
        x, y = batch(corpus.heldout, rows.to(device), seq)
        with autocast(device, setup.autocast):
            losses.append(lm_loss(setup.model, x, y).item())
    return sum(losses) / len(losses)


def first_step_recording_fp8(setup, x, y):
    """Run the first step while recording the backend's FP8 decisions (which linears, and why not);
    prints where its compile time went, graph by graph. Recording bypasses Inductor's FX graph and
    AOT caches, so this step compiles every graph."""
    report = inspection.Report()
    with inspection.collecting(report):
        loss = setup.step(x, y)
    for g in report.graphs:
        if g.compile_seconds:
            print(f"    {g.name} ({g.kind}) compile seconds: {g.compile_seconds_text()}", flush=True)
    decisions = {subject: decision for g in report.graphs for p, subject, decision in g.decisions if p == "fp8_linear"}
    return loss, decisions


def train(setup, corpus, args, device, progress=None):
    """Train ``args.steps`` steps; returns losses, step times and held-out losses. ``progress(result)``,
    if given, is called after every held-out evaluation (with the result so far)."""
    seq = args.seq
    starts = train_starts(len(corpus.train), args.steps, args.batch, seq, args.seed).to(device)
    eval_starts = heldout_starts(len(corpus.heldout), args.eval_batches, args.batch, seq)
    result = dict(train_loss=[], step_s=[], heldout=[], fp8_decisions=None)
    result["heldout"].append(dict(step=0, loss=heldout_loss(setup, corpus, eval_starts, seq, device)))
    if progress:
        progress(result)
    for i in range(args.steps):
        x, y = batch(corpus.train, starts[i], seq)
        loss, seconds, decisions = timed_step(setup, x, y, device, first=i == 0)
        if i == 0:
            result["fp8_decisions"] = decisions
        result["step_s"].append(seconds)
        result["train_loss"].append(loss)
        if (i + 1) % args.log_every == 0 or i == 0:
            print(f"  step {i + 1:5d}  loss {loss:.4f}  {result['step_s'][-1] * 1e3:9.1f} ms", flush=True)
        if not math.isfinite(loss):
            print(f"  loss is {loss} at step {i + 1}: stopping this configuration")
            break
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            result["heldout"].append(dict(step=i + 1, loss=heldout_loss(setup, corpus, eval_starts, seq, device)))
            print(f"  step {i + 1:5d}  held-out loss {result['heldout'][-1]['loss']:.4f}", flush=True)
            if progress:
                progress(result)
    return result


def timing(step_s, warmup, tokens_per_step):
    measured = step_s[warmup:] or step_s[1:] or step_s
    median = statistics.median(measured)
    return dict(median_step_s=median, tokens_per_s=tokens_per_step / median, measured_steps=len(measured),
                first_step_s=step_s[0], compile_s=step_s[0] - median,
                warmup_excess_s=sum(t - median for t in step_s[: max(warmup, 1)]))


def build(name, cfg, args, device):
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = GPT(cfg)
    return CONFIGURATIONS[name](model, args)


def run_configuration(name, cfg, corpus, args, device):
    """Build, train and measure one configuration; everything it allocated is freed on return."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if cuda else None
    setup = build(name, cfg, args, device)
    result = train(setup, corpus, args, device)
    result.update(timing(result["step_s"], args.warmup, args.batch * args.seq))
    components = dict(setup.memory(setup.model, setup.optimizer) if setup.memory
                      else flash_inductor.memory_report(setup.model, setup.optimizer).bytes)
    num_params = sum(p.numel() for p in setup.model.parameters())
    peak = torch.cuda.max_memory_allocated() if cuda else None
    components["activations"] = peak - baseline - sum(components.values()) if cuda else None
    result.update(num_params=num_params, peak_bytes=peak, baseline_bytes=baseline, memory_bytes=components,
                  memory_per_param={k: (v / num_params if v is not None else None) for k, v in components.items()})
    return result


def release_memory(device):
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------- find-largest


def _is_oom(exc):
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def try_depth(name, cfg, corpus, args, device):
    """Does ``cfg`` train ``args.find_steps`` steps without running out of GPU memory?"""
    release_memory(device)
    torch.cuda.reset_peak_memory_stats()
    try:
        setup = build(name, cfg, args, device)
        starts = train_starts(len(corpus.train), args.find_steps, args.batch, args.seq, args.seed).to(device)
        for rows in starts:
            setup.step(*batch(corpus.train, rows, args.seq)).item()
        fits, params = True, sum(p.numel() for p in setup.model.parameters())
    except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer; the rest is re-raised
        if not _is_oom(e):
            raise
        fits, params = False, None
    setup = None  # noqa: F841 - drop the model before measuring and freeing
    peak = torch.cuda.max_memory_allocated()
    release_memory(device)
    print(f"  {name}: {cfg.layers} layers: {'fits' if fits else 'out of memory'} (peak {peak / 2**30:.1f} GiB)",
          flush=True)
    return dict(layers=cfg.layers, fits=fits, num_params=params, peak_bytes=peak)


def find_largest(name, cfg, corpus, args, device):
    """Largest depth at this width, batch and context that trains: doubling, then bisection."""
    tries = []

    def fits(layers):
        tries.append(try_depth(name, dataclasses.replace(cfg, layers=layers), corpus, args, device))
        return tries[-1]["fits"]

    lo, hi, layers = 0, None, cfg.layers
    while hi is None:
        if not fits(layers):
            hi = layers
        elif layers >= args.find_max_layers:
            lo = hi = layers  # fits at the cap: stop there
        else:
            lo, layers = layers, min(2 * layers, args.find_max_layers)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    largest = next((t for t in tries if t["layers"] == lo and t["fits"]), None)
    return dict(largest_layers=lo or None, largest_num_params=largest and largest["num_params"],
                capped=lo == args.find_max_layers, tries=tries)


# ---------------------------------------------------------------------------------------- report


def print_table(runs):
    mib = 2**20
    header = ("configuration", "params", "peak MiB", "weights", "err", "states", "grads", "act",
              "ms/step", "tok/s", "compile s", "train loss", "held-out")
    rows = [header]
    for name, r in runs.items():
        mem = r["memory_bytes"]

        def g(v):
            return "-" if v is None else f"{v / mib:.1f}"

        rows.append((name, f"{r['num_params'] / 1e6:.1f}M", g(r["peak_bytes"]), g(mem["weights"]),
                     g(mem["error_terms"]), g(mem["states"] + mem["state_scales"]), g(mem["grads"]),
                     g(mem["activations"]), f"{r['median_step_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}",
                     f"{r['compile_s']:.1f}", f"{statistics.mean(r['train_loss'][-10:]):.4f}",
                     f"{r['heldout'][-1]['loss']:.4f}"))
    print_aligned(rows)
    print("memory columns in MiB (states include scales); train loss = mean of the last 10 steps")


def print_aligned(rows):
    """Rows of strings, the first the header: columns aligned (the first left, the rest right), a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    print("\n".join(lines))


def save_plots(results, folder, prefix=""):
    """``{prefix}memory_breakdown.png`` and, for runs long enough to have a curve (three held-out
    evaluations or more), ``{prefix}loss_curves.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    runs = results["runs"]
    written = []
    if all(len(r["heldout"]) >= 3 for r in runs.values()):
        written.append(_plot_losses(plt, runs, folder / f"{prefix}loss_curves.png"))
    written.append(_plot_memory(plt, results, folder / f"{prefix}memory_breakdown.png"))
    print("wrote " + " and ".join(map(str, written)))


def _plot_losses(plt, runs, path):
    fig, (ax_train, ax_held) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, r in runs.items():
        losses = r["train_loss"]
        k = max(1, len(losses) // 50)
        smooth = [statistics.mean(losses[max(0, i - k + 1): i + 1]) for i in range(len(losses))]
        ax_train.plot(range(1, len(losses) + 1), smooth, label=name, lw=1)
        ax_held.plot([e["step"] for e in r["heldout"]], [e["loss"] for e in r["heldout"]], marker="o", ms=3,
                     label=name)
    ax_train.set(title=f"training loss (running mean over {k} steps)", xlabel="step", ylabel="loss (nats/byte)")
    ax_held.set(title="held-out loss", xlabel="step", ylabel="loss (nats/byte)")
    for ax in (ax_train, ax_held):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_memory(plt, results, path):
    runs = results["runs"]
    components = ("weights", "error_terms", "states", "state_scales", "grads", "activations")
    largest = max(sum(v or 0 for v in r["memory_bytes"].values()) for r in runs.values())
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 3, 4.5))
    bottom = [0.0] * len(runs)
    for component in components:
        values = [(r["memory_bytes"][component] or 0) / scale for r in runs.values()]
        ax.bar(list(runs), values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values)]
    info = results["info"]
    no_activations = " (activations: CUDA only)" if any(r["peak_bytes"] is None for r in runs.values()) else ""
    ax.set(ylabel=unit, title=f"memory by component, {info['model']['num_params'] / 1e6:,.1f}M parameters, "
                              f"{info['device']}{no_activations}")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ main


def add_model_arguments(parser, default_size):
    """The model size and its overrides, batch and learning rate (also benchmarks/quality.py's)."""
    parser.add_argument("--config", choices=sorted(SIZES), default=default_size, help="model size")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int, help="context length (default: the size's)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the size's)")
    parser.add_argument("--lr", type=float, help="AdamW learning rate (default: the size's)")
    parser.add_argument("--grad-clip", type=float, help="clip the gradients' total norm to this (default: no clipping)")
    parser.add_argument("--fp8-min-weight-numel", type=int, help="flashoptim_fp8 (default: the backend's)")


def resolve_model_arguments(parser, args):
    """``args.model`` (a GPTConfig) from the size and its overrides; ``args.seq``, ``args.batch`` and
    ``args.lr`` filled in from the size's defaults."""
    shape, default_batch, default_lr = SIZES[args.config]
    overrides = {k: getattr(args, k) for k in ("layers", "dim", "heads", "seq") if getattr(args, k) is not None}
    args.model = dataclasses.replace(shape, **overrides)
    if args.model.dim % args.model.heads:
        parser.error(f"--dim {args.model.dim} is not a multiple of --heads {args.model.heads}")
    args.seq = args.model.seq
    args.batch = args.batch or default_batch
    args.lr = args.lr or default_lr


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, "tiny")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help=f"comma list of {', '.join(CONFIGURATIONS)}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="train_gpt.json")
    parser.add_argument("--plot", metavar="DIR", help="save loss_curves.png and memory_breakdown.png there")
    parser.add_argument("--plot-prefix", default="", help="prefix of the plot files' names")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="only plot (into --plot) the runs of these result files, e.g. of runs made in parts")
    parser.add_argument("--find-largest", action="store_true",
                        help="instead of training: the deepest model (at this width, batch, context) that fits on "
                             "the GPU for fp32_fused_autocast and flashoptim")
    parser.add_argument("--no-inductor", action="store_true",
                        help="run every configuration without Inductor: the model eagerly, flashoptim's optimizer "
                             "step as the rewritten graph op by op (same stored formats, eager activations and "
                             "temporaries); --find-largest always does, so a try costs seconds, not a compile")
    parser.add_argument("--find-steps", type=int, default=2, help="steps per try of --find-largest")
    parser.add_argument("--find-max-layers", type=int, default=512)
    args = parser.parse_args(argv)

    unknown = [c for c in args.configs.split(",") if c not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    if args.find_largest and not args.device.startswith("cuda"):
        parser.error("--find-largest needs a CUDA GPU: it deepens the model until torch.cuda.OutOfMemoryError, "
                     "and there is no GPU memory to fill here")
    resolve_model_arguments(parser, args)
    args.no_inductor = args.no_inductor or args.find_largest
    return args


def git_commit():
    """The checkout's commit, with "+changes" where tracked files differ from it: the device machine's copy
    of a working tree keeps the commit its session started from, whatever was committed since."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=pathlib.Path(__file__).parent,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def write_json(results, path):
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def plot_from(paths, folder, prefix=""):
    """Merge the runs of several result files of the same model and plot them."""
    results = None
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        if results is None:
            results = part
        elif part["info"]["model"] != results["info"]["model"]:
            raise ValueError(f"{path}: model {part['info']['model']} differs from {results['info']['model']}")
        else:
            results["runs"].update(part["runs"])
    save_plots(results, folder, prefix)


def main(argv=None):
    args = parse_args(argv)
    if args.plot_from:
        return plot_from(args.plot_from, args.plot or ".", args.plot_prefix)
    device = torch.device(args.device)
    corpus = load_corpus()
    corpus.train, corpus.heldout = corpus.train.to(device), corpus.heldout.to(device)
    cfg = args.model
    with torch.device("meta"):
        num_params = sum(p.numel() for p in GPT(cfg).parameters())
    info = dict(
        torch=torch.__version__, python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M"),
        commit=git_commit(), device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        corpus=corpus.info, model=dict(dataclasses.asdict(cfg), num_params=num_params, size=args.config),
        batch=args.batch, lr=args.lr, grad_clip=args.grad_clip, no_inductor=args.no_inductor, steps=args.steps, seed=args.seed,
        warmup=args.warmup, eval_every=args.eval_every, eval_batches=args.eval_batches,
    )
    results = dict(info=info, runs={}, skipped={})
    print(f"corpus: {corpus.info['files']} files, {corpus.info['bytes'] / 1e6:.1f} MB; model {cfg}, "
          f"{num_params / 1e6:.2f}M parameters; batch {args.batch} x {args.seq} on {info['device']}", flush=True)

    if args.find_largest:
        results["find_largest"] = {}
        for name in ("fp32_fused_autocast", "flashoptim"):
            print(f"== find-largest {name}: width {cfg.dim}, batch {args.batch} x {args.seq}", flush=True)
            results["find_largest"][name] = find_largest(name, cfg, corpus, args, device)
            write_json(results, args.out)
        for name, r in results["find_largest"].items():
            print(f"{name}: largest {r['largest_layers']} layers ({(r['largest_num_params'] or 0) / 1e9:.2f}B "
                  f"parameters){' (at --find-max-layers)' if r['capped'] else ''}")
        print(f"wrote {args.out}")
        return results

    for name in args.configs.split(","):
        print(f"== {name}", flush=True)
        try:
            results["runs"][name] = run_configuration(name, cfg, corpus, args, device)
        except Skip as e:
            results["skipped"][name] = str(e)
            print(f"  skipped: {e}")
        release_memory(device)
        write_json(results, args.out)  # after every configuration: a run cut short keeps what it measured

    print()
    print_table(results["runs"])
    for name, reason in results["skipped"].items():
        print(f"skipped {name}: {reason}")
    if args.plot:
        save_plots(results, args.plot, args.plot_prefix)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
