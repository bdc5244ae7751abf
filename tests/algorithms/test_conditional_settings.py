"""A method setting read only in some mode (``when=`` in its declaration) that a run moves from its default
while that mode is off changes nothing: the run says so, and the declarations are proven truthful."""

from __future__ import annotations

from hetfl.cli import main


def test_a_run_says_a_method_setting_its_mode_ignores_has_no_effect(tmp_path, capsys, caplog, one_thread):
    """algorithm.proxy_dataset = 'cifar100' under FedBR's default pseudo_source made the default run, silently."""
    argv = ["run", "--set", "algorithm.name=fedbr", "--set", "algorithm.proxy_dataset=cifar100",
            "--set", "train.rounds=1", "--set", "data.options={max_samples = 150}", "--set", "train.local_steps=1",
            "--quiet", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    said = capsys.readouterr().err + caplog.text
    assert ("algorithm.proxy_dataset = 'cifar100' has no effect: it is read only when "
            "algorithm.pseudo_source = 'proxy' (here 'rsm_clients')") in said
