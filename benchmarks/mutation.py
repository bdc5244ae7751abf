"""Mutation testing of the methods' mathematical cores with mutmut.

Each target is one source file and the test files that are meant to catch a
wrong formula in it. For every target the script copies the repository's
``src``, ``tests``, ``configs`` and ``pyproject.toml`` into a scratch folder
beside the repository, appends a ``[tool.mutmut]`` section that mutates only
that file and runs only those tests, runs ``mutmut run`` there, and records
per mutant whether a test failed (killed) or not (survived). Results go to
``benchmarks/results/mutation/``: ``summary.json``, ``mutation.md`` (kill rate
per file) and ``<target>.survivors.txt`` (the diff of every surviving mutant,
to be killed by a new test or explained as equivalent in
``benchmarks/results/mutation/<target>.equivalent.md``; the table counts
the survivors explained there and those left unexplained).

Not part of the test suite (minutes per file). One command, from the
repository root, after ``pip install -e ".[test,mutation]"``::

    python benchmarks/mutation.py                 # every target
    python benchmarks/mutation.py --only feduv    # one target
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "mutation"

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "killed",
          None: "not checked"}


@dataclass(frozen=True)
class Target:
    name: str
    source: str
    tests: tuple[str, ...]
    #: extra pytest arguments (e.g. ``--deselect`` of an end-to-end run the unit tests already cover)
    pytest_args: tuple[str, ...] = ()
    #: the functions of ``source`` whose mutants make the target (all of the file's when empty): module-level
    #: ones by name, methods as ``Class.method``; one part of a large file, whose other functions are tested
    #: elsewhere (``mutmut run NAME...`` by glob)
    functions: tuple[str, ...] = ()

    def mutant_globs(self) -> tuple[str, ...]:
        """mutmut's names of the mutants of :attr:`functions` (``hetfl.params.x_former_values__mutmut_*``; a
        method's: ``hetfl.engine.vectorized.xǁGroupBuffersǁload__mutmut_*``)."""
        module = self.source.removeprefix("src/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        return tuple(f"{module}.{mangled(fn)}__mutmut_*" for fn in self.functions)


def mangled(function: str) -> str:
    """mutmut's name of a function (``x_name``) or a method (``Class.method``: ``xǁClassǁmethod``)."""
    owner, _, name = function.rpartition(".")
    return f"xǁ{owner}ǁ{name}" if owner else f"x_{name}"


# CCVR's end-to-end MNIST runs take a minute per mutant; the hand-computed cases cover the same code
E2E_CCVR = ("--deselect", "tests/algorithms/test_ccvr.py::test_ccvr_composes_and_raises_accuracy_under_label_skew")
# the private run's end-to-end check (a whole run, resumed); the unit tests of test_ccvr_dp.py cover its formulas
E2E_CCVR_DP = ("--deselect",
               "tests/algorithms/test_ccvr_dp.py::test_run_reports_its_privacy_and_resumes_to_the_same_budget")
# test_privacy_edges.py's killed-and-resumed whole runs (slow). Until session 33 their driver process imported
# hetfl from the installed (editable) checkout, not the scratch copy, so it never ran a mutant and failed whenever
# that checkout's configuration differed from the copy's (a mutation run counted equivalent mutants killed that
# way); tests/conftest.py now puts the tested sources first on every started process's PYTHONPATH. Still left out:
# whole runs, covered by the unit tests of the same file
KILLED_RUNS = ("--deselect", "tests/test_privacy_edges.py::"
                             "test_a_run_killed_between_a_release_and_its_checkpoint_reports_every_release_it_made",
               "--deselect", "tests/test_privacy_edges.py::"
                             "test_with_seeded_noise_the_lost_releases_are_replayed_and_the_run_is_the_uninterrupted_one")
# the tests that start processes (the README's SecAgg+ command on Flower's Ray simulation: slow; until session 42
# the scratch copy did not hold the README either); the in-process protocol tests of the same file cover the codec
NO_PROCESSES = ("-m", "not processes")
# the end-to-end runs marked slow (whole runs; the unit tests of the same files cover their code)
NOT_SLOW = ("-m", "not slow")
# the vectorised executor's targets: the slow tests marked engine_slow too (the compiled steps' Dynamo traces and a
# profiled round, marked slow in session 47 so that plain `pytest -q` stays under five minutes)
ENGINE_TESTS = "not processes and (not slow or engine_slow)"

# the models' tests: the forwards against the authors' modules, parameter counts, shapes and refusals
MODEL_TESTS = ("tests/models/test_paper_models.py", "tests/models/test_reference_forwards.py",
               "tests/models/test_models.py", "tests/models/test_paper_models_mutants.py",
               "tests/models/test_resnet_mutants.py", "tests/models/test_small_models_mutants.py")

# a sweep's tests (hetfl.sweeps): its own, the worker processes', reproduce's (which plans with it), the API's and the
# command line's refusals
SWEEP_TESTS = ("tests/test_sweep.py", "tests/test_jobs.py", "tests/test_reproduce.py", "tests/test_api.py",
               "tests/test_first_day.py", "tests/test_cli_errors.py", "tests/test_cli_usability.py")

TARGETS = (
    # the four seed methods
    Target("feduv", "src/hetfl/algorithms/feduv.py", ("tests/algorithms/test_feduv.py",)),
    Target("fedbr", "src/hetfl/algorithms/fedbr.py",
           ("tests/algorithms/test_fedbr.py", "tests/algorithms/test_fedbr_mutants.py")),
    Target("fedpac", "src/hetfl/algorithms/fedpac.py", ("tests/algorithms/test_fedpac.py",)),
    Target("simplex_qp", "src/hetfl/algorithms/simplex_qp.py",
           ("tests/algorithms/test_simplex_qp.py", "tests/algorithms/test_fedpac.py")),
    # the refusals of budgets and clip norms and the non-finite calibrations are tested in test_privacy_edges.py
    Target("ccvr", "src/hetfl/algorithms/ccvr.py",
           ("tests/algorithms/test_ccvr_math.py", "tests/algorithms/test_ccvr.py", "tests/algorithms/test_ccvr_dp.py",
            "tests/test_privacy_edges.py"), (*E2E_CCVR, *E2E_CCVR_DP, *KILLED_RUNS)),
    # CCVR's uploads and pooling, with secure aggregation and differential privacy (ccvr.py until session 22)
    Target("ccvr_statistics", "src/hetfl/algorithms/ccvr_statistics.py",
           ("tests/algorithms/test_ccvr_math.py", "tests/algorithms/test_ccvr.py", "tests/algorithms/test_ccvr_dp.py",
            "tests/engine/test_secure_sum.py", "tests/test_privacy_edges.py"),
           (*E2E_CCVR, *E2E_CCVR_DP, *NO_PROCESSES, *KILLED_RUNS)),
    Target("gaussian_stats", "src/hetfl/algorithms/gaussian_stats.py",
           ("tests/algorithms/test_gaussian_stats.py", "tests/algorithms/test_ccvr_math.py")),
    # differential privacy and secure aggregation of the post-hoc statistics
    # test_privacy_edges.py (session 31): the accepted budgets, epsilon rounded up (test_privacy_mutants.py: the texts,
    # digests and edges the others left untested); less test_privacy_edges.py's two killed-and-resumed
    # whole runs (6 and 4 s; the ledger's tests cover what they check of the releases)
    # (session 43) + test_privacy_participation.py: who took part in each release, the most exposed client (the
    # budget a run reports is that client's); about 5 s with its small whole runs
    Target("privacy", "src/hetfl/privacy.py",
           ("tests/test_privacy.py", "tests/algorithms/test_ccvr_dp.py", "tests/test_privacy_edges.py",
            "tests/test_privacy_mutants.py", "tests/engine/test_privacy_participation.py"),
           (*E2E_CCVR_DP, *KILLED_RUNS, *NOT_SLOW)),
    # (session 33) the set-up checks of budgets and clip norms (check_settings, FedPAC's counts-and-sums-only
    # bounds: test_privacy_edges.py, test_fedpac_dp.py) and the refused uploads' release (test_privacy_mutants.py);
    # their whole runs (marked slow) left out
    Target("dp_moments", "src/hetfl/algorithms/dp_moments.py",
           ("tests/algorithms/test_ccvr_dp.py", "tests/test_privacy.py", "tests/test_privacy_edges.py",
            "tests/algorithms/test_fedpac_dp.py", "tests/test_privacy_mutants.py"), (*E2E_CCVR_DP, *NOT_SLOW)),
    Target("secure_sum", "src/hetfl/engine/secure_sum.py",
           ("tests/engine/test_secure_sum.py", "tests/flower/test_flower_secagg.py"), NO_PROCESSES),
    # the baselines' update rules
    Target("fedprox", "src/hetfl/algorithms/fedprox.py", ("tests/algorithms/test_baselines.py",)),
    Target("fedavgm", "src/hetfl/algorithms/fedavgm.py", ("tests/algorithms/test_baselines.py",)),
    Target("scaffold", "src/hetfl/algorithms/scaffold.py",
           ("tests/algorithms/test_baselines.py", "tests/algorithms/test_baselines_mutants.py")),
    Target("feddyn", "src/hetfl/algorithms/feddyn.py",
           ("tests/algorithms/test_baselines.py", "tests/algorithms/test_baselines_mutants.py")),
    Target("fednova", "src/hetfl/algorithms/fednova.py",
           ("tests/algorithms/test_baselines.py", "tests/algorithms/test_baselines_mutants.py")),
    Target("moon", "src/hetfl/algorithms/moon.py",
           ("tests/algorithms/test_baselines.py", "tests/algorithms/test_baselines_mutants.py")),
    # the personalised baselines (session 26); personalized.py (LocalOnly) is no target: mutmut 3.8 makes no
    # mutant of it (no operator, number, string or argument to change), and its few lines are checked by
    # tests/algorithms/test_baselines.py::test_local_only_never_communicates_and_keeps_own_model
    # test_personalized_batchnorm.py (session 31): the personal copy's BatchNorm statistics (running_buffers)
    Target("apfl", "src/hetfl/algorithms/apfl.py",
           ("tests/algorithms/test_personalized_baselines.py", "tests/algorithms/test_personalized_batchnorm.py")),
    Target("ditto", "src/hetfl/algorithms/ditto.py",
           ("tests/algorithms/test_personalized_baselines.py", "tests/algorithms/test_personalized_batchnorm.py")),
    Target("pfedme", "src/hetfl/algorithms/pfedme.py", ("tests/algorithms/test_personalized_baselines.py",)),
    Target("fedrod", "src/hetfl/algorithms/fedrod.py",
           ("tests/algorithms/test_personalized_baselines.py", "tests/algorithms/test_baseline_math.py")),
    Target("fedfomo", "src/hetfl/algorithms/fedfomo.py", ("tests/algorithms/test_personalized_baselines.py",)),
    Target("knnper", "src/hetfl/algorithms/knnper.py", ("tests/algorithms/test_personalized_baselines.py",)),
    Target("partial_sharing", "src/hetfl/algorithms/partial_sharing.py",
           ("tests/algorithms/test_personalized_baselines.py",)),
    Target("finetune", "src/hetfl/algorithms/finetune.py", ("tests/algorithms/test_personalized_baselines.py",)),
    Target("pfedhn", "src/hetfl/algorithms/pfedhn.py", ("tests/algorithms/test_personalized_baselines.py",)),
    # the bias-reducing baselines and regularisers the papers compare against (session 26)
    Target("freeze", "src/hetfl/algorithms/freeze.py", ("tests/algorithms/test_baselines.py",)),
    Target("classifier_reg", "src/hetfl/algorithms/classifier_reg.py", ("tests/algorithms/test_ccvr_side_studies.py",)),
    Target("logit_adjust", "src/hetfl/algorithms/logit_adjust.py", ("tests/algorithms/test_bias_baselines.py",)),
    Target("feddecorr", "src/hetfl/algorithms/feddecorr.py", ("tests/algorithms/test_bias_baselines.py",)),
    Target("fedetf", "src/hetfl/algorithms/fedetf.py", ("tests/algorithms/test_fedetf.py",)),
    Target("vhl", "src/hetfl/algorithms/vhl.py", ("tests/algorithms/test_vhl.py",)),
    Target("dann", "src/hetfl/algorithms/dann.py", ("tests/algorithms/test_dann.py",)),
    Target("groupdro", "src/hetfl/algorithms/groupdro.py", ("tests/algorithms/test_groupdro.py",)),
    Target("mixup", "src/hetfl/algorithms/mixup.py", ("tests/algorithms/test_mixup.py",)),
    Target("fedmix", "src/hetfl/algorithms/fedmix.py", ("tests/algorithms/test_mixup.py",)),
    # the Algorithm base class (session 27): its hooks' FedAvg defaults, the loss contract, head transforms, the
    # model caller, cross-entropy and the weighted mean; the local step's engine path and CCVR's head transform
    # (session 31) the plug-in hooks' checks (test_plugins.py), bf16 copies (test_low_precision.py) and the
    # reference models' eval mode (MOON's round by hand); (session 34) client_weights, train.weighting's hook
    # (test_train_weighting.py, less its presets' test: mutmut's copy in mutants/ holds no configs/ folder)
    Target("algorithm_base", "src/hetfl/algorithms/base.py",
           ("tests/algorithms/test_base_mutants.py", "tests/algorithms/test_cross_entropy.py",
            "tests/algorithms/test_baselines.py", "tests/engine/test_local_step.py", "tests/algorithms/test_ccvr.py",
            "tests/algorithms/test_plugins.py", "tests/engine/test_low_precision.py",
            "tests/algorithms/test_train_weighting.py",
            "tests/algorithms/test_baseline_rounds.py::test_moon_reference_models_use_their_running_statistics"),
           (*NOT_SLOW, *E2E_CCVR, "--deselect", "tests/algorithms/test_train_weighting.py::"
                                                "test_the_fedbr_table_presets_average_uniformly_as_the_authors_code")),
    # the shared core (session 26)
    Target("schedule", "src/hetfl/engine/schedule.py",
           ("tests/engine/test_schedule.py", "tests/algorithms/test_schedule_mutants.py")),
    Target("optim", "src/hetfl/optim.py", ("tests/test_optim.py",)),
    Target("evaluate", "src/hetfl/engine/evaluate.py", ("tests/algorithms/test_evaluate_mutants.py",)),
    Target("augment", "src/hetfl/data/augment.py",
           ("tests/data/test_augment.py", "tests/engine/test_federated_data.py")),
    # the splits' own tests and those written for their survivors, the HAM10000 domain split and the group
    # splits of test_scale.py (against the earlier per-group loops; its other tests are whole runs);
    # tests/algorithms/test_partition_mutants.py (session 26) is picked up by extra_tests. The CLI run that
    # prints the ignored-setting notes is left out: unused_settings is tested as a unit (30 s a survivor saved)
    Target("partition", "src/hetfl/data/partition.py",
           ("tests/data/test_partition.py", "tests/data/test_partition_mutants.py", "tests/data/test_ham10000.py",
            "tests/engine/test_scale.py::test_group_splits_by_one_sort_equal_the_per_group_scans"),
           ("--deselect",
            "tests/data/test_partition.py::test_a_run_says_a_partition_setting_it_ignores_has_no_effect")),
    Target("layers", "src/hetfl/models/layers.py", ("tests/models/test_layers.py",)),
    Target("ledger", "src/hetfl/engine/ledger.py", ("tests/engine/test_ledger.py",)),
    # (session 44) the memory a configuration needs, estimated before anything is allocated: what cannot fit is
    # refused naming the key that drives it, the estimate and what is available (the reproductions run
    # in a capped child process, all in one test)
    # (session 45) what cannot fit in memory, refused before it is allocated: the estimates and the refusal.
    # The whole-CLI case list runs in a capped child process, whose trampoline hits mutmut's stats run cannot
    # record (and whose mutmut, started outside the scratch copy, finds no configuration): deselected; the
    # same cases are checked in-process on the estimates (tests/engine/test_resources.py), which allocate nothing
    Target("resources", "src/hetfl/engine/resources.py", ("tests/test_bad_input.py", "tests/engine/test_resources.py"),
           ("--deselect", "tests/test_bad_input.py::test_what_cannot_fit_in_memory_is_refused_before_allocating")),
    # (session 44) a run directory's life in experiment.py: a resume checked against its checkpoint (or, before
    # the first, its config.toml; a plug-in's edited code named), a finished run's summary returned as it is,
    # the model kept before the post-hoc steps (trained.safetensors) and a run started from another's
    # training (trained=): the history lines it shares, the configuration and ledger it must match
    Target("experiment_resume", "src/hetfl/engine/experiment.py",
           ("tests/engine/test_experiment_resume.py", "tests/engine/test_trained_reuse.py",
            "tests/engine/test_run_dir_safety.py", "tests/engine/test_engine.py",
            "tests/engine/test_rundir_mutants.py", "tests/test_api.py", "tests/engine/test_former_settings.py",
            "tests/algorithms/test_plugins.py::test_a_run_of_an_edited_plugin_is_not_taken_for_the_run_of_its_old_code",
            "tests/algorithms/test_plugins.py::test_a_checkpoint_of_the_old_plugin_code_is_not_continued_with_the_new",
            "tests/test_first_day.py::test_resuming_a_finished_run_says_nothing_to_do_once",
            "tests/test_first_day.py::test_resuming_a_plugin_run_without_the_plugin_says_to_pass_it",
            "tests/test_cli.py::test_resume_takes_the_settings_that_change_no_number", "tests/test_tracking.py"),
           functions=("Experiment.run", "Experiment.trained_checkpoint", "Experiment.keeps_trained",
                      "Experiment.run_locked", "Experiment.finished", "plugin_edits", "saved_config",
                      "keeps_trained_model", "lines_before", "copy_history")),
    # (session 44) how a run feeds its private releases to the ledger and the reported budget: each release
    # recorded before the server uses it, for the clients asked (not only those who replied), the uploads a
    # stopped phase had received, a resume's ledger checked against its checkpoint, a round released twice
    # under the same seeded noise reported as inf. The rest of experiment.py (the round loop) is no part of it.
    # The killed-and-resumed whole runs are in it, and Flower's stopped rounds (the only callers of account_stop):
    # they are the cases these functions exist for (seconds each)
    Target("experiment_privacy", "src/hetfl/engine/experiment.py",
           ("tests/test_privacy_edges.py", "tests/engine/test_privacy_participation.py",
            "tests/algorithms/test_ccvr_dp.py", "tests/algorithms/test_fedpac_dp.py", "tests/test_privacy_mutants.py",
            "tests/engine/test_ledger.py", "tests/engine/test_experiment_privacy.py",
            "tests/flower/test_flower_refused_privacy.py",
            "tests/flower/test_flower_logic.py::"
            "test_uploads_received_in_a_round_stopped_by_the_quorum_count_after_the_resume",
            "tests/flower/test_flower_logic.py::"
            "test_a_round_with_a_straggler_lost_after_the_checkpoint_counts_both_of_its_releases"),
           functions=("Experiment.releasing_methods", "Experiment.open_ledger", "Experiment.account_release",
                      "Experiment.account_stop", "Experiment.record_release", "Experiment.mark_reused_noise",
                      "asked_release")),
    # the settings added with a default that changed the computation (session 31): how a setting declares the
    # value runs before it computed with (``setting(former=...)``) and how it is read back (``former_values``);
    # the rest of params.py (the configuration's checks) is tested by tests/test_config.py and is no part of it.
    # The MOON run resumed across the setting is a whole run (the unit tests of the same file cover the reading)
    Target("params_former", "src/hetfl/params.py",
           ("tests/engine/test_former_settings.py", "tests/engine/test_former_values_mutants.py"),
           ("--deselect", "tests/engine/test_former_settings.py::"
                          "test_a_moon_run_written_before_reference_mode_resumes_as_it_started_and_is_not_reused_as_eval_mode"),
           functions=("setting", "former_values")),
    # the analysis of trained models (session 35): layer-wise linear CKA, the feature covariance's spectrum and
    # the classifier's weight norms against class counts (CCVR Figures 1-3, Shi et al. 2023)
    Target("analysis_cka", "src/hetfl/analysis/cka.py",
           ("tests/analysis/test_analysis.py", "tests/analysis/test_analysis_mutants.py")),
    Target("analysis_spectrum", "src/hetfl/analysis/spectrum.py",
           ("tests/analysis/test_analysis.py", "tests/analysis/test_analysis_mutants.py")),
    Target("analysis_classifier", "src/hetfl/analysis/classifier.py",
           ("tests/analysis/test_analysis.py", "tests/analysis/test_analysis_mutants.py")),
    # the numbers researchers publish (session 38, helper mutation3): the compare tables' mean ± std over seeds,
    # best/final accuracy and rounds to a target (its numeric core; the rest of tables.py renders text that
    # tests/test_sweep.py and tests/test_cli.py read back whole)
    Target("tables", "src/hetfl/tables.py",
           ("tests/test_sweep.py", "tests/test_tables_mutants.py"),
           ("-m", "not processes and not slow",  # the preset list test reads configs/, which mutmut's copy lacks
            "--deselect", "tests/test_sweep.py::test_reproduce_list_labels_estimates_measured_or_rough"),
           functions=("rounds_to_target", "mean_std", "with_spread", "percent", "table_rows", "at_chance",
                      "diverged_count", "traffic_mb")),
    # the sliced Wasserstein distance between Gaussian mixtures (CCVR appendix): against closed forms and samples.
    # Session 38 ran the distance's assembly (directions, quadrature, W_p^p, the matrix) only (time); the quantile
    # solver (projected_quantiles and its helpers) and GaussianMixture's checks were not mutated
    Target("analysis_swd", "src/hetfl/analysis/swd.py",
           ("tests/analysis/test_analysis.py", "tests/analysis/test_swd_mutants.py"),
           ("-m", "not processes and not slow"),
           functions=("random_directions", "quantile_grid", "_wpp", "_chunks", "sliced_wasserstein_matrix",
                      "sliced_wasserstein")),
    # learning curves and seed bands (mean ± std over seeds per round, rounds to a target); tests/test_report.py
    # (which draws them into report.html, seconds per mutant) is left out: the known answers of the two files cover it.
    # Session 38 ran the functions behind published numbers only (time): load_metrics, client_spread,
    # train_loss_curve, cumulative_bytes and run_curves have known-answer tests but were not mutated
    Target("analysis_curves", "src/hetfl/analysis/curves.py",
           ("tests/analysis/test_seed_bands.py", "tests/analysis/test_curves_mutants.py"),
           ("-m", "not processes and not slow"),
           functions=("seed_band", "_series", "rounds_to_target", "default_accuracy_key", "accuracy_curves")),
    # the partition's statistics report (class counts, entropy, top class, train/test TV, the `all` row)
    Target("partition_report", "src/hetfl/data/partition_report.py",
           ("tests/data/test_partition.py", "tests/data/test_partition_groups.py",
            "tests/data/test_partition_report_mutants.py"), ("-m", "not processes and not slow"),
           functions=("_counts", "class_counts", "_entropy_bits", "partition_table", "summary_row")),
    # the engine's sequential local trainer (session 35): the round against FedAvg by hand (both executors: the
    # vectorised one calls step_gradients and clip_grads), the in-place step against the functional one, bf16
    Target("engine_local", "src/hetfl/engine/local.py",
           ("tests/engine/test_local_step.py", "tests/engine/test_round_reference.py",
            "tests/engine/test_low_precision.py", "tests/engine/test_local_mutants.py"), NOT_SLOW),
    # the in-process federation (session 35): the clients' side of a round (train, set-up and post-hoc replies,
    # per-client accuracies): the round by hand, the accuracies from the global model's correctness, the secure
    # post-hoc sum in process, the saved client models, the protocol's shape
    Target("engine_federation", "src/hetfl/engine/federation.py",
           ("tests/engine/test_round_reference.py", "tests/engine/test_scale.py", "tests/engine/test_secure_sum.py",
            "tests/engine/test_layers.py", "tests/engine/test_federation_mutants.py",
            "tests/engine/test_engine.py::test_saved_client_models_average_to_the_global_model"),
           ("-m", "not processes and not slow")),
    # the clients' data on the device (session 38): per-client views, batch sampling from per-client generators,
    # the augmentation draws, the per-client test accuracies
    Target("engine_data", "src/hetfl/engine/data.py",
           ("tests/engine/test_federated_data.py", "tests/engine/test_data_mutants.py"),
           ("-m", "not processes and not slow")),
    # a vectorised round's host-side schedule (session 38): the same draws as the sequential executor, in the same
    # order, laid out as calls of blocks of steps: the plan replayed call by call against the sequential draws (1.3 s;
    # test_vectorized_host.py's whole vectorised rounds, 19 s, and test_vectorized.py are left out: minutes a mutant)
    Target("engine_step_plan", "src/hetfl/engine/step_plan.py",
           ("tests/engine/test_step_plan_mutants.py",), ("-m", "not processes and not slow")),
    # the run's checkpoint (session 38): what is saved and restored for an exact resume (every tensor under its
    # scope, in its order, in memory of its own), the refusals of a foreign or damaged file. The hand tests only:
    # test_run_dir_safety.py's resumed runs (14 s) checked 49 mutants in 5 minutes on the shared 2 cores
    Target("engine_checkpoint", "src/hetfl/engine/checkpoint.py",
           ("tests/engine/test_checkpoint_mutants.py",), ("-m", "not processes and not slow")),
    # the vectorised executor's numeric core (session 39): the stacked buffers a group's steps read and write, a
    # step (gather, vmapped gradients, the in-place update, write-back, the sums), the round's results, chunking
    # and the fallback; against the sequential clients (every method, every chunk size and block length, eager
    # and static steps, bf16, BatchNorm, compiled steps) and the host-free step's counts. The CUDA-graph capture,
    # the caches' bookkeeping and the messages are left out (their tests are CUDA-only or about the log)
    Target("engine_vectorized", "src/hetfl/engine/vectorized.py",
           ("tests/engine/test_vectorized.py", "tests/engine/test_vectorized_static.py",
            "tests/engine/test_vectorized_host.py", "tests/engine/test_vectorized_mutants.py",
            "tests/engine/test_low_precision.py", "tests/engine/test_precision.py",
            "tests/engine/test_compiled_step.py", "tests/algorithms/test_personalized_batchnorm.py"),
           ("-m", ENGINE_TESTS,  # it names the step's line: under mutmut, its trampoline's
            "--deselect", "tests/engine/test_vectorized_static.py::"
                          "test_a_step_that_reads_what_its_algorithm_leaves_out_of_step_reads_is_refused_by_name"),
           functions=("client_axes", "GroupBuffers.__init__", "GroupBuffers._rows", "GroupBuffers._shared_or_rows",
                      "GroupBuffers.fits", "GroupBuffers.load", "GroupBuffers.load_rates", "GroupBuffers.tensors",
                      "channels_last_for_vmap", "client_channels_last", "VectorizedGroup.generators",
                      "VectorizedGroup.plan", "VectorizedGroup.vmapped_gradients",
                      "VectorizedGroup.single_client_gradients", "VectorizedGroup.step", "VectorizedGroup.train",
                      "VectorizedGroup.write", "VectorizedGroup.body", "VectorizedGroup.run",
                      "VectorizedGroup.results", "restore", "train_clients_vectorized")),
    # the rest of the vectorised executor (session 40): what a group's steps are keyed on (a step's callables, its
    # plain values, the tensors' structure), the refusal of a read the algorithm left out of step_reads, the
    # compiled calls (their static inputs, reuse, the CUDA-graph build with its reference, check and fallbacks),
    # the run's caches (kept buffers and graphs, least recently used dropped), the plan drawn ahead, the memory
    # probe. The capture itself is CUDA's: its tests replace torch.cuda.CUDAGraph by a recorder on the CPU
    Target("engine_vectorized_calls", "src/hetfl/engine/vectorized.py",
           ("tests/engine/test_vectorized_static.py", "tests/engine/test_vectorized_mutants.py",
            "tests/engine/test_vectorized.py", "tests/engine/test_vectorized_host.py",
            "tests/engine/test_graph_build.py", "tests/engine/test_compiled_step.py",
            "tests/engine/test_vectorized_calls_mutants.py"),
           ("-m", ENGINE_TESTS,  # it names the step's line: under mutmut, its trampoline's
            "--deselect", "tests/engine/test_vectorized_static.py::"
                          "test_a_step_that_reads_what_its_algorithm_leaves_out_of_step_reads_is_refused_by_name"),
           functions=("where_in_method", "_in_method", "callable_key", "stage_key", "tensors_key",
                      "ClientPlan.__post_init__", "ClientPlan.of", "ClientPlan.key", "TemplateContext.__getattribute__",
                      "TemplateContext.of", "TemplateContext.scalars", "TemplateContext.with_tensors",
                      "NotReadBySteps.__init__", "NotReadBySteps._refuse", "NotReadBySteps.__getitem__",
                      "NotReadBySteps.__iter__", "NotReadBySteps.__len__", "VectorizedGroup.__init__",
                      "VectorizedGroup._buffers", "VectorizedGroup.plan_inputs", "VectorizedGroup.planned_ahead",
                      "VectorizedGroup.plan_ahead", "VectorizedGroup.replayed", "VectorizedGroup.compiles",
                      "VectorizedGroup.uncompiled", "VectorizedGroup.compiled", "VectorizedCache.__post_init__",
                      "VectorizedCache.used", "VectorizedCache.drop", "VectorizedCache.forget",
                      "CompiledCall.__init__", "CompiledCall.reusable", "CompiledCall.load", "CompiledCall.run",
                      "CompiledCall.build", "CompiledCall._built", "CompiledCall.capture", "CompiledCall.note",
                      "build_phase", "graphs_capturable", "free_memory_bytes", "probe_client_bytes",
                      "clients_that_fit")),
    # the run directory (session 41): the lock that keeps two processes out of one run (taken over from a killed
    # holder, SIGTERM as an interrupt), the refusal to start a new run over files, the temporary files a killed
    # write leaves, and the metrics lines a resume keeps (each line's round and digest checked against the
    # checkpoint's record, the lines after it cut). The lock's tests that start processes are in the selection;
    # the whole killed-and-resumed runs (slow) are not
    Target("engine_rundir", "src/hetfl/engine/rundir.py",
           ("tests/engine/test_run_dir_safety.py", "tests/engine/test_ledger.py", "tests/engine/test_scale.py",
            "tests/test_api.py", "tests/engine/test_rundir_mutants.py"), ("-m", "not slow")),
    # (session 41) what a file written by hetfl is when a write is cut: the atomic write (a temporary file in the
    # same folder, synced, renamed; removed when the write fails) and the modes that follow the umask
    Target("files", "src/hetfl/files.py",
           ("tests/test_atomic_outputs.py", "tests/engine/test_rundir_mutants.py", "tests/test_files.py"),
           ("-m", "not slow")),
    # (session 41) a run's identity: which resolved configuration is the same run (reused, resumed) or the same
    # row of a table (all but the seed), the keys left out of it, old run folders read as they were written
    Target("engine_identity", "src/hetfl/engine/identity.py",
           ("tests/engine/test_run_identity.py", "tests/engine/test_former_settings.py", "tests/test_api.py",
            "tests/engine/test_identity_mutants.py"),
           ("-m", "not slow")),
    # (session 41) a post-hoc step's round under Flower's SecAgg+ (the server learns only the sum): the strategy
    # that hands the workflow hetfl's queries and keeps what it unmasked, the node's mod, the dropouts and stops.
    # In-process Flower (the README's command on Ray, a process test, left out)
    Target("flower_secagg", "src/hetfl/flower/secagg.py",
           ("tests/flower/test_flower_secagg.py", "tests/flower/test_secagg_mutants.py"),
           ("-m", "not slow and not processes")),
    # (session 45) tensors through Flower's records, bit for bit (every dtype, numpy's and torch's own), what a
    # round's records weigh (metrics.jsonl's flower_bytes_*), the digest of a client's samples a node sends
    Target("flower_codec", "src/hetfl/flower/codec.py",
           ("tests/flower/test_codec.py",
            "tests/flower/test_flower.py::test_tensors_round_trip_bit_exact_in_every_dtype",
            "tests/algorithms/test_ccvr_math.py::test_replies_pass_through_flower_records_unchanged",
            "tests/flower/test_flower_logic.py", "tests/flower/test_flower_refused_privacy.py"),
           ("-m", "not processes")),
    # (session 45) FedProx's Synthetic(alpha, beta), the data every quick test trains on: the generative model's
    # draws in the reference code's order, device sizes, the split by device, the loader's arrays equal to them
    Target("datasets_synthetic", "src/hetfl/data/datasets/synthetic.py",
           ("tests/data/test_synthetic.py", "tests/data/test_datasets.py::test_synthetic_shapes_and_determinism",
            "tests/data/test_datasets.py::test_synthetic_heterogeneity_and_statistics",
            "tests/test_bad_input.py::test_synthetic_estimate_bounds_what_generate_allocates")),
    # (session 45) MNIST, Fashion-MNIST and EMNIST from their IDX files: a damaged or foreign file refused naming
    # itself and what to do, labels checked, EMNIST's images turned upright and its archive extracted inside
    # data.root only
    Target("datasets_idx", "src/hetfl/data/datasets/idx.py",
           ("tests/data/test_datasets.py", "tests/data/test_damaged_files.py", "tests/data/test_data_links.py",
            "tests/data/test_idx.py"),
           ("-m", "not slow")),
    # (session 45) data stays inside data.root: the one guarded way every loader lists and opens files (links that
    # leave it, loops, broken links refused naming the path; follow_links where a loader offers it)
    Target("datasets_paths", "src/hetfl/data/datasets/paths.py", ("tests/data", "tests/test_bad_input.py"),
           ("-m", "not slow")),
    # (session 45) a folder tree, a tar or a zip read alike: a damaged archive is an error, never a smaller dataset
    # (strict tar headers, compressed streams read to their checksum, zip CRCs), hidden entries and links skipped
    Target("datasets_tree", "src/hetfl/data/datasets/tree.py", ("tests/data", "tests/test_bad_input.py"),
           ("-m", "not slow")),
    # (session 45) CIFAR-10/100 from the official pickled batches or the JPEG/PNG tree: records checked, labels in
    # range, the classes in CIFAR's order
    Target("datasets_cifar", "src/hetfl/data/datasets/cifar.py", ("tests/data", "tests/test_bad_input.py"),
           ("-m", "not slow")),
    # (session 45) image folders (a split layout train/<class>/, test/<class>/, or class folders split by the seed;
    # extracted or an archive): classes, sizes, the split, and refusals that name the folder
    # (session 46) what Flower's server accepts from a node: its greeting, replies by client (errors, another
    # node's data, a late reply left out), an upload's size, shapes, dtypes, noisy statistics and sample count
    # checked and its form the round's, set-up and post-hoc replies checked by the method, whole numbers and
    # accuracies in range, the refused uploads' digests kept for the privacy ledger, the quorum. In-process
    # Flower on a fake grid (the process tests left out)
    Target("flower_server_replies", "src/hetfl/flower/server.py",
           ("tests/flower",), ("-m", "not slow and not processes"),
           functions=("FlowerFederation._greeted", "FlowerFederation.exchange", "FlowerFederation.by_client",
                      "FlowerFederation.refuse", "FlowerFederation.setup_replies",
                      "FlowerFederation.holds_other_data", "FlowerFederation.other_data", "FlowerFederation.quorum",
                      "FlowerFederation.check_quorum", "FlowerFederation.read_updates",
                      "FlowerFederation.read_update", "FlowerFederation.of_the_rounds_form",
                      "FlowerFederation.tensor_replies", "upload_digest", "upload_form", "form_difference", "_why",
                      "_whole", "_accuracy")),
    # (session 46) what a Flower node keeps from the server: its privacy floor (the smaller epsilon and delta, fresh
    # noise, the whole noise in its own upload without secure aggregation; a method or run without differential
    # privacy refused) over the whole run (no answer beyond the planned releases), its own client only, plain run
    # and session names, state written only inside its own or a trusted folder (StateStore's versions: not yet)
    Target("flower_node_guards", "src/hetfl/flower/node.py",
           ("tests/flower",), ("-m", "not slow and not processes"),
           functions=("privacy_floor", "with_privacy_floor", "_floor_text", "own_client", "PrivateAnswers.__init__",
                      "PrivateAnswers._read", "PrivateAnswers.admit", "admit_private_answer", "plain_name",
                      "state_root")),
    # (session 47) a client's state on its node: the version a message of round r may use (written before r, by this
    # session or before the checkpoint it started from, no later than the last round the server counted), the
    # versions pruned (in context.state and in the state folder: those a resume can still ask for kept), the kept
    # state or the server's initial one, the shared tensors kept between messages
    Target("flower_node_state", "src/hetfl/flower/node.py",
           ("tests/flower/test_flower_logic.py", "tests/flower/test_flower_node_trust.py",
            "tests/flower/test_server_replies.py", "tests/flower/test_node_state.py"),
           ("-m", "not slow and not processes"),
           functions=("StateStore.__init__", "StateStore._valid", "StateStore._kept", "StateStore._files",
                      "StateStore.load", "StateStore.save", "StateStore._index", "StateStore._keep_from",
                      "StateStore.prune", "shared_tensors", "client_state")),
    # (session 47) the honest numbers of a reproduced table: each cell's mean over its seeds, its metric (a summary
    # key or FedBR's best-5 mean), the difference to the paper only in the paper's setting (a --set that changes it
    # drops them, a location or runtime key does not), runs that diverged counted, the row at chance, the ordering
    # of the rows against the paper's (pairs the paper separates by a point or more); a run's configuration (a shared
    # setting its method does not read left out), a preset's name. Not the Markdown (300 mutants of wording)
    Target("reproduce_numbers", "src/hetfl/reproduce.py", ("tests/test_reproduce.py", "tests/test_first_day.py"),
           ("-m", "not slow"),
           functions=("metric_value", "chance_value", "is_global_accuracy", "run_diverged", "reproduction_table",
                      "setting_changes", "ordering", "build_config", "unread_settings", "unset_dotted",
                      "preset_path")),
    # (session 48) several runs at once (hetfl compare/reproduce --jobs N): the dependency order (a calibration run
    # after the training it reads), never more workers than runs, the threads each worker starts from, a failed run
    # stopping the plan with its folder and cause, the workers stopped with their parent, the time left. Its
    # worker-process tests included (marked slow: a few seconds each)
    Target("jobs", "src/hetfl/jobs.py", ("tests/test_jobs.py",)),
    # (session 48) a sweep's grid and folders (hetfl compare --grid/--sweep, hetfl.sweep): the grid's keys and values
    # as --set takes them, each cell its own folder (named by its values as configured, two cells of one
    # configuration refused, cell.json), which runs calibrate another's training, the plan handed to worker
    # processes (each run's source, order and cost; finished runs reused)
    Target("sweeps_grid", "src/hetfl/sweeps.py", SWEEP_TESTS, ("-m", "not slow"),
           functions=("toml_literal", "_canonical", "split_values", "parse_grid_option", "_flatten_grid",
                      "read_sweep_file", "_dict_setting", "check_key", "_overlaps", "check_grid", "grid_from_cli",
                      "Cell.assignments", "Cell.dirname", "_shown", "iter_cells", "run_dir_for", "as_configured",
                      "check_distinct", "_write_cell_file", "method_settings", "rounds_done", "posthoc_only",
                      "_run_in_turn", "_run_parallel")),
    # (session 48, not run yet: its 213 mutants each run the plan's whole runs; stopped at the session's end) the
    # plan's size bound, configuration and check before any run, each run's cost, the settings meant for another
    # method of the plan, which runs share a training. Not the plan's wording (its notes) nor the counter's
    # estimates (RunCounter)
    Target("sweeps_plan", "src/hetfl/sweeps.py", SWEEP_TESTS, ("-m", "not slow"),
           functions=("count_cells", "check_plan_size", "run_cost", "planned_run", "settings_elsewhere",
                      "without_settings", "plan_items", "check_plan", "training_key", "training_sources")),
    # (session 46) what a server accepts of a reply that crossed a network before a method reads it: the tensors'
    # form (names, shapes, dtypes, finite), class indices, CCVR's statistics (clear, private, the oracle's features),
    # FedMix's averaged data and FedBR's pseudo-data of the set-up round
    Target("reply_checks_base", "src/hetfl/algorithms/base.py", ("tests/algorithms/test_reply_checks.py",),
           functions=("check_reply_form", "check_class_indices")),
    Target("reply_checks_ccvr", "src/hetfl/algorithms/ccvr_statistics.py", ("tests/algorithms/test_reply_checks.py",),
           functions=("CCVRStatistics.check_reply",)),
    Target("reply_checks_ccvr_oracle", "src/hetfl/algorithms/ccvr.py", ("tests/algorithms/test_reply_checks.py",),
           functions=("CCVR.check_reply",)),
    Target("reply_checks_fedmix", "src/hetfl/algorithms/fedmix.py", ("tests/algorithms/test_reply_checks.py",),
           functions=("FedMix.check_setup_reply",)),
    Target("reply_checks_fedbr", "src/hetfl/algorithms/fedbr.py", ("tests/algorithms/test_reply_checks.py",),
           functions=("FedBR.check_setup_reply", "FedBR.setup_reply_needed")),
    Target("datasets_imagefolder", "src/hetfl/data/datasets/imagefolder.py", ("tests/data", "tests/test_bad_input.py"),
           ("-m", "not slow")),
    # (session 42) the downloads' guarantees: a mirror's file is kept only when its checksum matches (and its
    # announced size was received), never under its final name before; the messages that name the files to put
    # where when no download worked
    Target("datasets_download", "src/hetfl/data/datasets/download.py",
           ("tests/data/test_datasets.py", "tests/data/test_damaged_files.py", "tests/data/test_data_links.py",
            "tests/data/test_download_mutants.py"),
           ("-m", "not slow")),
    # (session 42) the decoded-array cache: an entry is complete exactly when its manifest exists, its key (the
    # source files' fingerprint among it) must match, never pickle; the cache folder's rules (XDG, a file refused)
    Target("datasets_cache", "src/hetfl/data/datasets/cache.py",
           ("tests/data/test_cache_dir.py", "tests/data/test_datasets.py", "tests/data/test_damaged_files.py",
            "tests/data/test_data_links.py", "tests/data/test_cache_mutants.py"),
           ("-m", "not slow")),
    # (session 42) what a run reports: summary.json (an outside contract: the keys users' scripts read, the privacy
    # budget the run spent), the metrics line's spread of the clients' accuracies and its loss parts, the lines of
    # client_metrics.jsonl, the first diverged round
    Target("engine_summary", "src/hetfl/engine/summary.py",
           ("tests/engine/test_engine.py", "tests/engine/test_scale.py", "tests/test_first_day.py",
            "tests/engine/test_ledger.py", "tests/engine/test_privacy_participation.py",
            "tests/engine/test_summary_mutants.py"),
           ("-m", "not slow")),
    # (session 42) the configuration's refusals: each section's checks and those across sections, a --set that is
    # not KEY=VALUE, a section given a value, a file that is not UTF-8 TOML or is a preset; each names the key, the
    # value and what is allowed
    Target("config", "src/hetfl/config.py",
           ("tests/test_config.py", "tests/test_bad_input.py", "tests/test_cli_errors.py",
            "tests/test_config_mutants.py"), ("-m", "not slow")),
    # (session 42) a run's set-up before anything runs: the device (an index past the machine's GPUs, CUDA absent,
    # HETFL_DEVICE), what ``auto`` stands for, the method's filled-in defaults, a resume's configuration changes
    # (a checkpoint's configuration read through today's defaults), a model that cannot take the data.
    # build_partition (config keys handed to make_partition) is target engine_setup_partition
    Target("engine_setup", "src/hetfl/engine/setup.py",
           ("tests/engine/test_engine.py", "tests/engine/test_former_settings.py", "tests/test_bad_input.py",
            "tests/engine/test_run_identity.py", "tests/engine/test_setup_mutants.py"), ("-m", "not slow"),
           functions=("pick_device", "vmap_clients", "auto_model", "resolve", "config_changes",
                      "check_method_fits_model", "model_fits_data")),
    # (session 42) the partition's settings: every data. key handed to make_partition, with the labels, the groups
    # and the run's partition seed
    Target("engine_setup_partition", "src/hetfl/engine/setup.py",
           ("tests/data/test_partition_groups.py", "tests/engine/test_setup_mutants.py"), ("-m", "not slow"),
           functions=("build_partition",)),
    # (session 42) what overwrite=True deletes: only a folder holding a hetfl run (or nothing), only hetfl's own
    # files, nothing while a file of the user's is there, and the privacy releases a deleted ledger recorded said
    # first; the refusals that name resume=True and overwrite=True
    Target("runs", "src/hetfl/runs.py",
           ("tests/test_api.py", "tests/engine/test_run_dir_safety.py", "tests/test_privacy_edges.py",
            "tests/test_runs_mutants.py"),
           ("-m", "not slow"),
           functions=("holds_run", "clear_run_dir", "warn_spent_releases", "_shown", "unfinished_error",
                      "state_or_overwrite_hint")),
    # (session 43) CCVR's calibration step (its Algorithm 1's last line, shared by the post-hoc steps): SGD with
    # momentum and weight decay of the classifier on fixed (virtual) features, the step's own random stream
    Target("posthoc", "src/hetfl/algorithms/posthoc.py",
           ("tests/algorithms/test_ccvr_math.py", "tests/algorithms/test_ccvr.py",
            "tests/algorithms/test_ccvr_side_studies.py"),
           ("-m", "not slow and not processes", *E2E_CCVR), functions=("retrain_classifier", "stream")),
    # (session 43) FedBR's pseudo-data (sec. 4.3, random sample means): the authors' draws in their order, each
    # client's means of the slots the plan gives it, the server's assembly and its refusals, the proxy means
    Target("pseudo_data", "src/hetfl/algorithms/pseudo_data.py",
           ("tests/algorithms/test_fedbr.py", "tests/algorithms/test_fedbr_mutants.py"),
           ("-m", "not slow and not processes")),
    # (session 43) the seed papers' networks as in the authors' code (FedPAC's CNN, FedUV's 10-layer CNN, FedBR's
    # RotatedMNIST CNN, the ResNets): the forwards against the authors' modules, parameter counts, the options'
    # refusals
    Target("paper_cnns", "src/hetfl/models/paper_cnns.py", MODEL_TESTS, ("-m", "not slow and not processes")),
    Target("resnet", "src/hetfl/models/resnet.py", MODEL_TESTS, ("-m", "not slow and not processes")),
    # (session 43) the other networks of the papers' tables: the small CNNs (cnn2, MOON's, ...), VGG, MobileNetV2
    Target("cnn", "src/hetfl/models/cnn.py", MODEL_TESTS, ("-m", "not slow and not processes")),
    Target("vgg", "src/hetfl/models/vgg.py", MODEL_TESTS, ("-m", "not slow and not processes")),
    Target("mobilenet", "src/hetfl/models/mobilenet.py", MODEL_TESTS, ("-m", "not slow and not processes")),
    # (session 43) the bf16 weight copies a low-precision step reads (which weights, the casts' gradients, the
    # copies refreshed after each update): against autocast's round, bit for bit
    Target("low_precision", "src/hetfl/models/low_precision.py", ("tests/engine/test_low_precision.py",),
           ("-m", "not slow and not processes")),
    # (session 43) the run's random streams: each stream's seed from (seed, purpose, coordinates), pinned (a resumed
    # run re-derives them); a round's clients and the most rounds any client is asked in (privacy budgets)
    Target("rng", "src/hetfl/rng.py",
           ("tests/test_rng_mutants.py", "tests/algorithms/test_schedule_mutants.py",
            "tests/engine/test_privacy_participation.py"), ("-m", "not slow and not processes")),
)


def extra_tests(target: Target) -> tuple[str, ...]:
    """Test files written for a target beyond its main one (``tests/algorithms/test_<name>_*.py``,
    ``test_baseline_math.py``, and ``test_baseline_rounds.py``: whole rounds recomputed by hand)."""
    tests = REPO / "tests" / "algorithms"
    found = sorted(str(p.relative_to(REPO)) for p in tests.glob(f"test_{target.name}_*.py"))
    module = target.source.split("/")[-1].removesuffix(".py")
    if module in {"fedprox", "fedavgm", "scaffold", "feddyn", "fednova", "moon"}:
        found += [str(p.relative_to(REPO)) for p in tests.glob("test_baseline_math.py")]
    if module in {"fedprox", "fedavgm", "scaffold", "feddyn", "fednova", "moon", "freeze", "feddecorr",
                  "logit_adjust", "classifier_reg"}:
        found += [str(p.relative_to(REPO)) for p in tests.glob("test_baseline_rounds.py")]
    return tuple(t for t in found if t not in target.tests)


def check_deselected(target: Target) -> None:
    """Every ``--deselect FILE::TEST`` of a target names a test that exists: a renamed test would otherwise be
    run on every mutant (or break mutmut's first, unmutated run) without a word."""
    args = list(target.pytest_args)
    for flag, value in itertools.pairwise(args):
        if flag != "--deselect":
            continue
        path, _, name = value.partition("::")
        source = (REPO / path).read_text(encoding="utf-8") if (REPO / path).exists() else ""
        if not re.search(rf"^def {re.escape(name.split('[')[0])}\(", source, flags=re.MULTILINE):
            raise SystemExit(f"{target.name}: --deselect {value}: no such test (renamed?); "
                             "update benchmarks/mutation.py")


def prepare(target: Target, workdir: Path) -> None:
    """A scratch copy of the repository whose pyproject mutates only ``target.source``."""
    check_deselected(target)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    for name in ("src", "tests", "configs", "examples"):  # examples: tests load the deployment scripts
        shutil.copytree(REPO / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # read by tests of its examples; mutmut copies it, configs/ (the presets) and examples/ beside the tests
    # (also_copy)
    shutil.copy2(REPO / "README.md", workdir / "README.md")
    shared = REPO.parent / "shared"
    if shared.exists():  # tests find ../shared relative to their own folder, which mutmut moves into mutants/
        (workdir / "shared").symlink_to(shared)
    tests = [*target.tests, *extra_tests(target)]
    # --run-slow: a target's tests as listed (plain pytest leaves out those marked slow; a target that does not
    # want them says -m "not slow")
    args = ["-q", "-p", "no:cacheprovider", "-x", "--run-slow", *target.pytest_args]
    section = (
        "\n[tool.mutmut]\n"
        'source_paths = ["src/hetfl"]\n'
        f'only_mutate = ["{target.source}"]\n'
        'also_copy = ["README.md", "configs", "examples"]\n'
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        f"pytest_add_cli_args = {json.dumps(args)}\n"
        'process_isolation = "forkserver"\n'
    )
    (workdir / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text() + section)


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_target(target: Target, workdir: Path, children: int) -> dict:
    prepare(target, workdir)
    started = dt.datetime.now()
    proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children),
                           *target.mutant_globs()], cwd=workdir, env=ENV, capture_output=True, text=True)
    seconds = (dt.datetime.now() - started).total_seconds()
    meta_path = workdir / "mutants" / (target.source + ".meta")
    if proc.returncode != 0 or not meta_path.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"mutmut failed on {target.source} (exit {proc.returncode}):\n{tail}")
    return collect_target(target, workdir, seconds)


