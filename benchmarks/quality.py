"""Training quality over seeds (issue 15): does flashoptim train as well as fp32 masters?

One protocol, several configurations, several seeds. Each (configuration, seed) run is its own
process; an aggregate step gives per configuration the mean and standard deviation over seeds of
the final held-out loss, the loss curves (mean with a band) and the verdict of issue 15's rule.

Protocol (the defaults): benchmarks/train_gpt.py's GPT at the 124m shape (12 x 768, context 1024;
86M parameters with its 256-byte vocabulary) on every ``*.py`` file of the Python installation
(sysconfig's stdlib and site-packages paths; file count, bytes and sha256 recorded), split by file:
a hash of the file's path inside its root sends about 2% of the files to the held-out part. AdamW
(betas 0.9, 0.95, weight decay 0.1) at a peak lr of 6e-4 after a linear warm-up of 150 steps,
cosine decay to 10% of it at the last step; gradients clipped to a total norm of 1.0; batches of
16 x 1024 tokens at random places (the seed picks them and the initial weights), 1500 steps;
held-out loss on 64 fixed batches at step 0, every 250 steps and at the end.

Configurations (built by benchmarks/train_gpt.py):
    fp32_fused_autocast    (a) fp32 masters, torch fused AdamW, bf16 autocast
    flashoptim             (c) 24-bit split masters, 8-bit states (@flash_inductor.train_step)
    flashoptim_fp8         (d) (c) with FP8 (tensorwise) linears; embeddings and LM head excluded
    flashoptim_no_masters  (e) master_weight_bits=None: bf16 weights, 8-bit states (what the error term buys)
    flashoptim_pypi        peer: FlashOptim's FlashAdamW, 24-bit (skipped with a note without the
                           package or CUDA)

Verdict (issue 15): (c) passes when |mean(c) - mean(a)| <= max(0.5% of mean(a), 2 std(a)) for the
final held-out loss, (d) likewise with 1.5%. With fewer than 3 finished seeds of either side it says
"not enough seeds"; a seed whose loss became non-finite fails the configuration.

Runs go seed-major (every configuration of seed 0, then of seed 1, ...), ``--jobs`` at once on the
one device: a run's compile (CPU) overlaps the others' training. With ``--deadline-s`` no run starts
that would not end in time (estimated from the longest finished run of its configuration, else of
any), and runs still going at the deadline are stopped; whatever finished is kept. Each run writes
``RUNS_DIR/CONFIG_seedS.json`` (after every held-out evaluation, then complete) and its log beside
it (the folder's earlier runs are removed first); ``--out`` gets every run and the summary in one
JSON, ``--plot`` the curves.

``--hazard-every K`` (issue 15, item 4; runs of ``--hazard-configs``, default flashoptim): every K
steps, per parameter with 8-bit Adam states, how often the update computed from the decoded 8-bit
states exceeds 5x the one of an fp32 shadow Adam fed the same gradients, and how often a second
moment is below the 8-bit range, where the floor acts (docs/numerics.md, "Second-moment floor").

    python benchmarks/quality.py --config tiny --steps 300 --seeds 0 1 --device cpu \\
        --configs fp32_fused_autocast,flashoptim                                  # CPU, a few minutes
    python benchmarks/quality.py --seeds 0 1 2 --jobs 3 --deadline-s 520 \\
        --configs fp32_fused_autocast,flashoptim,flashoptim_fp8 --runs-dir /tmp/quality \\
        --out $OUT/quality_h200.json --plot $OUT/quality_h200.png                    # H200 (docs/benchmarks.md)
    python benchmarks/quality.py --aggregate quality_h200.json --plot docs/images/quality_curves.png
    python benchmarks/quality.py --aggregate first.json second.json --out all.json    # runs of two calls
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import sysconfig
import time

import torch
import train_gpt

from flash_inductor.formats import companded
from flash_inductor.formats.state_tensor import CompandedState

CONFIGURATIONS = {  # name -> issue 15's label
    "fp32_fused_autocast": "a",
    "flashoptim": "c",
    "flashoptim_fp8": "d",
    "flashoptim_no_masters": "e",
    "flashoptim_pypi": "peer",
}
BASELINE = "fp32_fused_autocast"
TOLERANCES = {"flashoptim": 0.005, "flashoptim_fp8": 0.015}  # of mean(a), issue 15's rule
MIN_SEEDS = 3
TIMING_WARMUP = 10  # steps left out of the median step time (compile, autotuning)

# ------------------------------------------------------------------------------------------ corpus


def python_sources():
    """``(roots, [(root, path inside it)])`` for every ``*.py`` under sysconfig's library paths (the
    standard library and site-packages), each listed under the innermost root that holds it, sorted."""
    paths = sysconfig.get_paths()
    roots = sorted({os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")})
    sources = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if os.path.join(folder, d) not in roots)  # walked as their own root
            sources += [(root, os.path.relpath(os.path.join(folder, f), root)) for f in sorted(files) if f.endswith(".py")]
    return roots, sources


def is_heldout(path, fraction):
    """The split by file: a hash of the path inside its root, so it does not depend on where Python lives."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") < fraction * 2**64


