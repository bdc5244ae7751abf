"""`hetfl analyze RUN_DIR` on a run made by `hetfl run`: every analysis writes its files."""

from __future__ import annotations

import json

import pytest

from hetfl.cli import main

RUN = ["--set", "train.rounds=2", "--set", "data.partition=dirichlet", "--set", "data.num_clients=6",
       "--set", "model.options={hidden = [16]}", "--set", "runtime.save_client_models=[2]"]


@pytest.mark.slow  # every analysis (t-SNE, CKA, plots), ~4 s; fast cover: test_analysis.py, test_plots.py
def test_every_analysis_runs_on_a_run_directory(tmp_path):
    """Synthetic's devices cut to 20 samples each (600 in all, 6 clients): t-SNE embeds every training sample
    (< 1500) instead of 1500, a few seconds less; no analysis depends on how many there are."""
    run_dir = tmp_path / "run"
    assert main(["run", *RUN, "--set", "data.options={max_samples=20}", "--out", str(run_dir), "--quiet"]) == 0
    assert main(["analyze", str(run_dir), "--probe", "200"]) == 0
    index = json.loads((run_dir / "analysis" / "index.json").read_text())
    assert set(index["written"]) == {"curves", "weight_norms", "spectrum", "cka", "swd", "tsne"}, index["skipped"]
    for result in index["written"].values():
        png = (run_dir / "analysis" / result["png"].split("/")[-1]).read_bytes()
        assert png.startswith(b"\x89PNG")
    assert index["local_models_round"] == 2
    cka = index["written"]["cka"]["mean_cka"]
    assert all(0.0 <= v <= 1.0 + 1e-9 for v in cka.values()) and "classifier" in cka