def collect_target(target: Target, workdir: Path, seconds: float | None = None) -> dict:
    """The statuses of a target's mutants from mutmut's files in ``workdir`` (a run finished there)."""
    meta_path = workdir / "mutants" / (target.source + ".meta")
    if not meta_path.exists():
        raise SystemExit(f"--collect-only: no finished mutmut run of {target.name} in {workdir} "
                         f"({meta_path.name} missing); run it without --collect-only first")
    codes = json.loads(meta_path.read_text())["exit_code_by_key"]
    if target.functions:  # the mutants of the target's functions only (the file's others are not its)
        codes = {k: c for k, c in codes.items() if any(fnmatch.fnmatch(k, g) for g in target.mutant_globs())}
    statuses = {key: STATUS.get(code, "suspicious") for key, code in codes.items()}
    survivors = sorted(k for k, s in statuses.items() if s == "survived")
    diffs = []
    for key in survivors:
        shown = subprocess.run([sys.executable, "-m", "mutmut", "show", key], cwd=workdir, env=ENV,
                               capture_output=True, text=True)
        diffs.append(shown.stdout.strip())
    counts: dict[str, int] = {}
    for s in statuses.values():
        counts[s] = counts.get(s, 0) + 1
    killed, total = counts.get("killed", 0), len(statuses)
    checked = total - counts.get("not checked", 0) - counts.get("no tests", 0)
    return {"target": target.name, "source": target.source, "tests": [*target.tests, *extra_tests(target)],
            "mutants": total, "counts": counts, "survivors": survivors, "diffs": diffs,
            "kill_rate": killed / checked if checked else None,
            "seconds": None if seconds is None else round(seconds, 1)}


