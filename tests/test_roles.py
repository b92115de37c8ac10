"""Roles: the backend finds parameters, gradients and states among Dynamo's graph inputs by
tensor identity, whatever names and node kinds (placeholder / get_attr) Dynamo used."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flash_inductor
from flash_inductor import flat, roles


def _capture_roles(fn, *args):
    seen = []

    def backend(gm, example_inputs):
        found = roles.find_roles(gm, example_inputs)
        written = roles.mutated_inputs(gm.graph)
        seen.append(sorted((r.describe(), name in written) for name, r in found.items()))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return seen


def _model_and_optimizer(make_optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = make_optimizer(model.parameters())
    flash_inductor.prepare(model, opt, min_quantized_numel=0, compile_options={"compiler": "eager"})
    return model, opt


PARAMS = ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_step_roles(foreach):
    model, opt = _model_and_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=foreach))
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    (step_roles,) = _capture_roles(flat.step_buckets, [b.optimizer for b in flat.collect_gradients(roles.PREPARED[opt])])
    # The step runs on the one flat bucket of the four parameters (flash_inductor/flat.py); the
    # group's lr tensor is read, not written.
    bucket = "group0_bfloat16_8bit"
    expected = [("hyperparameter:lr", False), (f"param:{bucket}", True), (f"grad:{bucket}", False),
                (f"state:{bucket}[step]", True), (f"state:{bucket}[exp_avg]", True), (f"state:{bucket}[exp_avg_sq]", True)]
    assert step_roles == sorted(expected)


@pytest.mark.parametrize("foreach", [False, True])
def test_sgd_roles_inside_a_whole_train_step(foreach):
    model, opt = _model_and_optimizer(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=foreach))

    def train_step(x, y):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    graphs = _capture_roles(train_step, torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 2))
    forward = [g for g in graphs if all(not w for _, w in g) and g]
    # The forward reads every parameter; the optimizer step is not traced into the train step's
    # graphs: it runs its own compiled flat step (flash_inductor/steps.py), captured here.
    assert forward == [sorted((f"param:{n}", False) for n in PARAMS)]
    assert not [g for g in graphs if any(w for _, w in g)]
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    step = _capture_roles(flat.step_buckets, [b.optimizer for b in flat.collect_gradients(roles.PREPARED[opt])])
    bucket = "group0_bfloat16_8bit"
    expected = [("hyperparameter:lr", False), (f"param:{bucket}", True), (f"grad:{bucket}", False),
                (f"state:{bucket}[momentum_buffer]", True)]
    assert step == [sorted(expected)]


def test_unprepared_optimizers_have_no_roles():
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    assert _capture_roles(opt.step) == [[]]