def test_analyze_without_saved_local_models_skips_cka_with_a_reason(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", *RUN[:-2], "--out", str(run_dir), "--quiet"]) == 0
    assert main(["analyze", str(run_dir), "--only", "cka", "--only", "weight_norms"]) == 0
    index = json.loads((run_dir / "analysis" / "index.json").read_text())
    assert "save_client_models" in index["skipped"]["cka"]
    # how to ask for them, with this run's last round
    assert f'--set "runtime.save_client_models=[{index["round"]}]"' in index["skipped"]["cka"]
    assert "weight_norms" in index["written"]


def test_analyze_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    assert "no config.toml" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    assert main(["run", *RUN[:-2], "--out", str(run_dir), "--quiet"]) == 0
    assert main(["analyze", str(run_dir), "--only", "colour"]) == 2
    capsys.readouterr()
    for probe in ("0", "-5", "1"):  # -5 used to take all test samples but 5, 0 to end in a traceback
        assert main(["analyze", str(run_dir), "--probe", probe]) == 2
        assert capsys.readouterr().err.strip() == (f"hetfl: error: --probe = {probe}: must be a number of test samples "
                                                   ">= 2 (the analyses compare the probe samples' features)")
    assert not (run_dir / "analysis").exists()
    from hetfl.analysis.run import RunAnalysis, analyze_run
    from hetfl.params import ConfigError

    with pytest.raises(ConfigError, match=r"^probe = 1\.5: must be a number of test samples >= 2"):
        analyze_run(run_dir, probe=1.5)
    assert RunAnalysis(run_dir, probe=2).probe_x.shape[0] == 2


def test_analyze_a_diverged_run_skips_each_model_analysis_with_a_reason_not_a_traceback_or_nan(tmp_path):
    # lr 1e30: the train loss is NaN from round 1 on, and so is every weight. Spectrum, SWD and t-SNE used to end
    # `hetfl analyze` in a traceback (LinAlgError, "means and covariances must be finite", sklearn's NaN error);
    # weight norms and CKA were written as NaN (index.json's mean_cka: NaN, not even valid JSON)
    run_dir = tmp_path / "run"
    assert main(["run", *RUN, "--set", "train.lr=1e30", "--out", str(run_dir), "--quiet"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["diverged_round"] == 1
    assert main(["analyze", str(run_dir), "--probe", "50"]) == 0
    text = (run_dir / "analysis" / "index.json").read_text()
    index = json.loads(text, parse_constant=lambda c: pytest.fail(f"index.json holds {c}, not JSON"))
    assert set(index["written"]) == {"curves"}
    assert set(index["skipped"]) == {"weight_norms", "spectrum", "cka", "swd", "tsne"}
    for name, reason in index["skipped"].items():
        assert "not finite" in reason and "diverged in round 1" in reason, (name, reason)


def numpy_cka(x, y) -> float:
    """Linear CKA from its HSIC definition (Kornblith et al. 2019, eq. 2-4), independent of hetfl's code."""
    import numpy as np

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    n = x.shape[0]
    h = np.eye(n) - 1.0 / n

    def hsic(k, l_):
        return np.trace(k @ h @ l_ @ h)

    k, l_ = x @ x.T, y @ y.T
    return hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_))


def test_cka_of_clsnorm_local_classifiers_compares_the_logits_the_models_compute(tmp_path):
    # clsnorm's local models classify with L2-normalised rows (the state flag classifier_transform/normalize, which
    # the saved local models do not carry); the classifier layer's CKA was computed with the raw rows: 0.80 for a
    # pair whose logits have CKA 0.84 (off by up to 0.05 after 2 rounds; CCVR's Fig. 11 compares exactly this)
    import numpy as np
    import torch

    from hetfl.algorithms.classifier_reg import CLASSIFIER_NORM
    from hetfl.analysis.run import RunAnalysis

    run_dir = tmp_path / "run"
    assert main(["run", *RUN, "--set", "algorithm.name=clsnorm", "--out", str(run_dir), "--quiet"]) == 0
    run = RunAnalysis(run_dir, probe=120)
    states = list(run.local_models.values())
    assert len(states) >= 3 and not any(CLASSIFIER_NORM in s for s in states)
    run.out.mkdir()
    got = json.loads((run.cka()["data"]).read_text())["matrices"]["classifier"]
    logits = [run.exp.caller.features_and_logits({**s, CLASSIFIER_NORM: torch.ones(())}, run.probe_x)[1].numpy()
              for s in states]
    expected = [[numpy_cka(a, b) for b in logits] for a in logits]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    # the weight-norm figure shows the stored rows' norms, which clsnorm's classifier does not use: it says so
    assert "L2-normalised" in run.weight_norms().get("note", "")


def test_features_of_a_ccvr_calibrated_global_model_are_labelled_with_its_feature_transform(tmp_path):
    # after CCVR the global model's classifier input is ReLU + Tukey(beta = 0.5) of the encoder output: the spectrum,
    # SWD and t-SNE figures are of those features, and their label used to say "encoder output"
    import torch

    from hetfl.analysis.run import RunAnalysis

    run_dir = tmp_path / "run"
    assert main(["run", *RUN[:-2], "--set", "algorithm.name=fedavg+ccvr", "--out", str(run_dir), "--quiet"]) == 0
    run = RunAnalysis(run_dir, probe=60)
    transformed = run.features(run.server.model, run.probe_x)
    raw = run.features({k: v for k, v in run.server.model.items() if "/" not in k}, run.probe_x)
    torch.testing.assert_close(transformed, raw.clamp(min=0).sqrt())  # what the figures show
    assert "feature_transform/tukey_beta" in run.feature_layer(), run.feature_layer()


def test_tsne_shows_a_random_sample_of_each_client_with_its_class_mix_and_points_aligned_with_labels(
        tmp_path, monkeypatch):
    # the t-SNE took each client's first 1500 / m training samples, in storage order: a client holding 60 % class 5
    # showed 34 % (a class it holds 171 samples of: once); now a seeded random sample, with the client's class mix
    import numpy as np
    import torch

    import hetfl.analysis.run as run_mod

    run_dir = tmp_path / "run"
    assert main(["run", *RUN[:-2], "--set", "data.num_clients=4", "--out", str(run_dir), "--quiet"]) == 0
    seen = {}

    def fake_tsne(features, seed=0):
        seen["features"] = features
        return features[:, :2].float()

    monkeypatch.setattr(run_mod, "tsne_embedding", fake_tsne)
    run = run_mod.RunAnalysis(run_dir, probe=10)
    run.out.mkdir()
    rows = np.loadtxt(run.tsne()["data"], delimiter=",", skiprows=1)
    labels, clients = rows[:, 2].astype(int), rows[:, 3].astype(int)
    num_classes = run.exp.dataset.info.num_classes
    for c in range(4):
        feats, y = run.exp.client_features(run.server.model, c)
        have = np.bincount(y.numpy(), minlength=num_classes) / len(y)
        shown = np.bincount(labels[clients == c], minlength=num_classes) / (clients == c).sum()
        assert 0.5 * np.abs(have - shown).sum() < 0.15, (c, have.round(2), shown.round(2))
        # every point is a sample of that client, drawn with its own label
        for f, label in zip(seen["features"][clients == c], labels[clients == c], strict=True):
            match = (feats == f).all(dim=1).nonzero().flatten()
            assert len(match) and int(y[match[0]]) == label
    first = seen["features"]
    run_mod.RunAnalysis(run_dir, probe=10).tsne()
    assert torch.equal(seen["features"], first)  # the sample is seeded: the same points every time