#: kinds of explained survivors, by the ``## `` heading they are listed under in ``<target>.equivalent.md``:
#: a heading ending in "(rounding)" holds mutants equal in exact arithmetic that change only floating-point
#: rounding (a test telling them apart would pin the last bits, which differ between CPUs); "(CUDA)" holds
#: mutants observable only on a CUDA device, killed by tests skipped without one; "(killed by hand)" holds survivors
#: of the target's last run that a test written since kills (checked by applying the mutation by hand), until the
#: target is run again. Bullets above any such heading are equivalent: no input tells them apart.
KINDS = {"(rounding)": "rounding_only", "(CUDA)": "cuda_only", "(killed by hand)": "killed_by_hand"}


def listed_survivors(name: str) -> dict[str, set[str]]:
    """Mutant names explained in ``<name>.equivalent.md`` (each a backticked name opening a ``-`` or ``*``
    list line), by kind: ``equivalent``, ``rounding_only``, ``cuda_only``, ``killed_by_hand`` (see :data:`KINDS`)."""
    listed: dict[str, set[str]] = {"equivalent": set(), **{kind: set() for kind in KINDS.values()}}
    path = RESULTS / f"{name}.equivalent.md"
    if not path.exists():
        return listed
    kind = "equivalent"
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            kind = next((k for tag, k in KINDS.items() if line.rstrip().endswith(tag)), "equivalent")
        found = re.match(r"^[-*] `([^`]+__mutmut_\d+)`", line)
        if found:
            listed[kind].add(found.group(1))
    return listed