def load_python_corpus(heldout_fraction):
    roots, sources = python_sources()
    parts = {True: [], False: []}
    digest = hashlib.sha256()
    for root, path in sources:
        data = pathlib.Path(root, path).read_bytes()
        digest.update(path.encode() + b"\0" + data)
        parts[is_heldout(path, heldout_fraction)].append(data)
    train, heldout = b"".join(parts[False]), b"".join(parts[True])
    info = dict(roots=roots, files=len(sources), bytes=len(train) + len(heldout), sha256=digest.hexdigest(),
                heldout_fraction=heldout_fraction, train_files=len(parts[False]), heldout_files=len(parts[True]),
                train_tokens=len(train), heldout_tokens=len(heldout))
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return train_gpt.Corpus(as_tensor(train), as_tensor(heldout), info)


# ---------------------------------------------------------------------------------- schedule, probe


def lr_factor(step, steps, warmup, min_ratio):
    """The peak lr's multiplier at optimizer step ``step`` (from 0): linear warm-up over ``warmup``
    steps, then cosine decay to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def add_schedule(setup, args):
    """``setup.step`` followed by the scheduler's step (LambdaLR sets the step-0 lr at once); returns
    the list it appends each step's lr to."""
    schedule = functools.partial(lr_factor, steps=args.steps, warmup=args.warmup_steps, min_ratio=args.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(setup.optimizer, schedule)
    train_step, lrs = setup.step, []

    def step(x, y):
        lrs.append(float(setup.optimizer.param_groups[0]["lr"]))
        loss = train_step(x, y)
        scheduler.step()
        return loss

    setup.step = step
    return lrs


HAZARD_KEYS = ("over_5x", "over_5x_above_1", "damped_5x", "floored", "max_quantized", "max_shadow", "max_ratio",
               "mean_ratio")
FRACTIONS = HAZARD_KEYS[:4]


def compare_updates(quantized, shadow, v):
    """Issue 15's measures of |normalized update| from 8-bit states against the shadow's, one tensor:
    fractions of elements above 5x the shadow's (also: and above 1, beyond what Adam normally gives),
    below a fifth of it, and whose second moment ``v`` (about to be stored) is below the format's
    range, 1/510 of its group's largest sqrt(v) (``floored``: stored as one code step, where the
    paper's rounding stores 0); largest of each update; largest ratio (shadow updates under 0.01
    counted as 0.01, where a ratio says nothing); sum ratio."""
    q, ref = quantized.abs(), shadow.abs()
    over = q > 5 * ref
    n = q.numel()
    _, scales = companded.encode(v, companded.SQRT)
    root = v.reshape(-1).sqrt()
    floored = (root > 0) & (510 * root < scales.float().repeat_interleave(companded.GROUP_SIZE)[:n])
    values = [over.sum() / n, (over & (q > 1)).sum() / n, (q < ref / 5).sum() / n, floored.sum() / n, q.max(), ref.max(),
              (q / ref.clamp(min=0.01)).max(), q.sum() / ref.sum()]
    return dict(zip(HAZARD_KEYS, torch.stack([v.float() for v in values]).tolist()))


class HazardProbe:
    """Every ``every`` steps, per parameter with 8-bit Adam states: the normalized update
    ``|m^ / (sqrt(v^) + eps)|`` the coming step takes from the decoded 8-bit states and this step's
    gradient, against the one of an fp32 shadow Adam fed the same gradients since step 1 (8 bytes per
    parameter). A step pre-hook (after clipping, before the update) that only reads the model and the
    optimizer: the run trains as without it."""

    def __init__(self, model, optimizer, every):
        names = {p: name for name, p in model.named_parameters()}
        self.every, self.step, self.records = every, 0, []
        self.tensors = [
            (names[p], p, group, torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))
            for group in optimizer.param_groups for p in group["params"]
            if isinstance(optimizer.state[p].get("exp_avg_sq"), CompandedState)
        ]
        if not self.tensors:
            raise ValueError("--hazard-every: this configuration keeps no 8-bit Adam states; list only flashoptim* "
                             "configurations in --hazard-configs")
        self.numel = {name: p.numel() for name, p, *_ in self.tensors}
        optimizer.register_step_pre_hook(self.before_step)

    @torch.compiler.disable
    @torch.no_grad()
    def before_step(self, optimizer, args, kwargs):
        self.step += 1
        measure = self.step % self.every == 0
        tensors = {}
        for name, p, group, m, v in self.tensors:
            beta1, beta2 = (float(b) for b in group["betas"])
            g = p.grad.float()
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if measure:
                state = optimizer.state[p]
                m_q = state["exp_avg"].decode().lerp_(g, 1 - beta1)
                v_q = state["exp_avg_sq"].decode().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                tensors[name] = compare_updates(self.normalized(m_q, v_q, group), self.normalized(m, v, group), v_q)
        if measure:
            self.records.append(dict(step=self.step, tensors=tensors))

    def normalized(self, m, v, group):
        beta1, beta2 = (float(b) for b in group["betas"])
        return (m / (1 - beta1**self.step)) / ((v / (1 - beta2**self.step)).sqrt() + group["eps"])


