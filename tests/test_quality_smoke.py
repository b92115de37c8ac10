"""Smoke test of benchmarks/quality.py (issue 15): the protocol at a tiny size on the CPU.

Two seeds of (a) fp32 masters and (c) flashoptim, ten steps each, every run its own process (two at
once), without Inductor (the eager model; flashoptim's step as the rewritten graph op by op):
the losses decrease, the schedule is the one written, the aggregate and verdict run, the hazard
probe measures and does not change the run it watches. The thresholds of issue 15 apply to the H200
runs only (docs/benchmarks.md). About 40 s on 2 cores, most of it starting processes.
"""

import hashlib
import importlib.util
import json
import math
import os
import pathlib
import signal
import statistics
import sys
import threading
import time

import pytest
import torch

import flash_inductor
from flash_inductor import roles

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--config", "tiny", "--layers", "1", "--dim", "64", "--heads", "4", "--seq", "32", "--batch", "4",
        "--steps", "10", "--warmup-steps", "2", "--eval-every", "5", "--eval-batches", "2", "--no-inductor",
        "--device", "cpu"]
PEAK_LR = 3e-3  # the tiny size's


@pytest.fixture(scope="module")
def quality():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))  # quality.py imports train_gpt from beside it
        import quality

        yield quality


@pytest.fixture(scope="module")
def protocol_run(quality, tmp_path_factory):
    """The orchestrated runs: two seeds of (a) and (c), two at a time; the hazard probe on (c)."""
    folder = tmp_path_factory.mktemp("quality")
    argv = [*TINY, "--seeds", "0", "1", "--configs", "fp32_fused_autocast,flashoptim", "--jobs", "2",
            "--hazard-every", "3", "--runs-dir", str(folder / "runs"), "--out", str(folder / "quality.json"),
            "--plot", str(folder / "quality.png")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two runs on two cores
        quality.main(argv)
    return folder, json.loads((folder / "quality.json").read_text())


def test_every_run_trains_on_the_schedule_and_the_loss_decreases(protocol_run):
    folder, combined = protocol_run
    assert sorted(combined["runs"]) == ["flashoptim_seed0", "flashoptim_seed1", "fp32_fused_autocast_seed0",
                                        "fp32_fused_autocast_seed1"]
    for key, run in combined["runs"].items():
        assert json.loads((folder / "runs" / f"{key}.json").read_text()) == run  # the run's own file, complete
        assert run["complete"] and len(run["train_loss"]) == 10, key
        assert all(math.isfinite(x) for x in run["train_loss"]), key
        assert statistics.mean(run["train_loss"][-3:]) < statistics.mean(run["train_loss"][:3]), key
        assert [e["step"] for e in run["heldout"]] == [0, 5, 10], key
        assert run["heldout"][-1]["loss"] < run["heldout"][0]["loss"], key
        # linear warm-up over 2 steps, then cosine to 10% of the peak at the last step (step 9)
        want = [PEAK_LR * (i + 1) / 2 if i < 2 else PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * (i - 2) / 7)))
                for i in range(10)]
        assert run["lr"] == pytest.approx(want, rel=1e-6), key
        assert run["info"]["protocol"]["grad_clip"] == 1.0
    # seed = initial weights and batch order: the seeds' first losses differ, the configurations' agree
    runs = combined["runs"]
    assert runs["flashoptim_seed0"]["heldout"][0] != runs["flashoptim_seed1"]["heldout"][0]
    assert runs["flashoptim_seed0"]["heldout"][0]["loss"] == pytest.approx(
        runs["fp32_fused_autocast_seed0"]["heldout"][0]["loss"], rel=0.01)
    events = [(e["event"], e["config"], e["seed"]) for e in combined["orchestration"]["events"]]
    assert [e for e in events if e[0] == "started"] == [  # seed-major
        ("started", "fp32_fused_autocast", 0), ("started", "flashoptim", 0),
        ("started", "fp32_fused_autocast", 1), ("started", "flashoptim", 1)]
    assert sum(e[0] == "done" for e in events) == 4


def test_aggregate_summary_and_verdict(protocol_run, quality):
    folder, combined = protocol_run
    for config in ("fp32_fused_autocast", "flashoptim"):
        entry = combined["summary"][config]
        finals = [combined["runs"][f"{config}_seed{s}"]["heldout"][-1]["loss"] for s in (0, 1)]
        assert entry["seeds"] == [0, 1] and entry["final_heldout"] == finals
        assert entry["mean"] == pytest.approx(sum(finals) / 2)
        assert entry["std"] == pytest.approx(abs(finals[0] - finals[1]) / math.sqrt(2))
        assert entry["heldout_curve"]["steps"] == [0, 5, 10] and len(entry["train_curve"]["mean"]) == 10
    assert combined["verdict"]["flashoptim"]["result"] == "not enough seeds"
    finals = {config: [combined["runs"][f"{config}_seed{s}"]["heldout"][-1]["loss"] for s in (0, 1)]
              for config in ("fp32_fused_autocast", "flashoptim")}
    paired = combined["verdict"]["flashoptim"]["paired"]["per_seed"]
    assert paired == pytest.approx({str(s): finals["flashoptim"][s] / finals["fp32_fused_autocast"][s] - 1 for s in (0, 1)})
    assert combined["info"]["corpus"]["files"] > 1000
    if importlib.util.find_spec("matplotlib"):
        assert (folder / "quality.png").stat().st_size > 10_000
    # again from the combined JSON (how the H200 result is turned into the docs' plot)
    again = quality.aggregate([folder / "quality.json"])
    assert again["summary"] == combined["summary"] and again["verdict"] == combined["verdict"]


