"""Forward KL, reverse KL and generalised JSD between token distributions, against Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from raylign.algorithms import forward_kl_loss, generalized_jsd_loss, reverse_kl_loss

from .helpers import fill_masked


def softmax(row, temperature):
    exps = [math.exp(x / temperature) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def py_divergence(student, teacher, mask, fn, temperature=1.0):
    values = []
    for i in range(len(mask)):
        for j in range(len(mask[0])):
            if mask[i][j]:
                values.append(fn(softmax(student[i][j], temperature), softmax(teacher[i][j], temperature)))
    return sum(values) / len(values)


def py_jsd(beta):
    def fn(s, t):
        m = [beta * ti + (1 - beta) * si for si, ti in zip(s, t)]
        return beta * kl(t, m) + (1 - beta) * kl(s, m)

    return fn


def batch(seed=0):
    torch.manual_seed(seed)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    student = torch.randn(2, 3, 5, dtype=torch.float64)
    teacher = torch.randn(2, 3, 5, dtype=torch.float64) * 2
    return student, teacher, mask


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_forward_and_reverse_kl_match_python(temperature):
    student, teacher, mask = batch()
    args = (fill_masked(student, mask), fill_masked(teacher, mask), mask)
    forward, metrics = forward_kl_loss(*args, temperature=temperature)
    reverse, _ = reverse_kl_loss(*args, temperature=temperature)
    s, t, m = student.tolist(), teacher.tolist(), mask.tolist()
    assert forward.item() == pytest.approx(py_divergence(s, t, m, lambda p, q: kl(q, p), temperature))
    assert reverse.item() == pytest.approx(py_divergence(s, t, m, kl, temperature))
    assert metrics["divergence"].item() == pytest.approx(forward.item())


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_matches_python(beta):
    student, teacher, mask = batch(1)
    loss, _ = generalized_jsd_loss(fill_masked(student, mask), fill_masked(teacher, mask), mask, beta=beta)
    expected = py_divergence(student.tolist(), teacher.tolist(), mask.tolist(), py_jsd(beta))
    assert loss.item() == pytest.approx(expected)


def test_generalized_jsd_end_points_are_forward_and_reverse_kl():
    student, teacher, mask = batch(2)
    assert generalized_jsd_loss(student, teacher, mask, beta=0.0)[0].item() == pytest.approx(
        py_divergence(student.tolist(), teacher.tolist(), mask.tolist(), lambda p, q: kl(q, p))
    )
    assert generalized_jsd_loss(student, teacher, mask, beta=1.0)[0].item() == pytest.approx(
        py_divergence(student.tolist(), teacher.tolist(), mask.tolist(), kl)
    )


def test_identical_distributions_give_zero():
    student, _, mask = batch()
    for fn in (forward_kl_loss, reverse_kl_loss, generalized_jsd_loss):
        assert fn(student, student.clone(), mask)[0].item() == pytest.approx(0.0, abs=1e-12)


def test_neg_inf_teacher_logits_on_some_vocabulary_entries_are_handled():
    student = torch.zeros(1, 1, 3, dtype=torch.float64)
    teacher = torch.tensor([[[0.0, 0.0, float("-inf")]]], dtype=torch.float64)
    loss, _ = forward_kl_loss(student, teacher, torch.ones(1, 1))
    assert loss.item() == pytest.approx(kl([0.5, 0.5, 0.0], [1 / 3] * 3))


@pytest.mark.parametrize("name", ["forward", "reverse", "jsd"])
def test_gradcheck_distillation_losses_and_masked_garbage_gets_no_gradient(name):
    student, teacher, mask = batch(3)
    fn = {
        "forward": lambda s: forward_kl_loss(s, teacher, mask, temperature=1.5)[0],
        "reverse": lambda s: reverse_kl_loss(s, teacher, mask)[0],
        "jsd": lambda s: generalized_jsd_loss(s, teacher, mask, beta=0.3)[0],
    }[name]
    assert torch.autograd.gradcheck(fn, (student.requires_grad_(True),))
    garbage_student = fill_masked(student.detach(), mask).requires_grad_(True)
    fn(garbage_student).backward()
    assert torch.isfinite(garbage_student.grad).all()
    assert garbage_student.grad[mask == 0].abs().sum().item() == 0.0


def test_all_masked_gives_zero_and_bad_shapes_are_named():
    student, teacher, _ = batch()
    assert generalized_jsd_loss(student, teacher, torch.zeros(2, 3))[0].item() == 0.0
    with pytest.raises(ValueError, match="student_logits and teacher_logits"):
        forward_kl_loss(student, teacher[:, :2], torch.ones(2, 3))
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd_loss(student, teacher, torch.ones(2, 3), beta=1.5)