# ----------------------------------------------------------------------------------------- one run


def run_path(runs_dir, config, seed):
    return pathlib.Path(runs_dir) / f"{config}_seed{seed}.json"


def write_json(data, path):
    """Written whole or not at all: a run stopped at the deadline leaves its last complete file."""
    tmp = pathlib.Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def protocol(args):
    return dict(steps=args.steps, batch=args.batch, seq=args.seq, adamw=train_gpt.adamw_args(args),
                warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio, grad_clip=args.grad_clip,
                eval_every=args.eval_every, eval_batches=args.eval_batches, heldout_fraction=args.heldout_fraction,
                no_inductor=args.no_inductor, hazard_every=args.hazard_every)


def run_one(args):
    """Train configuration ``args.run`` with seed ``args.seed``; its JSON is rewritten as it goes."""
    device = torch.device(args.device)
    path = run_path(args.runs_dir, args.run, args.seed)
    corpus = load_python_corpus(args.heldout_fraction)
    for part in ("train", "heldout"):
        if corpus.info[f"{part}_tokens"] < args.seq + 2:
            raise SystemExit(f"the {part} part has {corpus.info[f'{part}_tokens']} bytes, fewer than a window of --seq "
                             f"{args.seq} needs: change --heldout-fraction ({args.heldout_fraction})")
    corpus.train, corpus.heldout = corpus.train.to(device), corpus.heldout.to(device)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in train_gpt.GPT(args.model).parameters())
    info = dict(torch=torch.__version__, python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M"),
                commit=train_gpt.git_commit(), device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                corpus=corpus.info, model=dict(dataclasses.asdict(args.model), num_params=num_params, size=args.config),
                protocol=protocol(args))
    record = dict(config=args.run, seed=args.seed, complete=False, info=info)
    print(f"{args.run} seed {args.seed}: corpus {corpus.info['files']} files, {corpus.info['bytes'] / 1e6:.1f} MB "
          f"({corpus.info['heldout_files']} files held out); {num_params / 1e6:.2f}M parameters", flush=True)
    try:
        setup = train_gpt.build(args.run, args.model, args, device)
    except train_gpt.Skip as e:
        print(f"skipped: {e}")
        write_json(dict(record, complete=True, skipped=str(e)), path)
        return
    record["lr"] = add_schedule(setup, args)
    probe = HazardProbe(setup.model, setup.optimizer, args.hazard_every) \
        if args.hazard_every and args.run in args.hazard_configs else None

    def progress(result):
        record.update(result)
        if probe:
            record["hazard"] = dict(every=probe.every, numel=probe.numel, records=probe.records)
        write_json(record, path)

    result = train_gpt.train(setup, corpus, args, device, progress)
    record.update(train_gpt.timing(result["step_s"], TIMING_WARMUP, args.batch * args.seq), complete=True,
                  peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    progress(result)


# ------------------------------------------------------------------------------------ many runs


def child_command(argv, config, seed):
    """The command that runs one (configuration, seed): this script, this command line, ``--run``."""
    return [sys.executable, __file__, *argv, "--run", config, "--seed", str(seed)]


def _clock(t0):
    return f"[{time.monotonic() - t0:6.1f} s]"


def _estimate(config, walls):
    """Seconds a run of ``config`` is expected to take: the longest finished run of it, else of any."""
    pool = [w for c, w in walls if c == config] or [w for _, w in walls]
    return max(pool, default=0.0)


def _stop(proc):
    """End a run and everything it started (its compile workers): its own process group, politely,
    then whatever is left of it."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def run_all(args, argv):
    """Every (configuration, seed), seed-major, ``args.jobs`` at a time, within ``args.deadline_s``.
    A SIGTERM (an outer ``timeout``) counts as the deadline: the runs are stopped, not orphaned (they
    run in sessions of their own), and what finished is still aggregated."""
    runs_dir = pathlib.Path(args.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    for old in [*runs_dir.glob("*_seed*.json"), *runs_dir.glob("*_seed*.log")]:  # the aggregate reads every run there
        old.unlink()
    pending = list(args.pairs or [(config, seed) for seed in args.seeds for config in args.configs])
    running, walls, events, terminated = {}, [], [], []
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))

    def note(event, config, seed, **extra):
        events.append(dict(event=event, config=config, seed=seed, at_s=round(time.monotonic() - t0, 1), **extra))

    while pending or running:
        while pending and len(running) < args.jobs:
            config, seed = pending.pop(0)
            estimate, left = _estimate(config, walls), (args.deadline_s or math.inf) - (time.monotonic() - t0)
            if estimate > left:
                print(f"{_clock(t0)} not started: {config} seed {seed} (needs ~{estimate:.0f} s, {left:.0f} s left)")
                note("not started", config, seed, estimate_s=estimate)
                continue
            log = open(runs_dir / f"{config}_seed{seed}.log", "w")
            proc = subprocess.Popen(child_command(argv, config, seed), stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # its own process group: _stop ends its compile workers too
            running[proc] = (config, seed, time.monotonic(), log)
            print(f"{_clock(t0)} started {config} seed {seed}", flush=True)
            note("started", config, seed)
        time.sleep(0.5)
        for proc in [p for p in running if p.poll() is not None]:
            config, seed, start, log = running.pop(proc)
            log.close()
            wall = time.monotonic() - start
            run = _read(run_path(runs_dir, config, seed))
            if proc.returncode == 0 and run and not run.get("skipped"):
                walls.append((config, wall))
            outcome = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            if run and run.get("skipped"):
                outcome = "skipped"
            final = f", held-out {run['heldout'][-1]['loss']:.4f}" if run and run.get("heldout") else ""
            print(f"{_clock(t0)} {outcome}: {config} seed {seed} in {wall:.0f} s{final}", flush=True)
            if proc.returncode != 0:  # its log stays on the machine: show how it ended
                tail = (runs_dir / f"{config}_seed{seed}.log").read_text(errors="replace").splitlines()[-25:]
                print("\n".join("    | " + line for line in tail))
            note(outcome, config, seed, wall_s=round(wall, 1), returncode=proc.returncode)
        if terminated or (args.deadline_s and time.monotonic() - t0 > args.deadline_s):
            why = "at SIGTERM" if terminated else "at the deadline"
            for proc, (config, seed, start, log) in running.items():
                _stop(proc)
                log.close()
                print(f"{_clock(t0)} stopped {why}: {config} seed {seed}")
                note(f"stopped {why}", config, seed, wall_s=round(time.monotonic() - start, 1))
            running.clear()
            for config, seed in pending:
                note("not started", config, seed)
            pending.clear()
    signal.signal(signal.SIGTERM, previous_handler)
    return dict(jobs=args.jobs, deadline_s=args.deadline_s, wall_s=round(time.monotonic() - t0, 1), events=events)


def _read(path):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------- aggregate


def load_runs(path):
    """Runs (``{CONFIG_seedS: run}``) and orchestration notes from a runs folder or a combined JSON."""
    path = pathlib.Path(path)
    if path.is_dir():
        return {p.stem: run for p in sorted(path.glob("*_seed*.json")) if (run := _read(p))}, None
    combined = json.loads(path.read_text())
    return combined["runs"], combined.get("orchestration")


def load_all(sources):
    """The runs of several sources (e.g. the combined JSONs of two device calls), and their notes."""
    runs, notes = {}, []
    for source in sources:
        more, noted = load_runs(source)
        for key in sorted(more.keys() & runs.keys()):
            print(f"warning: {key} is in more than one source; the one in {source} is used")
        runs.update(more)
        notes.append(noted)
    return runs, notes[0] if len(notes) == 1 else notes


def finished(run):
    """Trained every step (a run whose loss became non-finite stops early; a stopped one is incomplete)."""
    heldout = run.get("heldout") or []
    return run.get("complete") and not run.get("skipped") and heldout and heldout[-1]["step"] == run["info"]["protocol"]["steps"]


def _mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _curve(series):
    """Mean and standard deviation, position by position, of equally long series."""
    columns = list(zip(*series))
    return dict(mean=[statistics.mean(c) for c in columns],
                std=[statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns])


def summarize(runs):
    """Per configuration: finished seeds, final held-out loss (each, mean, std), curves, hazard."""
    by_config = {}
    for run in runs.values():
        by_config.setdefault(run["config"], []).append(run)
    summary = {}
    for config in sorted(by_config, key=lambda c: list(CONFIGURATIONS).index(c) if c in CONFIGURATIONS else 99):
        group = sorted(by_config[config], key=lambda r: r["seed"])
        done = [r for r in group if finished(r)]
        entry = dict(
            label=CONFIGURATIONS.get(config, ""), seeds=[r["seed"] for r in done],
            skipped=next((r["skipped"] for r in group if r.get("skipped")), None),
            diverged=[r["seed"] for r in group if r.get("complete") and not r.get("skipped") and not finished(r)],
            incomplete=[r["seed"] for r in group if not r.get("complete")],
            final_heldout=[r["heldout"][-1]["loss"] for r in done], mean=None, std=None)
        if done:
            entry["mean"], entry["std"] = _mean_std(entry["final_heldout"])
            entry["heldout_curve"] = dict(steps=[e["step"] for e in done[0]["heldout"]],
                                          **_curve([[e["loss"] for e in r["heldout"]] for r in done]))
            entry["heldout_by_seed"] = {str(r["seed"]): [e["loss"] for e in r["heldout"]] for r in done}
            entry["train_curve"] = _curve([r["train_loss"] for r in done])
        hazard = [r["hazard"] for r in group if r.get("hazard")]
        if hazard:
            entry["hazard"] = summarize_hazard(hazard)
        summary[config] = entry
    return summary


def summarize_hazard(hazards):
    """Over every seed and measurement: per tensor the largest of each measure, and element-weighted
    means of the fractions over all tensors."""
    per_tensor, weighted, total = {}, dict.fromkeys(FRACTIONS, 0.0), 0
    for hazard in hazards:
        for record in hazard["records"]:
            for name, values in record["tensors"].items():
                worst = per_tensor.setdefault(name, dict.fromkeys(HAZARD_KEYS, 0.0))
                for key in HAZARD_KEYS:
                    worst[key] = max(worst[key], values[key])
                for key in weighted:
                    weighted[key] += values[key] * hazard["numel"][name]
                total += hazard["numel"][name]
    return dict(measurements=sum(len(h["records"]) for h in hazards), mean={k: v / max(total, 1) for k, v in weighted.items()},
                max={key: max(t[key] for t in per_tensor.values()) for key in HAZARD_KEYS}, per_tensor_max=per_tensor)


def verdict(summary):
    """Issue 15's rule for (c) and (d) against (a)."""
    base = summary.get(BASELINE)
    verdicts = {}
    for config, tolerance in TOLERANCES.items():
        entry = summary.get(config)
        if entry is None or entry["skipped"]:
            continue
        rule = f"|mean - mean(a)| <= max({tolerance:.1%} of mean(a), 2 std(a))"
        if entry["diverged"]:
            verdicts[config] = dict(result="fail", rule=rule, reason=f"loss became non-finite (seeds {entry['diverged']})")
        elif base is None or len(base["seeds"]) < MIN_SEEDS or len(entry["seeds"]) < MIN_SEEDS:
            have = f"{len(entry['seeds'])} seed(s), (a) {len(base['seeds']) if base else 0}"
            verdicts[config] = dict(result="not enough seeds", rule=rule, reason=f"{have}; the rule needs {MIN_SEEDS} each")
        else:
            difference = entry["mean"] - base["mean"]
            allowed = max(tolerance * base["mean"], 2 * base["std"])
            verdicts[config] = dict(result="pass" if abs(difference) <= allowed else "fail", rule=rule, difference=difference,
                                    relative=difference / base["mean"], allowed=allowed)
        if base is not None and config in verdicts:
            verdicts[config]["paired"] = paired_differences(entry, base)
    return verdicts


def relative_to_base(entry, base):
    """Seed by seed (same initial weights, same batches; keyed by the seed as a string, as in JSON),
    each held-out evaluation's loss relative to (a)'s run of that seed, minus 1, for the seeds both
    finished: the seeds' spread in (a) is mostly when each run's loss drops, which pairing removes."""
    theirs = base.get("heldout_by_seed", {})
    return {seed: [loss / b - 1 for loss, b in zip(losses, theirs[seed])]
            for seed, losses in entry.get("heldout_by_seed", {}).items() if seed in theirs}


def paired_differences(entry, base):
    """``relative_to_base`` of the final held-out loss: per seed, and its mean and standard deviation
    over the seeds, or None without any."""
    relative = {seed: curve[-1] for seed, curve in relative_to_base(entry, base).items()}
    if not relative:
        return None
    mean, std = _mean_std(list(relative.values()))
    return dict(per_seed=relative, mean=mean, std=std)


def print_summary(summary, verdicts):
    base = summary.get(BASELINE)
    print(f"{'configuration':<24}{'':>5}{'seeds':>7}{'final held-out (mean ± std)':>30}{'vs (a)':>9}  verdict")
    for config, s in summary.items():
        if s["skipped"]:
            print(f"{config:<24}{s['label']:>5}  skipped: {s['skipped']}")
            continue
        mean = "-" if s["mean"] is None else f"{s['mean']:.4f} ± {s['std']:.4f}" if s["std"] is not None else f"{s['mean']:.4f}"
        rel = f"{(s['mean'] / base['mean'] - 1) * 100:+.2f}%" if s["mean"] is not None and base and base["mean"] else "-"
        v = verdicts.get(config)
        notes = [v["result"] + (f" ({v['reason']})" if "reason" in v else f" (allowed ±{v['allowed']:.4f})")] if v else []
        if v and v.get("paired"):
            paired = v["paired"]
            notes.append(f"paired by seed {paired['mean']:+.2%}" + (f" ± {paired['std']:.2%}" if paired["std"] is not None else "")
                         + f" over {len(paired['per_seed'])}")
        notes += [f"diverged {s['diverged']}"] * bool(s["diverged"]) + [f"incomplete {s['incomplete']}"] * bool(s["incomplete"])
        print(f"{config:<24}{s['label']:>5}{len(s['seeds']):>7}{mean:>30}{rel:>9}  {'; '.join(notes)}")
        if "hazard" in s:
            h = s["hazard"]
            print(f"{'':<29}8-bit states vs fp32 shadow ({h['measurements']} measurements): update > 5x the shadow's in "
                  f"{h['mean']['over_5x']:.2e} of elements ({h['mean']['over_5x_above_1']:.2e} also > 1), damped < 1/5 in "
                  f"{h['mean']['damped_5x']:.2e}, second moment below the 8-bit range in {h['mean']['floored']:.2e}; "
                  f"largest {h['max']['max_quantized']:.3g} (shadow {h['max']['max_shadow']:.3g})")


def plot(summary, path, title):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_held, ax_paired) = plt.subplots(1, 3, figsize=(19, 4.5))
    base = summary.get(BASELINE) or {}
    for config, s in summary.items():
        if not s["seeds"]:
            continue
        label = f"({s['label']}) {config}, {len(s['seeds'])} seed(s)"
        train = s["train_curve"]
        k = max(1, len(train["mean"]) // 50)
        smooth = lambda xs: [statistics.mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]  # noqa: E731
        mean, std = smooth(train["mean"]), smooth(train["std"])
        steps = range(1, len(mean) + 1)
        line, = ax_train.plot(steps, mean, lw=1, label=label)
        ax_train.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                              color=line.get_color(), alpha=0.2)
        held = s["heldout_curve"]
        ax_held.plot(held["steps"], held["mean"], marker="o", ms=3, color=line.get_color(), label=label)
        ax_held.fill_between(held["steps"], [m - d for m, d in zip(held["mean"], held["std"])],
                             [m + d for m, d in zip(held["mean"], held["std"])], color=line.get_color(), alpha=0.2)
        # each seed against (a)'s run of the same seed: what the seeds' spread hides
        paired = [[100 * r for r in curve] for curve in relative_to_base(s, base).values()]
        if paired and config != BASELINE:
            curve = _curve(paired)
            ax_paired.plot(held["steps"], curve["mean"], marker="o", ms=3, color=line.get_color(), label=label)
            ax_paired.fill_between(held["steps"], [m - d for m, d in zip(curve["mean"], curve["std"])],
                                   [m + d for m, d in zip(curve["mean"], curve["std"])], color=line.get_color(), alpha=0.2)
    ax_train.set(title=f"training loss (running mean over {k} steps; band: ± 1 std over seeds)", xlabel="step",
                 ylabel="loss (nats/byte)")
    ax_held.set(title="held-out loss (mean ± 1 std over seeds)", xlabel="step", ylabel="loss (nats/byte)")
    ax_paired.axhline(0, color="black", lw=0.8)
    ax_paired.set(title="held-out loss vs (a) of the same seed (mean ± 1 std)", xlabel="step", ylabel="%")
    for ax in (ax_train, ax_held, ax_paired):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def aggregate(sources, out=None, plot_path=None, orchestration=None):
    """The summary and verdict of the runs in ``sources`` (runs folders or combined JSONs); the
    combined JSON to ``out``, the curves to ``plot_path``."""
    runs, noted = load_all(sources)
    if not runs:
        raise SystemExit(f"no runs in {sources}")
    summary = summarize(runs)
    verdicts = verdict(summary)
    infos = [r["info"] for r in runs.values()]
    if len({i["corpus"]["sha256"] for i in infos}) > 1:
        print("warning: the runs saw different corpora (sha256 differs): they are not comparable")
    combined = dict(info=infos[0], summary=summary, verdict=verdicts, orchestration=orchestration or noted, runs=runs)
    print_summary(summary, verdicts)
    if out:
        write_json(combined, out)
        print(f"wrote {out}")
    if plot_path:
        info, corpus = infos[0], infos[0]["corpus"]
        plot(summary, plot_path, f"{info['model']['num_params'] / 1e6:.1f}M parameters, {info['protocol']['steps']} steps, "
                                 f"{info['device']}, corpus {corpus['bytes'] / 1e6:.0f} MB ({corpus['files']} files)")
    return combined