def test_hazard_probe_measures_and_leaves_the_run_unchanged(protocol_run, quality, tmp_path, fresh_dynamo):
    _, combined = protocol_run
    watched = combined["runs"]["flashoptim_seed0"]
    hazard = watched["hazard"]
    assert [r["step"] for r in hazard["records"]] == [3, 6, 9]
    train_gpt = sys.modules["train_gpt"]
    eight_bit = {n for n, p in train_gpt.GPT(train_gpt.GPTConfig(1, 64, 4, 32)).named_parameters() if p.numel() >= 4096}
    assert set(hazard["numel"]) == eight_bit
    for record in hazard["records"]:
        assert set(record["tensors"]) == eight_bit
        for values in record["tensors"].values():
            assert 0 <= values["over_5x_above_1"] <= values["over_5x"] <= 1 and 0 <= values["damped_5x"] <= 1
            assert 0 <= values["floored"] <= 1
            assert 0 < values["max_shadow"] < 2 and 0.5 < values["mean_ratio"] < 2
    assert combined["summary"]["flashoptim"]["hazard"]["measurements"] == 6
    assert "hazard" not in combined["runs"]["fp32_fused_autocast_seed0"]

    # the same run without the probe, in this process (one thread, as the runs above): the same bits
    args = quality.parse_args([*TINY, "--hazard-every", "0", "--runs-dir", str(tmp_path), "--run", "flashoptim",
                               "--seed", "0"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        quality.run_one(args)
    finally:
        torch.set_num_threads(threads)
    plain = json.loads((tmp_path / "flashoptim_seed0.json").read_text())
    assert "hazard" not in plain
    assert plain["train_loss"] == watched["train_loss"] and plain["heldout"] == watched["heldout"]


def test_corpus_is_every_python_file_split_by_file(quality):
    roots, sources = quality.python_sources()
    corpus = quality.load_python_corpus(0.02)
    info = corpus.info
    assert any(path == "json/decoder.py" for _, path in sources)  # the standard library ...
    assert any(path == "torch/__init__.py" for _, path in sources)  # ... and site-packages
    assert info["files"] == len(sources) == info["train_files"] + info["heldout_files"]
    assert len(corpus.train) == info["train_tokens"] and len(corpus.heldout) == info["heldout_tokens"]
    # the split, recomputed: the first 8 bytes of sha256(path inside its root) below 2% of 2**64
    heldout = [(root, path) for root, path in sources
               if int(hashlib.sha256(path.encode()).hexdigest()[:16], 16) < 0.02 * 2**64]
    assert len(heldout) == info["heldout_files"] and 0.01 < len(heldout) / len(sources) < 0.03
    assert info["heldout_tokens"] == sum(os.path.getsize(os.path.join(root, path)) for root, path in heldout)
    first = pathlib.Path(*heldout[0]).read_bytes()
    assert corpus.heldout[: len(first)].numpy().tobytes() == first


def _run(config, seed, final, steps=10):
    """A finished run (or, with fewer held-out steps, one whose loss became non-finite) for the aggregate."""
    heldout = [dict(step=0, loss=5.0), dict(step=steps, loss=final)]
    return dict(config=config, seed=seed, complete=True, info=dict(protocol=dict(steps=10)), heldout=heldout,
                train_loss=[5.0] * 10)


@pytest.mark.parametrize("case", range(40))
def test_verdict_is_issue_15s_rule(quality, case):
    gen = torch.Generator().manual_seed(case)
    finals = lambda center, spread, n: (center + spread * torch.randn(n, generator=gen, dtype=torch.float64)).tolist()  # noqa: E731
    a = finals(1.6, 0.01, 3)
    c = finals(1.6 + 0.02 * torch.rand(1, generator=gen).item() - 0.01, 0.01, 3)
    d = finals(1.6 + 0.05 * torch.rand(1, generator=gen).item() - 0.025, 0.01, 3 if case % 5 else 2)
    runs = {f"{name}_seed{i}": _run(name, i, x) for name, values in
            (("fp32_fused_autocast", a), ("flashoptim", c), ("flashoptim_fp8", d)) for i, x in enumerate(values)}
    verdicts = quality.verdict(quality.summarize(runs))
    mean_a, std_a = sum(a) / 3, math.sqrt(sum((x - sum(a) / 3) ** 2 for x in a) / 2)
    for name, values, tolerance in (("flashoptim", c, 0.005), ("flashoptim_fp8", d, 0.015)):
        if len(values) < 3:
            assert verdicts[name]["result"] == "not enough seeds"
            continue
        passes = abs(sum(values) / 3 - mean_a) <= max(tolerance * mean_a, 2 * std_a)
        assert verdicts[name]["result"] == ("pass" if passes else "fail"), (name, values, a)


def test_a_non_finite_seed_fails_its_configuration(quality):
    runs = {f"{name}_seed{i}": _run(name, i, 1.6 + 0.001 * i) for name in ("fp32_fused_autocast", "flashoptim")
            for i in range(3)}
    runs["flashoptim_seed1"] = _run("flashoptim", 1, 1.7, steps=5)  # stopped at step 5: non-finite loss
    summary = quality.summarize(runs)
    assert summary["flashoptim"]["seeds"] == [0, 2] and summary["flashoptim"]["diverged"] == [1]
    assert quality.verdict(summary)["flashoptim"]["result"] == "fail"


def _alive(pid):
    """Running (a zombie left to a parent that does not reap it counts as ended)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("stop", ["deadline", "SIGTERM"])
def test_deadline_or_sigterm_stops_runs_and_starts_no_more(quality, tmp_path, monkeypatch, stop):
    """Runs replaced by a process that starts a worker of its own and sleeps: at the deadline (or at
    a SIGTERM, as an outer ``timeout`` sends) both are ended (the run's process group), and the next
    run is not started."""
    pids = tmp_path / "pids"
    script = ("import os, subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
              f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{w.pid}}\\n'); time.sleep(60)")
    monkeypatch.setattr(quality, "child_command", lambda argv, config, seed: [sys.executable, "-c", script])
    deadline = ["--deadline-s", "4"] if stop == "deadline" else []
    args = quality.parse_args([*TINY, "--pairs", "flashoptim:0", "flashoptim:1", *deadline, "--runs-dir", str(tmp_path)])
    handler = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(4, os.kill, (os.getpid(), signal.SIGTERM))
    if stop == "SIGTERM":
        timer.start()
    try:
        notes = quality.run_all(args, [])
    finally:
        timer.cancel()  # never after run_all gave the handler back
    assert [(e["event"], e["seed"]) for e in notes["events"]] == [
        ("started", 0), (f"stopped at {'the deadline' if stop == 'deadline' else 'SIGTERM'}", 0), ("not started", 1)]
    assert notes["wall_s"] < 20
    for pid in map(int, pids.read_text().split()):
        for _ in range(50):  # a signalled process takes a moment to go
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid)
    assert signal.getsignal(signal.SIGTERM) == handler  # handed back


def test_estimates_come_from_finished_runs(quality):
    walls = [("flashoptim", 30.0), ("flashoptim", 40.0), ("fp32_fused_autocast", 20.0)]
    assert quality._estimate("flashoptim", walls) == 40.0 and quality._estimate("flashoptim_fp8", walls) == 40.0
    assert quality._estimate("flashoptim", []) == 0.0


def test_hazard_measures_of_one_tensor(quality):
    quantized = torch.tensor([1.0, 10.0, 0.1, 3.0] * 8)
    shadow = torch.tensor([1.0, 1.0, 1.0, 0.5] * 8)
    v = torch.ones(32)
    v[:4] = torch.tensor([1e-8, 0.0, (1 / 600) ** 2, (1 / 400) ** 2])  # sqrt(v): 1e-4 and 1/600 below 1/510 of 1
    got = quality.compare_updates(quantized, shadow, v)
    want = dict(over_5x=0.5, over_5x_above_1=0.5, damped_5x=0.25, floored=2 / 32, max_quantized=10.0, max_shadow=1.0,
                max_ratio=10.0, mean_ratio=14.1 / 3.5)
    assert got == pytest.approx(want, rel=1e-6)


def test_gradient_clipping_reaches_the_prepared_step(quality, fresh_dynamo):
    """The protocol clips inside the train step (``clip_grad_norm_`` between backward and step). On a
    prepared optimizer the step reads the gradients from flat buffers (train_step's are copied in at
    the step): the buffers must hold them clipped."""
    train_gpt = sys.modules["train_gpt"]
    torch.manual_seed(0)
    model = train_gpt.GPT(train_gpt.GPTConfig(1, 64, 4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = flash_inductor.train_step(train_gpt.make_step(model, opt, grad_clip=1e-3), model=model, optimizer=opt,
                                     compiler="eager")
    seen = []

    @torch.compiler.disable
    def after_step(optimizer, args, kwargs):
        grads = [p.grad for p in model.parameters()]
        flat = {b.grads.untyped_storage().data_ptr() for b in roles.PREPARED[optimizer].buckets}
        norm = torch.stack([g.double().norm() for g in grads]).norm().item()
        seen.append((norm, all(g.untyped_storage().data_ptr() in flat for g in grads)))

    opt.register_step_post_hook(after_step)  # before zero_grad: the gradients the step read
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        step(*torch.randint(0, 256, (2, 4, 32), generator=gen))
    assert len(seen) == 2
    for norm, in_flat_buffers in seen:
        assert in_flat_buffers and norm == pytest.approx(1e-3, rel=0.02)
