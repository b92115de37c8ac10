"""Smoke test of benchmarks/train_gpt.py (issue 5): its main() in-process, tiny model, CPU.

One layer, batch 4 x 32, 6 steps: the compiles dominate (about 50 s with a cold Inductor cache on
a 2-core CPU, under 20 s warm).
"""

import json
import math

import pytest

from helpers import benchmark_module


@pytest.fixture(scope="module")
def train_gpt():
    return benchmark_module("train_gpt")


def test_corpus_is_the_standard_librarys_source(train_gpt):
    corpus = train_gpt.load_corpus()
    assert corpus.info["bytes"] > 10_000_000 and corpus.info["files"] > 500
    assert len(corpus.train) + len(corpus.heldout) == corpus.info["bytes"]
    assert abs(len(corpus.heldout) / corpus.info["bytes"] - 0.02) < 1e-3
    text = corpus.train[:2_000_000].numpy().tobytes()
    assert b"def " in text and b"import " in text
    assert b"def " in corpus.heldout.numpy().tobytes()


@pytest.mark.slow
def test_bf16_adamw_and_flashoptim_train_and_report(train_gpt, tmp_path, fresh_dynamo):
    out = tmp_path / "train_gpt.json"
    returned = train_gpt.main([
        "--config", "tiny", "--layers", "1", "--configs", "bf16_adamw,flashoptim", "--device", "cpu",
        "--steps", "6", "--batch", "4", "--seq", "32", "--warmup", "2", "--eval-every", "3",
        "--eval-batches", "2", "--out", str(out),
    ])
    results = json.loads(out.read_text())
    assert set(results["runs"]) == {"bf16_adamw", "flashoptim"} == set(returned["runs"])
    assert results["info"]["corpus"]["bytes"] > 10_000_000

    for name, run in results["runs"].items():
        assert len(run["train_loss"]) == 6 and all(math.isfinite(x) for x in run["train_loss"]), name
        assert [e["step"] for e in run["heldout"]] == [0, 3, 6], name
        assert all(math.isfinite(e["loss"]) for e in run["heldout"]), name
        assert run["median_step_s"] > 0 and run["tokens_per_s"] > 0 and run["first_step_s"] >= run["median_step_s"]
        assert run["peak_bytes"] is None and run["memory_bytes"]["activations"] is None  # CPU

    flash = results["runs"]["flashoptim"]
    losses = flash["train_loss"]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2
    assert flash["heldout"][-1]["loss"] < flash["heldout"][0]["loss"]

    # Bytes per parameter: every bf16 parameter (all but the LayerNorms) has an int8 error term;
    # 8-bit states + fp16 group scales (2.125 B) for quantized tensors, fp32 for small ones.
    flash_mem, bf16_mem = flash["memory_per_param"], results["runs"]["bf16_adamw"]["memory_per_param"]
    assert 0.95 < flash_mem["error_terms"] <= 1.0
    assert 2.0 < flash_mem["states"] + flash_mem["state_scales"] < bf16_mem["states"] == 4.0
    assert bf16_mem["error_terms"] == 0 and bf16_mem["weights"] == 2.0


def test_no_inductor_runs_the_same_configurations_eagerly(train_gpt, tmp_path, fresh_dynamo, monkeypatch):
    """--no-inductor (what --find-largest uses): no Inductor compile at all, the same stored formats."""
    import torch._inductor.compile_fx

    def no_inductor(*args, **kwargs):
        raise AssertionError("Inductor was called under --no-inductor")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", no_inductor)
    out = tmp_path / "train_gpt.json"
    train_gpt.main([
        "--config", "tiny", "--layers", "1", "--configs", "fp32_fused_autocast,flashoptim,flashoptim_release,flashoptim_fp8lm",
        "--device", "cpu", "--steps", "6", "--batch", "4", "--seq", "32", "--warmup", "2", "--eval-every", "6",
        "--eval-batches", "1", "--no-inductor", "--out", str(out),
    ])
    results = json.loads(out.read_text())
    assert results["info"]["no_inductor"] is True
    flash, release = results["runs"]["flashoptim"], results["runs"]["flashoptim_release"]
    assert flash["heldout"][-1]["loss"] < flash["heldout"][0]["loss"]
    assert 0.95 < flash["memory_per_param"]["error_terms"] <= 1.0
    # Gradient release applies the same updates (same batches and formats); memory_report counts
    # one gradient (the largest) instead of all of them.
    assert release["train_loss"] == flash["train_loss"]
    assert 0 < release["memory_per_param"]["grads"] < flash["memory_per_param"]["grads"]
    assert results["runs"]["fp32_fused_autocast"]["memory_per_param"]["states"] == 8.0
    # FP8-LM's states: e4m3 first and fp16 second moments (3 B) for the tensors large enough, fp32 for small ones
    fp8lm = results["runs"]["flashoptim_fp8lm"]
    assert fp8lm["heldout"][-1]["loss"] < fp8lm["heldout"][0]["loss"]
    assert flash["memory_per_param"]["states"] < fp8lm["memory_per_param"]["states"] < 8.0
    assert train_gpt.parse_args(["--config", "1b", "--device", "cuda", "--find-largest"]).no_inductor


def test_find_largest_refuses_without_a_gpu(train_gpt, capsys):
    with pytest.raises(SystemExit):
        train_gpt.main(["--config", "tiny", "--device", "cpu", "--find-largest"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("limit", [0, 5, 24, 37, 511, 512, 1000])
def test_find_largest_doubles_then_bisects(train_gpt, monkeypatch, limit):
    """The search logic with a stand-in for the GPU try: the largest depth that fits, capped."""
    tried = []

    def fake_try(name, cfg, corpus, args, device):
        tried.append(cfg.layers)
        return dict(layers=cfg.layers, fits=cfg.layers <= limit, num_params=cfg.layers, peak_bytes=0)

    monkeypatch.setattr(train_gpt, "try_depth", fake_try)
    args = train_gpt.parse_args(["--config", "1b", "--device", "cpu"])  # 24 layers to start
    result = train_gpt.find_largest("flashoptim", args.model, None, args, None)
    assert result["largest_layers"] == (min(limit, 512) or None)
    assert result["capped"] == (limit >= 512)
    assert len(tried) == len(set(tried)) <= 14


def test_plots_have_a_prefix_and_loss_curves_need_three_evaluations(train_gpt, tmp_path):
    pytest.importorskip("matplotlib")
    run = {"train_loss": [3.0, 2.5, 2.0], "heldout": [{"step": 0, "loss": 3.0}, {"step": 3, "loss": 2.0}],
           "peak_bytes": None, "memory_bytes": {"weights": 2**20, "error_terms": 2**19, "states": 2**20,
                                                "state_scales": 2**15, "grads": 2**20, "activations": None}}
    results = {"info": {"model": {"num_params": 10**6}, "device": "cpu"}, "runs": {"a": run, "b": run}}
    short = tmp_path / "short.json"
    short.write_text(json.dumps(results))
    train_gpt.plot_from([short], tmp_path, "short_")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["short_memory_breakdown.png"]

    run["heldout"].append({"step": 6, "loss": 1.5})
    long = tmp_path / "long.json"
    long.write_text(json.dumps(results))
    train_gpt.plot_from([long], tmp_path, "long_")
    assert sorted(p.name for p in tmp_path.glob("long_*.png")) == ["long_loss_curves.png", "long_memory_breakdown.png"]