# ------------------------------------------------------------------------------------------ main


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    train_gpt.add_model_arguments(parser, "124m")
    parser.set_defaults(grad_clip=1.0)
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS), help=f"comma list of {', '.join(CONFIGURATIONS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--pairs", nargs="+", metavar="CONFIG:SEED",
                        help="run these (configuration, seed) pairs, in this order, instead of --configs x --seeds")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup-steps", type=int, default=150, help="linear lr warm-up")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decay ends at this fraction of --lr")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-batches", type=int, default=64)
    parser.add_argument("--heldout-fraction", type=float, default=0.02, help="of the files")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--hazard-every", type=int, default=50, help="steps between hazard measurements (0: none)")
    parser.add_argument("--hazard-configs", default="flashoptim", help="comma list of the runs that measure it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-inductor", action="store_true", help="no Inductor: as train_gpt.py --no-inductor")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--deadline-s", type=float, help="start no run that would end later; stop the rest then")
    parser.add_argument("--runs-dir", default="quality_runs", help="each run's JSON and log")
    parser.add_argument("--out", default="quality.json", help="every run and the summary, one JSON")
    parser.add_argument("--plot", help="PNG of the loss curves")
    parser.add_argument("--aggregate", metavar="PATH", nargs="+",
                        help="only aggregate the runs in these runs folders or --out JSONs (e.g. of two device calls)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one run in this process (how run_all starts each)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    args.hazard_configs = args.hazard_configs.split(",")
    if args.pairs:
        if not all(p.count(":") == 1 and p.partition(":")[2].isdigit() for p in args.pairs):
            parser.error(f"--pairs takes CONFIG:SEED items, e.g. flashoptim_fp8:2; got {args.pairs}")
        args.pairs = [(config, int(seed)) for config, _, seed in (p.partition(":") for p in args.pairs)]
    unknown = sorted(set(args.configs + args.hazard_configs + [c for c, _ in args.pairs or []]) - set(CONFIGURATIONS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if not 0 < args.heldout_fraction < 1:
        parser.error(f"--heldout-fraction must be between 0 and 1, got {args.heldout_fraction}")
    train_gpt.resolve_model_arguments(parser, args)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.aggregate:
        return aggregate(args.aggregate, args.out, args.plot)
    if args.run:
        return run_one(args)
    orchestration = run_all(args, argv)
    return aggregate([args.runs_dir], args.out, args.plot, orchestration)


if __name__ == "__main__":
    main()
