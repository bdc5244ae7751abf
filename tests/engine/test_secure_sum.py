"""Secure aggregation's fixed-point code (hetfl.engine.secure_sum) and its in-process simulation: the sum
within the stated quantisation error, clipping counted, Flower's quantiser reproducing the integers
exactly, the configuration checks, and the executors agreeing bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetfl import config
from hetfl.algorithms.base import without_feature_transforms
from hetfl.algorithms.posthoc import SummedReplies
from hetfl.engine import secure_sum as S
from hetfl.engine.experiment import Experiment
from hetfl.params import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["algorithm.name=fedavg+ccvr", "data.num_clients=4", "data.partition=dirichlet", "train.rounds=2",
         "train.batch_size=16", "train.local_steps=5", "algorithm.ccvr.epochs=1", "model.options={hidden = [16]}",
         "runtime.progress=false"]
TIME_KEYS = {"round_time_s", "eval_time_s"}


def replies_strategy():
    """(bound, clients' arrays of one shape, T): entries within and beyond the bound."""
    return st.tuples(
        st.sampled_from([1.0, 3.5, 6000.0, 6e5]),
        st.integers(1, 12),
        st.integers(1, 20),
        st.integers(0, 2**31 - 1),
    )


def test_the_grid_is_the_largest_power_of_two_whose_sum_over_the_clients_fits_the_modulus():
    assert S.quantization_range(10) == 2**28 and S.quantization_range(16) == 2**27
    assert S.quantization_range(1) == S.quantization_range(3) == 2**30  # flwr's int32 cast caps it
    assert S.quantization_range(4) == 2**29  # 4 * 2**30 = 2**32 would wrap
    for n in (1, 2, 5, 10, 17, 100, 1000, 123457):
        t = S.quantization_range(n)
        assert n * t < S.MODULUS_RANGE and t & (t - 1) == 0
        assert 2 * t > S.MAX_QUANTIZATION_RANGE or n * 2 * t >= S.MODULUS_RANGE


def test_too_few_or_too_many_clients_for_the_modulus_are_refused():
    with pytest.raises(ValueError, match="at least one client, not 0"):
        S.quantization_range(0)
    assert S.quantization_range(2**30) == 2  # 2**30 * 2 < 2**32: the coarsest grid that still fits
    with pytest.raises(ValueError, match=f"{2**31} clients do not fit a modulus of {2**32}"):
        S.quantization_range(2**31)
    assert S.quantization_range(3, modulus=2**10) == 2**8  # 3 * 2**8 < 2**10 <= 3 * 2**9


def test_the_grid_is_the_largest_power_of_two_that_fits_any_modulus():
    """The definition checked by brute force on small moduli, powers of two or not (n * T < M exactly at the edge:
    M = 9, n = 2 gives T = 4, as 2 * 4 = 8 < 9)."""
    for modulus in range(5, 300):
        for n in range(1, modulus // 2):
            want = max(t for t in (2**k for k in range(12)) if n * t < modulus)
            assert S.quantization_range(n, modulus) == want, (n, modulus)


@settings(max_examples=60, deadline=None)
@given(replies_strategy())
def test_the_decoded_sum_is_within_n_bound_over_t_of_the_sum_of_the_clipped_values(case):
    bound, n, size, seed = case
    gen = torch.Generator().manual_seed(seed)
    levels = S.quantization_range(max(n, 2))
    values = [bound * 1.3 * (2 * torch.rand(size, generator=gen, dtype=torch.float64) - 1) for _ in range(n)]
    encoded = [S.encode({"x": v}, {"x": bound}, levels) for v in values]
    for v, e in zip(values, encoded, strict=True):  # each client: within half a step (b / T) of its clipped value
        assert e.values["x"].dtype == torch.int64 and e.values["x"].min() >= 0 and e.values["x"].max() <= levels
        one = S.decode_sum(e.values, {"x": bound}, 1, levels)["x"]
        assert (one - v.clamp(-bound, bound)).abs().max() <= bound / levels * (1 + 1e-9)
        assert e.clipped == int((v.abs() > bound).sum())
    total = S.sum_encoded(encoded)
    decoded = S.decode_sum(total.values, {"x": bound}, n, levels)["x"]
    plain = sum(v.clamp(-bound, bound) for v in values)
    assert (decoded - plain).abs().max() <= n * bound / levels * (1 + 1e-9)
    assert total.clipped == sum(e.clipped for e in encoded)


def test_values_on_the_grid_round_trip_exactly_and_the_rounding_is_to_nearest():
    levels, bound = 2**10, 4.0
    j = torch.arange(levels + 1)
    on_grid = bound * (j.double() * 2 / levels - 1)
    e = S.encode({"x": on_grid}, {"x": bound}, levels)
    assert torch.equal(e.values["x"], j) and e.clipped == 0
    assert torch.equal(S.decode_sum(e.values, {"x": bound}, 1, levels)["x"], on_grid)
    step = 2 * bound / levels
    near = S.encode({"x": on_grid[1:-1] + 0.49 * step}, {"x": bound}, levels).values["x"]
    assert torch.equal(near, j[1:-1])  # less than half a step up: the same point (rounded, not floored)
    assert torch.equal(S.encode({"x": on_grid[1:-1] + 0.51 * step}, {"x": bound}, levels).values["x"], j[2:])


def test_a_float32_reply_is_encoded_in_float64_within_half_a_step():
    """The grid's resolution (2**28 steps for 10 clients) is finer than float32's: the code divides and scales in
    float64 whatever the reply's dtype, so a float32 reply's integers are those of its exact float64 values."""
    levels = S.quantization_range(10)
    v = (2 * torch.rand(1000, generator=torch.Generator().manual_seed(3)) - 1) * 7.0  # float32
    e = S.encode({"x": v}, {"x": 7.0}, levels)
    assert torch.equal(e.values["x"], S.encode({"x": v.double()}, {"x": 7.0}, levels).values["x"])
    one = S.decode_sum(e.values, {"x": 7.0}, 1, levels)["x"]
    assert (one - v.double()).abs().max() <= 7.0 / levels * (1 + 1e-9)


def test_entries_beyond_the_bound_and_nans_are_clipped_and_counted():
    e = S.encode({"a": torch.tensor([0.5, 2.0, -3.0, float("inf")]), "b": torch.tensor([float("nan"), 1.0])},
                 {"a": 1.0, "b": 1.0}, 2**8)
    assert e.clipped == 4
    assert e.values["a"].tolist() == [192, 256, 0, 256] and e.values["b"].tolist() == [128, 256]


@pytest.mark.parametrize("n", [2, 3, 10])
def test_flowers_own_quantiser_gives_back_the_integers_whatever_its_random_state(n):
    """flwr's quantize rounds stochastically from NumPy's global state: on hetfl's grid it has nothing to
    round. Its server's arithmetic (dequantize, offset, division by the summed weights) then gives an
    average from which from_grid_average recovers the integer sums exactly."""
    quantization = pytest.importorskip("flwr.common.secure_aggregation.quantization")
    levels = S.quantization_range(n)
    gen = torch.Generator().manual_seed(n)
    clients = [S.encode({"m": 5.0 * torch.randn(7, 3, generator=gen, dtype=torch.float64)}, {"m": 9.0}, levels)
               for _ in range(n)]
    clients[0] = S.encode({"m": torch.full((7, 3), 9.0, dtype=torch.float64)}, {"m": 9.0}, levels)  # j = T
    quantized = []
    for seed, e in enumerate(clients):
        np.random.seed(1000 + seed)
        floats = S.to_grid(e, levels)
        q = quantization.quantize(floats, S.CLIPPING_RANGE, levels)
        assert all(np.array_equal(a, b) for a, b in zip(q, [*[t.numpy() for t in e.values.values()],
                                                              np.array([e.clipped])], strict=True))
        quantized.append(q)
    sums = [np.sum([q[k].astype(np.int64) for q in quantized], axis=0) % S.MODULUS_RANGE for k in range(2)]
    # SecAggPlusWorkflow.unmask_stage: dequantize, add -(n - 1) c, multiply by T / (n T)
    average = quantization.dequantize(sums, S.CLIPPING_RANGE, levels)
    for vec in average:
        vec += -(n - 1) * S.CLIPPING_RANGE
        vec *= levels / np.int64(n * levels)
    got = S.from_grid_sums(S.from_grid_average(average, n, levels), ["m"])
    assert torch.equal(got.values["m"], S.sum_encoded(clients).values["m"])


@pytest.mark.parametrize("n", [2, 3, 10, 11, 1000])
def test_every_integer_sum_comes_back_from_flowers_average_despite_its_rounding(n):
    """Flower's server divides by the summed weights (times 1 / n, rounded): for n = 10 about half the
    averages land a hair below their grid point, so the sum is rounded back (truncating would lose one)."""
    quantization = pytest.importorskip("flwr.common.secure_aggregation.quantization")
    levels = S.quantization_range(n)
    sums = np.random.default_rng(n).integers(0, n * levels + 1, size=20_000, dtype=np.int64)
    sums[:2] = [0, n * levels]
    average = quantization.dequantize([sums.copy()], S.CLIPPING_RANGE, levels)[0]
    average += -(n - 1) * S.CLIPPING_RANGE
    average *= levels / np.int64(n * levels)
    back = S.from_grid_average([average], n, levels)[0]
    assert back.dtype == np.int64 and np.array_equal(back, sums)


def test_an_average_that_no_n_clients_on_the_grid_can_give_is_refused():
    """Each client's grid value lies in [-c, c], so their average does too: one beyond it on either side (a wrong
    client count, another grid) is refused rather than decoded into a sum outside [0, n T]."""
    levels, c = S.quantization_range(3), S.CLIPPING_RANGE
    step = 2 * c / levels
    for beyond in (c + 4 * step, -c - 4 * step):
        with pytest.raises(ValueError, match=rf"outside \[0, 3 \* {levels}\]: the average does not come from 3 "):
            S.from_grid_average([np.array([0.0, beyond])], 3, levels)
    assert S.from_grid_average([np.array([-c, c])], 3, levels)[0].tolist() == [0, 3 * levels]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_reply_on_the_gpu_is_encoded_into_cpu_integers_for_flower():
    levels = S.quantization_range(2)
    v = torch.linspace(-1, 1, 9, dtype=torch.float64)
    e = S.encode({"x": v.cuda()}, {"x": 1.0}, levels)
    assert e.values["x"].device.type == "cpu"
    assert torch.equal(e.values["x"], S.encode({"x": v}, {"x": 1.0}, levels).values["x"])
    assert len(S.to_grid(e, levels)) == 2  # NumPy arrays: CPU tensors only


def test_secure_aggregation_needs_an_additive_post_hoc_step_and_thresholds_in_range():
    cases = {
        ("algorithm.name=fedavg",): "has no post-hoc step",
        ("algorithm.name=fedavg+ccvr", "algorithm.ccvr.oracle=all"): "oracle",
        ("runtime.secagg_num_shares=3",): "must be < runtime.secagg_num_shares = 3",
        ("data.num_clients=2",): "must be <= data.num_clients = 2",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match="runtime.secure_aggregation|runtime.secagg") as err:
            base = [o for o in SMALL if not o.startswith("algorithm.")]
            Experiment(config.load(None, [*base, "algorithm.name=fedavg+ccvr", "runtime.secure_aggregation=true",
                                          *overrides]))
        assert message in str(err.value)
    config.load(None, [*SMALL, "data.num_clients=2", "runtime.secagg_num_shares=3"])  # unchecked while off


@pytest.mark.parametrize(("method", "why"), [
    (["algorithm.name=fedavg"], "'fedavg': it has no post-hoc step"),
    (["algorithm.name=fedavg+ccvr", "algorithm.ccvr.oracle=all"],
     "'fedavg+ccvr': its post-hoc steps (ccvr) need each client's reply, not only their sum (CCVR's oracle mode "
     "uploads raw features)"),
])
def test_the_refusal_of_secure_aggregation_names_the_key_its_value_the_method_and_why(method, why):
    base = [o for o in SMALL if not o.startswith("algorithm.")]
    with pytest.raises(ConfigError) as err:
        Experiment(config.load(None, [*base, *method, "runtime.secure_aggregation=true"]))
    assert str(err.value) == ("runtime.secure_aggregation = true: applies to additive post-hoc steps (e.g. "
                              f"algorithm.name = 'fedavg+ccvr'); {why}; set it to false")



def test_the_refusal_names_every_post_hoc_step_that_needs_each_reply():
    """Two such steps (a plugin may register one beside CCVR's oracle): both are named, comma-separated."""
    from types import SimpleNamespace

    cfg = config.load(None, [*SMALL, "runtime.secure_aggregation=true"])
    steps = [SimpleNamespace(name="ccvr", additive=False), SimpleNamespace(name="mine", additive=False)]
    with pytest.raises(ConfigError, match=r"its post-hoc steps \(ccvr, mine\) need each client's reply"):
        S.check_config(cfg, steps)
    S.check_config(cfg, [*steps, SimpleNamespace(name="sums", additive=True)])  # one additive step is enough


def _replies(exp: Experiment) -> tuple[object, dict, dict]:
    step = exp.posthoc[0]
    raw = without_feature_transforms(exp.initial_server().model)
    return step, raw, exp.federation.posthoc_replies(step, raw, 1)


def test_in_process_secure_sum_equals_the_plain_sum_within_the_stated_error():
    plain = Experiment(config.load(None, SMALL))
    secure = Experiment(config.load(None, [*SMALL, "runtime.secure_aggregation=true"]))
    step, _, replies = _replies(plain)
    _, _, summed = _replies(secure)
    assert isinstance(summed, S.SecureSum) and isinstance(summed, SummedReplies)
    assert summed.clients == (0, 1, 2, 3) and summed.clipped == 0
    exact = step.summed_moments(replies)
    got = step.summed_moments(summed)
    levels, bounds = S.quantization_range(4), step.reply_bounds()
    for name, want in (("counts", exact.counts), ("sums", exact.sums), ("outer", exact.outer)):
        err = (getattr(got, name) - want).abs().max().item()
        assert err <= 4 * bounds[name] / levels * (1 + 1e-9), name
    assert summed.bytes_per_client == 8 * (sum(t.numel() for t in summed.total.values()) + 2)


def test_sequential_and_vectorised_executors_give_the_same_secure_run_bit_for_bit(tmp_path):
    """On a CPU the vectorized executor trains clients one at a time (its default there): the whole secure
    run is the sequential one's bit for bit. With vmap forced (runtime.vmap_on_cpu) local training differs
    from sequential in float32's last bits (tests/engine/test_vectorized.py), so the tightest true statement
    there is about the secure round itself: from the same model both give the same sum bit for bit."""
    lines = {}
    for executor in ("sequential", "vectorized"):
        Experiment(config.load(None, [*SMALL, "runtime.secure_aggregation=true", f"runtime.executor={executor}"])).run(
            tmp_path / executor)
        lines[executor] = [{k: v for k, v in json.loads(x).items() if k not in TIME_KEYS}
                           for x in (tmp_path / executor / "metrics.jsonl").read_text().splitlines()]
    assert lines["sequential"] == lines["vectorized"]
    last = lines["sequential"][-1]
    assert last["secagg_clients"] == 4 and last["secagg_clipped_entries"] == 0
    sums = [_replies(Experiment(config.load(None, [*SMALL, "runtime.secure_aggregation=true", *more])))[2]
            for more in (["runtime.executor=sequential"], ["runtime.executor=vectorized", "runtime.vmap_on_cpu=true"])]
    assert sums[0].total.keys() == sums[1].total.keys()
    assert all(torch.equal(sums[0].total[k], sums[1].total[k]) for k in sums[0].total)


class _Step:
    """A post-hoc step's two hooks simulate() uses: replies already dense, public bound 1 on every entry."""

    def reply_bounds(self) -> dict[str, float]:
        return {"x": 1.0}

    def dense_reply(self, reply: dict) -> dict:
        return reply


def test_the_simulated_server_learns_the_clipped_count_of_all_clients():
    summed = S.simulate(_Step(), {0: {"x": torch.tensor([0.5, 3.0])}, 1: {"x": torch.tensor([-2.0, float("nan")])},
                                  2: {"x": torch.tensor([0.25, 0.0])}}, S.quantization_range(3))
    assert summed.clipped == 3 and summed.clients == (0, 1, 2)
    torch.testing.assert_close(summed.total["x"], torch.tensor([-0.25, 1.0], dtype=torch.float64), atol=1e-8, rtol=0)


def test_malformed_sums_are_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"^no replies to sum$"):
        S.sum_encoded([])
    with pytest.raises(ValueError, match=r"expected 3 summed arrays \(counts, sums, clipped\), got 2"):
        S.from_grid_sums([np.zeros(2, np.int64), np.zeros(1, np.int64)], ["counts", "sums"])


@pytest.mark.parametrize("c", [0.5, 1.0, 4.0])
def test_any_power_of_two_clipping_range_carries_the_same_integers(c):
    """The float grid x = j 2c / T - c for Flower's clipping range c: its points are exact for any power of two, and
    the integer sums come back from the survivors' average (what Flower's server returns) whatever c is."""
    n, levels = 3, S.quantization_range(3)
    gen = torch.Generator().manual_seed(11)
    clients = [S.encode({"m": torch.randn(4, 5, generator=gen, dtype=torch.float64)}, {"m": 3.0}, levels)
               for _ in range(n)]
    grids = [S.to_grid(e, levels, c) for e in clients]
    for e, grid in zip(clients, grids, strict=True):
        assert grid[0].min() >= -c and grid[0].max() <= c
        assert np.array_equal((grid[0] + c) / (2 * c / levels), e.values["m"].numpy())
    average = [np.mean([g[k] for g in grids], axis=0) for k in range(2)]
    got = S.from_grid_sums(S.from_grid_average(average, n, levels, c), ["m"])
    assert torch.equal(got.values["m"], S.sum_encoded(clients).values["m"])