def write_results(results: dict[str, dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    for r in results.values():
        kinds = listed_survivors(r["target"])
        listed = set().union(*kinds.values())
        for kind, names in kinds.items():
            r[kind] = sorted(names & set(r["survivors"]))
        r["unexplained"] = sorted(set(r["survivors"]) - listed)
        r["listed_not_surviving"] = sorted(listed - set(r["survivors"]))
    for name, r in results.items():
        text = f"# surviving mutants of {r['source']} (tests: {', '.join(r['tests'])})\n\n"
        (RESULTS / f"{name}.survivors.txt").write_text(text + "\n\n".join(r["diffs"]) + "\n")
    summary = {name: {k: v for k, v in r.items() if k != "diffs"} for name, r in results.items()}
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
            "date": dt.date.today().isoformat(), "command": "python benchmarks/mutation.py"}
    (RESULTS / "summary.json").write_text(json.dumps({"meta": meta, "targets": summary}, indent=2) + "\n")
    lines = ["# Mutation testing (mutmut): kill rate per file", "",
             f"Command: `{meta['command']}` ({meta['date']}, {meta['machine']}). A mutant is killed when one "
             "of the target's tests fails on it. Survivors are listed, with their diffs, in "
             "`<target>.survivors.txt` and explained in `<target>.equivalent.md`: 'equivalent' (no input tells them "
             "apart), 'rounding only' (equal in exact arithmetic; they change only floating-point rounding, which a "
             "test could pin only bit for bit, and the last bits differ between CPUs), 'CUDA only' (observable "
             "only on a CUDA device, killed by tests that are skipped without one), 'killed by hand' (survivors of "
             "the target's last run that a test written since kills, checked by applying the mutation by hand; "
             "counted as survivors until the target is run again); 'unexplained' survivors are neither killed nor "
             "explained.", "",
             "| file | tests | mutants | killed | survived | equivalent | rounding only | CUDA only | killed by hand "
             "| unexplained | other | kill rate | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary.values():
        c = r["counts"]
        other = r["mutants"] - c.get("killed", 0) - c.get("survived", 0)
        rate = "-" if r["kill_rate"] is None else f"{100 * r['kill_rate']:.1f}%"
        secs = "-" if r["seconds"] is None else r["seconds"]
        lines.append(f"| `{r['source']}` | {', '.join(f'`{t}`' for t in r['tests'])} | {r['mutants']} | "
                     f"{c.get('killed', 0)} | {c.get('survived', 0)} | {len(r['equivalent'])} | "
                     f"{len(r.get('rounding_only', []))} | {len(r.get('cuda_only', []))} | "
                     f"{len(r.get('killed_by_hand', []))} | {len(r['unexplained'])} | {other} | {rate} | {secs} |")
    stale = {n: r["listed_not_surviving"] for n, r in summary.items() if r["listed_not_surviving"]}
    if stale:
        lines += ["", "Listed as equivalent but no longer surviving (killed since, or renamed): "
                  + "; ".join(f"{n}: {', '.join(v)}" for n, v in stale.items())]
    (RESULTS / "mutation.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="target name (repeatable); default: all")
    parser.add_argument("--children", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="mutants tested at once")
    parser.add_argument("--workdir", type=Path, default=REPO.parent / ".hetfl-mutation",
                        help="scratch folder for the copies (removed per target before use)")
    parser.add_argument("--tabulate-only", action="store_true",
                        help="run nothing: rewrite mutation.md and summary.json from the recorded results and "
                             "the current <target>.equivalent.md files")
    parser.add_argument("--collect-only", action="store_true",
                        help="do not run mutmut: tabulate the runs already finished in --workdir")
    args = parser.parse_args(argv)
    names = {t.name for t in TARGETS}
    unknown = set(args.only or []) - names
    if unknown:
        parser.error(f"--only {sorted(unknown)}: unknown; targets are {', '.join(sorted(names))}")
    chosen = [] if args.tabulate_only else [t for t in TARGETS if not args.only or t.name in args.only]
    old = RESULTS / "summary.json"
    results: dict[str, dict] = {}
    if old.exists():  # keep other targets' earlier results when re-running some
        for name, r in json.loads(old.read_text())["targets"].items():
            survivors_file = RESULTS / f"{name}.survivors.txt"
            diffs = survivors_file.read_text().split("\n\n")[1:] if survivors_file.exists() else []
            results[name] = {**r, "diffs": [d.strip() for d in diffs if d.strip()]}
    for target in chosen:
        print(f"{target.name}: {'collecting' if args.collect_only else 'mutating'} {target.source} ...", flush=True)
        workdir = args.workdir / target.name
        if args.collect_only:  # the seconds of the run that made the statuses, when recorded
            earlier = results.get(target.name, {}).get("seconds")
            results[target.name] = r = collect_target(target, workdir, earlier)
        else:
            results[target.name] = r = run_target(target, workdir, args.children)
        print(f"  {r['mutants']} mutants, {r['counts']}, {r['seconds']} s", flush=True)
    order = [t.name for t in TARGETS]
    write_results({n: results[n] for n in order if n in results})
    print(f"results: {RESULTS / 'mutation.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
