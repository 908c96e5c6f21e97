"""The torch sampler and decoding transform against the Rust ones."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcouple

torch = pytest.importorskip("torch")

from kvcouple.errors import InvalidInputError  # noqa: E402
from kvcouple.torch_coupling import apply_decoding, couple_torch  # noqa: E402

pytestmark = pytest.mark.torch


def _rows(rng: np.random.Generator, rows: int, vocab: int, kind: str) -> np.ndarray:
    """Probability rows of a given flavour: dense, sparse, one-hot or with exact ties."""
    if kind == "onehot":
        out = np.zeros((rows, vocab))
        out[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0
        return out
    x = rng.dirichlet(np.full(vocab, 0.3), size=rows)
    if kind == "sparse":
        x[rng.random(x.shape) < 0.6] = 0.0
        x[:, rng.integers(0, vocab)] += 1e-3
    elif kind == "ties":
        x = np.round(x * 8) + 1.0
    return x / x.sum(axis=1, keepdims=True)


def _compare(p: np.ndarray, q: np.ndarray, u: np.ndarray) -> None:
    x_r, y_r, d_r = kvcouple.couple(p, q, u)
    x_t, y_t, d_t = couple_torch(torch.from_numpy(p), torch.from_numpy(q), torch.from_numpy(u))
    np.testing.assert_array_equal(x_t.numpy(), x_r)
    np.testing.assert_array_equal(y_t.numpy(), y_r)
    np.testing.assert_array_equal(d_t.numpy(), d_r)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("kind", ["dense", "sparse", "onehot", "ties"])
def test_same_tokens_as_rust(seed, kind):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 300))
    p = _rows(rng, 64, vocab, kind)
    q = _rows(rng, 64, vocab, kind)
    # Mix in identical rows and rows with disjoint supports.
    q[:8] = p[:8]
    p[8:12] = 0.0
    p[8:12, 0] = 1.0
    q[8:12] = 0.0
    q[8:12, vocab - 1] = 1.0
    u = rng.random((64, 3))
    u[12:16] = 0.0  # boundary uniforms
    u[16:20] = np.nextafter(1.0, 0.0)
    _compare(p, q, u)


@given(
    st.integers(2, 40).flatmap(
        lambda v: st.tuples(
            st.lists(st.floats(0, 10), min_size=v, max_size=v),
            st.lists(st.floats(0, 10), min_size=v, max_size=v),
            st.tuples(st.floats(0, 0.999999), st.floats(0, 0.999999), st.floats(0, 0.999999)),
        )
    )
)
def test_same_tokens_as_rust_hypothesis(args):
    p, q, u = (np.asarray(a, dtype=np.float64) for a in args)
    if p.sum() <= 0 or q.sum() <= 0:
        return
    p, q = p / p.sum(), q / q.sum()
    _compare(p[None], q[None], u[None])


def test_identical_rows_never_diverge_and_disjoint_always_do():
    rng = np.random.default_rng(1)
    p = torch.from_numpy(_rows(rng, 500, 50, "dense"))
    u = torch.from_numpy(rng.random((500, 3)))
    x, y, d = couple_torch(p, p, u)
    assert not d.any() and bool((x == y).all())
    a = torch.zeros(3, 4, dtype=torch.float64)
    a[:, :2] = 0.5
    b = torch.zeros(3, 4, dtype=torch.float64)
    b[:, 2:] = 0.5
    x, y, d = couple_torch(a, b, torch.rand(3, 3, dtype=torch.float64))
    assert d.all() and bool((x < 2).all()) and bool((y >= 2).all())


def test_float32_inputs_and_bad_input():
    p = torch.tensor([[0.25, 0.75]], dtype=torch.float32)
    x, y, d = couple_torch(p, p, torch.tensor([[0.5, 0.1, 0.9]]))
    assert int(x) == 0 and int(y) == 0 and not bool(d)
    with pytest.raises(InvalidInputError, match="row 0"):
        couple_torch(p, p, torch.tensor([[1.0, 0.1, 0.1]]))
    with pytest.raises(InvalidInputError, match="not 1 within"):
        couple_torch(p * 2, p, torch.tensor([[0.5, 0.1, 0.1]]))
    with pytest.raises(ValueError, match="shape"):
        couple_torch(p, p, torch.tensor([[0.5, 0.1]]))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(
    "transform",
    [
        {},
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.9},
        {"temperature": 1.3, "top_k": 20, "top_p": 0.8},
        {"top_k": 1},
        {"top_p": 0.3},
    ],
)
def test_decoding_transform_matches_rust(seed, transform):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 200))
    a = rng.normal(size=(16, vocab)) * 3
    b = rng.normal(size=(16, vocab)) * 3
    a[:4] = np.round(a[:4])  # ties at the top-k cut
    pa = apply_decoding(torch.from_numpy(a), **transform).numpy()
    pb = apply_decoding(torch.from_numpy(b), **transform).numpy()
    np.testing.assert_allclose(pa.sum(axis=1), 1.0, atol=1e-12)
    rust = kvcouple.divergences(a, b, logits=True, **transform).as_dict()
    mine = kvcouple.divergences(pa, pb).as_dict()
    for name, value in rust.items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-9, atol=1e-10, err_msg=name)


def test_decoding_transform_rules():
    # Ties at the top-k cut are kept.
    p = apply_decoding(torch.tensor([[1.0, 3.0, 2.0, 2.0]]), top_k=2)[0]
    assert p[0] == 0 and bool((p[1:] > 0).all())
    # top-p keeps entries whose preceding mass is < top_p.
    logits = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64).log()
    p = apply_decoding(logits, top_p=0.6)[0]
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0], dtype=torch.float64))
    assert apply_decoding(logits, top_p=0.5)[0].tolist() == [1.0, 0.0, 0.0]
    # Masked logits stay masked; bf16 input is widened.
    p = apply_decoding(torch.tensor([[0.0, float("-inf"), 0.0]], dtype=torch.bfloat16))[0]
    assert p.dtype == torch.float64 and p.tolist() == [0.5, 0.0, 0.5]
    for bad in [{"temperature": 0.0}, {"top_k": 0}, {"top_p": 1.5}]:
        with pytest.raises(ValueError):
            apply_decoding(logits, **bad)
