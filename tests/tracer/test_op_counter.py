"""kvcouple.testing.op_counter: ATen ops and host syncs, per region and per decoding step."""

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch  # -m "not torch" deselects the module

from kvcouple.testing.op_counter import count_ops, per_step  # noqa: E402


def test_each_kind_of_sync_is_counted_and_plain_ops_are_not():
    x = torch.arange(6.0)
    with count_ops() as c:
        y = x * 2 + 1  # two ops, no sync
        x.repeat_interleave(2)  # int repeats: static size
    assert c.syncs == 0 and c.ops >= 3
    cases = {
        "aten._local_scalar_dense": lambda: bool(y.sum() > 0),
        "aten.nonzero": lambda: torch.nonzero(x),
        "aten.index": lambda: x[x > 2],
        "aten.repeat_interleave": lambda: x.repeat_interleave(torch.full((6,), 2)),
        "Tensor.tolist": lambda: x.tolist(),
        "Tensor.cpu": lambda: x.cpu(),
    }
    for site, fn in cases.items():
        with count_ops() as c:
            fn()
        assert c.syncs == 1 and dict(c.sync_sites) == {site: 1}, (site, c.sync_sites)


def test_per_step_is_marginal_over_horizons():
    x = torch.ones(4)

    def run(horizon: int) -> None:
        x.sum().item()  # setup: one sync, once per run
        for _ in range(horizon):
            (x * 2).add_(1)  # two ops per step
            if horizon > 100:
                x.max().item()

    counts = per_step(run, (3, 7))
    assert counts.ops_per_step == 2
    assert counts.syncs_per_step == 0
    with pytest.raises(ValueError, match="0 < h1 < h2"):
        per_step(run, (5, 5))


def test_per_step_sees_a_sync_inside_the_loop():
    x = torch.ones(3)

    def run(horizon: int) -> None:
        for _ in range(horizon):
            if bool((x > 0).all()):
                x.mul_(1)

    counts = per_step(run, (2, 6))
    assert counts.syncs_per_step == 1
    assert counts.sync_sites_per_step == {"aten._local_scalar_dense": 1}
