"""Hugging Face ``Trainer`` drives a prepared model and optimizer (issue 14): a tiny GPT-2 built from
a config, ``prepare(model, opt)``, then ``Trainer(optimizers=(opt, scheduler))`` trains, saves
checkpoints with its own ``save_steps`` (``optimizer.pt`` from ``opt.state_dict()``, the bf16 model
as safetensors) and resumes from one with ``resume_from_checkpoint``. The resumed run matches the
uninterrupted one bit for bit: weights, error terms, 8-bit codes and scales, step counts, lr,
losses and gradient norms. Skipped without ``transformers`` and ``accelerate`` (``pip install -e
".[clients]"``)."""

import pytest
import torch

import flash_inductor
from helpers import EAGER, decisions_of, snapshot

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

STEPS, SAVE_STEPS, WARMUP = 6, 3, 2


class Snapshots(transformers.TrainerCallback):
    """Every stored tensor after each optimizer step, by global step."""

    def __init__(self, model, opt):
        self.model, self.opt, self.after = model, opt, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = snapshot(self.model, self.opt)


def _dataset():
    ids = torch.randint(0, 1000, (32, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _train(output_dir, seed, resume_from_checkpoint=None, batch=4, accumulate=1, prepared=True, model_options=None,
           torch_compile=False):
    """A fresh GPT-2 (initialized from ``seed``), prepared (or left fp32), trained by a Trainer for
    STEPS steps of ``accumulate`` batches of ``batch``; with ``model_options``, the model compiled in
    place through the backend with them; with ``torch_compile``, compiled by Trainer itself
    (``TrainingArguments(torch_compile=True)``). The snapshots after each step, the logs by step, and
    the model Trainer ran."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if prepared:
        flash_inductor.prepare(model, opt, compile_options=EAGER)
    if model_options is not None:
        model.compile(backend="flashoptim", options=model_options)
    # Linear warmup from lr 0, the schedule Trainer itself makes with warmup_steps.
    schedule = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, save_steps=SAVE_STEPS, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate, torch_compile=torch_compile,
        logging_steps=1, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
    )
    snapshots = Snapshots(model, opt)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset(), optimizers=(opt, schedule),
                                   callbacks=[snapshots])
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    return snapshots.after, logs, trainer.model_wrapped


def _differ(a, b):
    assert a.keys() == b.keys()
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def test_trainer_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    straight, straight_logs, _ = _train(tmp_path / "straight", seed=0)
    checkpoint = tmp_path / "straight" / f"checkpoint-{SAVE_STEPS}"
    assert {"optimizer.pt", "scheduler.pt", "model.safetensors"} <= {p.name for p in checkpoint.iterdir()}
    # It trained: after the first step (at lr 0) every stored tensor moved, and none holds a nan.
    first, last = straight[1], straight[STEPS]
    assert straight_logs[1]["learning_rate"] == 0 and not any(torch.equal(first[k], last[k]) for k in last)
    assert all(torch.isfinite(v).all() for v in last.values() if v.is_floating_point())
    torch._dynamo.reset()

    # As a new process would: other initial weights, a new prepared optimizer, a new Trainer.
    resumed, resumed_logs, _ = _train(tmp_path / "resumed", seed=1, resume_from_checkpoint=str(checkpoint))
    assert sorted(resumed) == list(range(SAVE_STEPS + 1, STEPS + 1))
    for step in resumed:
        assert not _differ(straight[step], resumed[step]), step
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed_logs[step][key] == straight_logs[step][key], (step, key)


def test_trainer_accumulating_gradients_follows_the_stock_fp32_trainer(tmp_path):
    """``gradient_accumulation_steps=2``: accelerate lets the prepared optimizer step every second
    batch, on the gradients summed in its bf16 buffer. Its losses and gradient norms follow the stock
    fp32 model's and AdamW's under the same Trainer within bf16's rounding (measured: 0.003% and
    0.3% at most), and each step counts once."""
    prepared, prepared_logs, _ = _train(tmp_path / "prepared", seed=0, batch=2, accumulate=2)
    torch._dynamo.reset()
    _, stock_logs, _ = _train(tmp_path / "stock", seed=0, batch=2, accumulate=2, prepared=False)
    steps = [v for k, v in prepared[STEPS].items() if k.endswith(".step")]
    assert steps and all(v.item() == STEPS for v in steps)  # one optimizer step per two batches
    for step in range(1, STEPS + 1):
        for key, tolerance in (("loss", 0.002), ("grad_norm", 0.01)):
            assert abs(prepared_logs[step][key] - stock_logs[step][key]) <= tolerance * stock_logs[step][key], (step, key)


def test_trainer_trains_a_model_compiled_in_place_with_fp8_linears(tmp_path):
    """A Trainer user's way to FP8: ``model.compile(backend="flashoptim", options={"fp8": ...})``
    compiles the model in place, keeping its class and ``forward``'s signature (an ``OptimizedModule``
    from ``torch.compile(model)`` hides it, and Trainer then drops every column of the dataset as
    unused). The model's graphs run after the passes by aten's kernels (``compiler="eager"``: the
    Trainer integration is what is tested, not Inductor's code). Every GPT-2 ``Conv1D`` projection
    multiplies in FP8 (the pass's decisions), and the losses follow the stock fp32 model's and
    AdamW's under the same Trainer within FP8's rounding (measured: 0.023% at most, ten times bf16's
    0.002% without FP8)."""
    report = flash_inductor.inspection.Report()
    with flash_inductor.inspection.collecting(report):
        _, fp8_logs, _ = _train(tmp_path / "fp8", seed=0, model_options={**EAGER, "fp8": "tensorwise",
                                                                       "fp8_min_weight_numel": 0})
    decisions = decisions_of(report)
    projections = [f"transformer.h.{i}.{name}.weight" for i in range(2)
                   for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert all(decisions[name].startswith("fp8") for name in projections), decisions
    torch._dynamo.reset()
    _, stock_logs, _ = _train(tmp_path / "stock", seed=0, prepared=False)
    for step in range(1, STEPS + 1):
        assert abs(fp8_logs[step]["loss"] - stock_logs[step]["loss"]) <= 0.001 * stock_logs[step]["loss"], step


def test_trainer_compiling_the_model_itself_trains_a_prepared_model_like_stock(tmp_path):
    """``TrainingArguments(torch_compile=True)``: accelerate compiles the prepared model with
    Inductor (``torch_compile_backend`` cannot name ours: accelerate accepts only its own list) and
    the prepared optimizer steps its flat buffers: every stored tensor moves, and the losses follow
    the stock fp32 model's and AdamW's under the same compiled Trainer within bf16's rounding
    (measured: 0.01% at most). Against an uncompiled Trainer they would differ by 0.2%: GPT-2's
    dropout draws other masks in Inductor's code."""
    after, compiled_logs, model = _train(tmp_path / "compiled", seed=0, torch_compile=True)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert not any(torch.equal(after[1][k], after[STEPS][k]) for k in after[STEPS])
    torch._dynamo.reset()
    _, stock_logs, _ = _train(tmp_path / "stock", seed=0, prepared=False, torch_compile=True)
    for step in range(1, STEPS + 1):
        assert abs(compiled_logs[step]["loss"] - stock_logs[step]["loss"]) <= 0.001 * stock_logs[step]["loss"], step
