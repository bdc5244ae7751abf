"""What cannot fit in memory is refused before it is allocated (hetfl.engine.resources), checked on the estimates
themselves: in-process, against an explicit amount of memory, so that nothing here ever allocates what it
estimates. (tests/test_bad_input.py runs the whole command line on the same cases in a capped child process.)"""

from __future__ import annotations

import math
import resource

import numpy as np
import pytest
import torch

from hetfl import config
from hetfl.data.datasets import checked_options, dataset_options
from hetfl.engine import resources
from hetfl.params import ConfigError

GIB8 = 8 * 2**30

#: the cases of test_bad_input.MEMORY_CASES that the configuration alone decides (the methods' own state is
#: Algorithm.memory_needs'), and the key each refusal must name
CONFIG_CASES = {
    "data.options={num_devices = 1000000000}": "data.options.num_devices",
    "data.options={dim = 1000000000}": "data.options.dim",
    "model.options={hidden = [1000000000]}": "model.options",
    "train.local_steps=1000000000000": "train.local_steps",
    "data.partition=dominant; data.dominant_groups=1000000000": "data.dominant_groups",
}


def estimates(overrides: list[str], vmap: bool = False) -> list[resources.Need]:
    """The configuration's estimates and its model's host copies on the CPU, as Experiment checks them."""
    cfg = config.load(None, ["model.name=mlp", *overrides])  # "auto" is resolved with the dataset: mlp here
    known = resources.known_dataset(cfg.data.dataset, cfg.data.options)
    host, _ = resources.model_needs(cfg.model.name, cfg.model.options, known.input_shape, known.num_classes,
                                    torch.device("cpu"))
    return resources.config_estimates(cfg, vmap) + host


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_each_oversized_setting_is_refused_naming_its_key_on_8_gib(case):
    with pytest.raises(ConfigError) as err:
        resources.require(estimates(case.split("; ")), available=GIB8)
    message = str(err.value)
    assert message.startswith(CONFIG_CASES[case] + " = "), message
    assert "GB of memory" in message and "more than the 8.6 GB available on this machine; lower it" in message


def test_the_default_run_fits_in_8_gib_with_room_to_spare():
    needs = estimates([])
    assert sum(n[2] for n in needs) < 0.01 * GIB8
    resources.require(needs, available=GIB8)


# ------------------------------------------------------------------ the refusal
def test_a_total_equal_to_what_is_available_fits_and_one_byte_more_does_not():
    needs = [("a.key", 1, 600, "a"), ("b.key", 2, 400, "b")]
    resources.require(needs, available=1000)
    with pytest.raises(ConfigError, match=r"^a\.key = 1: a needs about 0\.0 MB"):
        resources.require(needs, available=999)


def test_the_largest_need_is_named_and_the_rest_counted_when_it_is_large():
    needs = [("small.key", 3, int(0.2e9), "the small one"), ("big.key", 7, int(3e9), "the big one")]
    with pytest.raises(ConfigError) as err:
        resources.require(needs, available=int(1e9))
    assert str(err.value) == ("big.key = 7: the big one needs about 3.0 GB of memory (with 0.2 GB more for the "
                              "rest), more than the 1.0 GB available on this machine; lower it")


def test_a_rest_under_50_mb_is_not_mentioned_and_sizes_under_100_mb_are_in_mb():
    needs = [("small.key", 3, int(0.04e9), "the small one"), ("big.key", 7, int(0.09e9), "the big one")]
    with pytest.raises(ConfigError) as err:
        resources.require(needs, available=int(0.095e9))
    assert str(err.value) == ("big.key = 7: the big one needs about 90.0 MB of memory, more than the 95.0 MB "
                              "available on this machine; lower it")
    with pytest.raises(ConfigError, match=r"about 40\.0 MB of memory \(with 50\.0 MB more for the rest\)"):
        resources.require([("a", 1, int(0.04e9), "x"), ("b", 1, int(0.03e9), "y"), ("c", 1, int(0.02e9), "z")],
                          available=int(0.05e9))


def test_needs_without_bytes_are_ignored_and_unknown_memory_refuses_nothing(monkeypatch):
    resources.require([("a", 1, 0, "x"), ("b", 1, -1, "y")], available=0)
    resources.require([("a", 1, 10**18, "x")], available=None)
    monkeypatch.setattr(resources, "available_memory", lambda: None)
    resources.require([("a", 1, 10**18, "x")])
    monkeypatch.setattr(resources, "available_memory", lambda: 10)
    with pytest.raises(ConfigError, match="more than the 0.0 MB available"):
        resources.require([("a", 1, 11, "x")])


# ------------------------------------------------------------------ what is available
def test_available_memory_is_the_least_of_ram_and_swap_the_cgroup_and_the_rlimits(monkeypatch):
    monkeypatch.setattr(resources, "_meminfo", lambda: {"MemAvailable": 5000, "SwapFree": 1000})
    cgroup = {"/sys/fs/cgroup/memory.max": None, "/sys/fs/cgroup/memory/memory.limit_in_bytes": None}
    monkeypatch.setattr(resources, "_read_int", cgroup.get)
    limits = {resource.RLIMIT_AS: resource.RLIM_INFINITY, resource.RLIMIT_DATA: resource.RLIM_INFINITY}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits[which], resource.RLIM_INFINITY))
    monkeypatch.setattr(resources, "_process_vm", {"VmSize": 700, "VmData": 300}.get)
    assert resources.available_memory() == 6000
    cgroup["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = 2**62  # v1's "no limit"
    assert resources.available_memory() == 6000
    cgroup["/sys/fs/cgroup/memory.max"] = 4000
    assert resources.available_memory() == 4000
    limits[resource.RLIMIT_AS] = 3700  # 3,000 left above the process's 700
    assert resources.available_memory() == 3000
    limits[resource.RLIMIT_DATA] = 2300  # 2,000 above its 300 of data
    assert resources.available_memory() == 2000
    limits[resource.RLIMIT_DATA] = 200  # already past it: nothing left
    assert resources.available_memory() == 0


def test_without_meminfo_the_physical_pages_count_and_without_anything_nothing_is_known(monkeypatch):
    monkeypatch.setattr(resources, "_meminfo", dict)
    monkeypatch.setattr(resources, "_read_int", lambda path: None)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    pages = {"SC_AVPHYS_PAGES": 10, "SC_PHYS_PAGES": 20, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(resources.os, "sysconf", pages.__getitem__)
    assert resources.available_memory() == 10 * 4096

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(resources.os, "sysconf", no_sysconf)
    assert resources.available_memory() is None


# ------------------------------------------------------------------ the estimates
def test_a_synthetic_devices_mean_samples_match_the_power_law_it_is_drawn_from():
    """``E[min(floor(L) + 50, max_samples)]``, ``L ~ lognormal(4, 2)``, against 2 million draws (the floor, ignored
    by the estimate, is half a sample)."""
    draws = np.random.default_rng(0).lognormal(4.0, 2.0, 2_000_000)
    for cap in (0, 60, 300, 1250, 10_000):
        samples = np.floor(draws) + 50
        if cap:
            samples = np.minimum(samples, cap)
        assert resources.expected_device_samples(cap) == pytest.approx(samples.mean() + 0.5, rel=0.02), cap
    assert resources.expected_device_samples(40) == 40.0  # a cap at or below the floor of 50: every device at it
    assert resources.expected_device_samples(50) == 50.0


def test_synthetic_bytes_count_the_features_labels_index_temporaries_and_devices():
    options = {"num_devices": 100, "dim": 60, "num_classes": 10, "max_samples": 0}
    samples = 100 * resources.expected_device_samples(0)
    data = samples * (4 * 60 + 16 + 24)
    temporaries = 8 * (2 * 10 * 60 + 3 * 60 + 2 * min(50_000, samples) * 60)
    assert resources.synthetic_bytes(options) == int(data + temporaries + 100 * resources.DEVICE_BYTES)
    capped = {**options, "max_samples": 300}
    samples = 100 * resources.expected_device_samples(300)
    temporaries = 8 * (2 * 10 * 60 + 3 * 60 + 2 * min(300, samples) * 60)
    assert resources.synthetic_bytes(capped) == int(samples * 280 + temporaries + 100 * resources.DEVICE_BYTES)


def test_image_datasets_are_sized_from_their_options():
    cifar = resources.known_dataset("cifar10", {})
    assert (cifar.input_shape, cifar.num_classes, cifar.samples, cifar.nbytes) == ((3, 32, 32), 10, 60_000,
                                                                                 60_000 * 3 * 32 * 32)
    small = resources.known_dataset("pacs", {"image_size": 32})
    assert (small.input_shape, small.num_classes, small.samples) == ((3, 32, 32), 7, 9_991)
    letters = resources.known_dataset("emnist", {"split": "letters"})
    assert (letters.input_shape, letters.samples) == ((1, 28, 28), 145_600)
    synthetic = resources.known_dataset("synthetic", {"num_devices": 10, "dim": 20, "num_classes": 4})
    assert synthetic.input_shape == (20,) and synthetic.num_classes == 4
    assert synthetic.samples == int(10 * resources.expected_device_samples(dataset_options("synthetic")["max_samples"]))
    assert resources.known_dataset("imagefolder", {}) is None  # the first image decides its side


def test_the_dataset_is_blamed_on_the_option_whose_default_shrinks_it_most():
    needs = resources.dataset_needs("synthetic", {"num_devices": 10**6, "dim": 200})
    assert [(key, value) for key, value, _, _ in needs] == [("data.options.num_devices", 10**6)]
    needs = resources.dataset_needs("synthetic", {"num_devices": 40, "dim": 10**5})
    assert [(key, value) for key, value, _, _ in needs] == [("data.options.dim", 10**5)]
    needs = resources.dataset_needs("cifar10", {})
    assert needs == [("data.dataset", "cifar10", 60_000 * 3 * 32 * 32, "the cifar10 data")]
    assert resources.dataset_needs("imagefolder", {}) == []


def test_step_plans_are_sized_per_step_or_per_epoch_of_the_largest_client():
    plan = resources.plan_bytes
    assert plan(50, 1, 32, [500, 20], clients=1) == 50 * (resources.STEP_BYTES + 8 * 32)
    assert plan(50, 1, 32, [10], clients=3) == 3 * 50 * (resources.STEP_BYTES + 8 * 10)
    assert plan(50, 1, 32, None, clients=0) == 50 * resources.STEP_BYTES  # before the partition: the views
    assert plan(0, 4, 32, [100, 500], clients=2) == 2 * 4 * (8 * 500 + resources.STEP_BYTES * math.ceil(500 / 32))
    train = config.load(None, ["train.local_steps=7", "train.batch_size=4"]).train
    assert resources.plan_need(train, [9], 2) == ("train.local_steps", 7, 2 * 7 * (resources.STEP_BYTES + 32),
                                                  "the local step plan")
    train = config.load(None, ["train.local_epochs=3", "train.batch_size=4"]).train
    assert resources.plan_need(train, [9], 1) == ("train.local_epochs", 3, 3 * (72 + 3 * resources.STEP_BYTES),
                                                  "the local step plan")


def test_vmapped_clients_hold_their_plans_together_a_chunk_at_a_time():
    cfg = config.load(None, ["data.num_clients=40", "train.clients_per_round=12"])
    assert resources.clients_at_once(cfg, vmap=False) == 1
    assert resources.clients_at_once(cfg, vmap=True) == 12
    assert resources.clients_at_once(config.load(None, ["data.num_clients=40"]), vmap=True) == 40
    chunked = config.load(None, ["data.num_clients=40", "train.clients_per_round=12", "runtime.chunk_size=5"])
    assert resources.clients_at_once(chunked, vmap=True) == 5
    steps = ["data.num_clients=40", "train.local_steps=1000000000"]
    one, all_ = (resources.config_estimates(config.load(None, steps), vmap)[-1][2] for vmap in (False, True))
    assert all_ == 40 * one


def test_the_model_is_counted_on_the_meta_device_and_its_copies_placed_by_device():
    count = resources.count_parameters("mlp", (60,), 10, {"hidden": [10**9]})
    assert count == 60 * 10**9 + 10**9 + 10**9 * 10 + 10
    host, device = resources.model_needs("mlp", {"hidden": [8]}, (60,), 10, torch.device("cpu"))
    assert host == [("model.options", {"hidden": [8]}, 4 * 578 * resources.MODEL_COPIES, "the model mlp (578 "
                     "parameters)")] and device == []
    host, device = resources.model_needs("cnn2", {}, (3, 32, 32), 10, torch.device("cuda"))
    count = resources.count_parameters("cnn2", (3, 32, 32), 10, {})
    assert host == [("model.name", "cnn2", 4 * count, f"the model cnn2 ({count:,} parameters)")]
    assert device == [("model.name", "cnn2", 4 * count * resources.MODEL_COPIES, f"the model cnn2 ({count:,} "
                       "parameters)")]


def test_a_model_the_meta_device_cannot_build_is_not_estimated(monkeypatch):
    monkeypatch.setattr(resources, "meta_model", lambda *args: None)
    assert resources.count_parameters("mlp", (60,), 10, {}) == -1
    assert resources.model_needs("mlp", {}, (60,), 10, torch.device("cpu")) == ([], [])


def test_the_dominant_partitions_group_lists_are_estimated_unless_given():
    data = config.load(None, ["data.partition=dominant", "data.dominant_groups=100",
                              "data.classes_per_group=4"]).data
    assert resources.partition_needs(data) == [("data.dominant_groups", 100, 100 * (64 + 32),
                                                "the dominant partition's groups")]
    given = config.load(None, ["data.partition=dominant", "data.group_classes=[[0, 1], [2, 3]]"]).data
    assert resources.partition_needs(given) == []
    assert resources.partition_needs(config.load(None, []).data) == []


def test_the_checks_refuse_on_the_memory_this_process_has(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 10**6)
    cfg = config.load(None, ["train.local_steps=1000000"])
    with pytest.raises(ConfigError, match=r"^train\.local_steps = 1000000: the local step plan"):
        resources.check_config(cfg)
    with pytest.raises(ConfigError, match=r"^train\.local_steps = 1000000: the local step plan"):
        resources.check_plan(cfg, [500], vmap=False)
    resources.check_plan(config.load(None, ["train.local_steps=10"]), [500], vmap=False)
    wide, narrow = (config.load(None, ["model.name=mlp", f"model.options={{hidden = [{h}]}}"]) for h in (100000, 8))
    with pytest.raises(ConfigError, match=r"^model\.options = \{'hidden': \[100000\]\}: the model mlp"):
        resources.check_model(wide, (60,), 10, torch.device("cpu"))
    resources.check_model(narrow, (60,), 10, torch.device("cpu"))
    assert resources.device_memory(torch.device("cpu")) is None


# ------------------------------------------------------------------ reading the system's files
class FakeFiles:
    """``resources.Path`` over a dict of path -> text (a path not in it: FileNotFoundError)."""

    def __init__(self, files: dict[str, str]):
        self.files = files

    def __call__(self, path):
        files = self.files

        class _Path:
            def read_text(self) -> str:
                if path not in files:
                    raise FileNotFoundError(path)
                return files[path]

        return _Path()


def test_meminfo_is_read_in_bytes_with_kb_lines_scaled_and_unreadable_lines_skipped(monkeypatch):
    text = ("MemTotal:       16000 kB\nMemAvailable:    8000 kB\nHugePages_Free:      7\nWeird:    abc kB\n"
            "Odd:Name: 5 kB\nEmpty:\n")
    monkeypatch.setattr(resources, "Path", FakeFiles({"/proc/meminfo": text}))
    assert resources._meminfo() == {"MemTotal": 16000 * 1024, "MemAvailable": 8000 * 1024, "HugePages_Free": 7}
    monkeypatch.setattr(resources, "Path", FakeFiles({}))
    assert resources._meminfo() == {}


def test_cgroup_limits_are_integers_and_max_means_none(monkeypatch):
    monkeypatch.setattr(resources, "Path", FakeFiles({"/a": "12345\n", "/b": "max\n"}))
    assert resources._read_int("/a") == 12345
    assert resources._read_int("/b") is None
    assert resources._read_int("/absent") is None


def test_the_process_sizes_come_from_its_status_in_bytes(monkeypatch):
    status = "Name:\tpython\nVmSize:\t  1000 kB\nVmData:\t   300 kB\n"
    monkeypatch.setattr(resources, "Path", FakeFiles({"/proc/self/status": status}))
    assert resources._process_vm("VmSize") == 1000 * 1024
    assert resources._process_vm("VmData") == 300 * 1024
    assert resources._process_vm("VmPeak") == 0
    monkeypatch.setattr(resources, "Path", FakeFiles({}))
    assert resources._process_vm("VmSize") == 0


def test_without_swap_figures_the_available_ram_counts_alone(monkeypatch):
    monkeypatch.setattr(resources, "_meminfo", lambda: {"MemAvailable": 5000})
    monkeypatch.setattr(resources, "_read_int", lambda path: None)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert resources.available_memory() == 5000


def test_a_cgroup_v1_limit_counts_unless_it_is_its_no_limit_number(monkeypatch):
    monkeypatch.setattr(resources, "_meminfo", lambda: {"MemAvailable": 5000, "SwapFree": 0})
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    for v1, expected in ((3000, 3000), (2**60 - 1, 5000), (2**60, 5000), (2**60 + 1, 5000)):
        files = {"/sys/fs/cgroup/memory/memory.limit_in_bytes": v1}
        monkeypatch.setattr(resources, "_read_int", files.get)
        assert resources.available_memory() == expected, v1
    # 2**60 - 1 bytes is an exabyte: "no limit" below that is a limit no machine reaches, the same answer
    monkeypatch.setattr(resources, "_meminfo", lambda: {"MemAvailable": 2**62})
    for v1, expected in ((2**60 - 1, 2**60 - 1), (2**60, 2**62), (2**60 + 1, 2**62)):
        monkeypatch.setattr(resources, "_read_int", {"/sys/fs/cgroup/memory/memory.limit_in_bytes": v1}.get)
        assert resources.available_memory() == expected, v1


def test_without_available_pages_the_physical_pages_count(monkeypatch):
    monkeypatch.setattr(resources, "_meminfo", dict)
    monkeypatch.setattr(resources, "_read_int", lambda path: None)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    monkeypatch.setattr(resources.os, "sysconf_names", {"SC_PHYS_PAGES": 1, "SC_PAGE_SIZE": 2})
    monkeypatch.setattr(resources.os, "sysconf", {"SC_AVPHYS_PAGES": 10, "SC_PHYS_PAGES": 20,
                                                  "SC_PAGE_SIZE": 4096}.__getitem__)
    assert resources.available_memory() == 20 * 4096


# ------------------------------------------------------------------ the estimates, exactly
def lognormal_capped_mean(cap: float) -> float:
    """``E[min(L, cap)]``, ``L = e^Z``, ``Z ~ N(4, 2)``, by the trapezoid rule in ``z`` (error below 1e-6)."""
    z = np.linspace(4 - 2 * 12, 4 + 2 * 12, 2_000_001)
    density = np.exp(-0.5 * ((z - 4) / 2) ** 2) / (2 * math.sqrt(2 * math.pi))
    return float(np.trapezoid(np.minimum(np.exp(z), cap) * density, z))


def test_a_synthetic_devices_mean_is_the_capped_lognormals_mean_plus_50():
    assert resources.expected_device_samples(0) == pytest.approx(math.exp(4 + 2**2 / 2) + 50, rel=1e-12)
    for max_samples in (51, 60, 300, 1250):
        assert resources.expected_device_samples(max_samples) == pytest.approx(
            lognormal_capped_mean(max_samples - 50) + 50, abs=1e-4), max_samples


def test_synthetic_bytes_hold_at_most_50000_samples_of_float64_temporaries():
    options = {"num_devices": 1000, "dim": 60, "num_classes": 10, "max_samples": 0}
    samples = 1000 * resources.expected_device_samples(0)
    assert samples > 50_000
    temporaries = 8 * (2 * 10 * 60 + 3 * 60 + 2 * 50_000 * 60)
    assert resources.synthetic_bytes(options) == int(samples * 280 + temporaries + 1000 * resources.DEVICE_BYTES)


def test_the_synthetic_data_is_sized_as_generated_and_an_option_at_its_default_is_not_blamed():
    options = {"num_devices": 10**6}
    need = resources.dataset_needs("synthetic", options)
    assert need[0][2] == resources.synthetic_bytes(checked_options("synthetic", options))
    default_dim = dataset_options("synthetic")["dim"]
    assert resources.dataset_needs("synthetic", {"dim": default_dim})[0][:2] == ("data.dataset", "synthetic")


def test_grayscale_images_are_sized_with_one_channel():
    assert resources.known_dataset("pacs", {"channels": 1}).input_shape == (1, 96, 96)


def test_a_step_plan_before_any_client_has_samples_is_its_views():
    assert resources.plan_bytes(50, 1, 32, [], clients=1) == 50 * resources.STEP_BYTES


def test_model_sizes_count_buffers_and_a_model_of_one_number_still_counts(monkeypatch):
    from hetfl.models import build_model

    model = build_model("resnet18", (3, 32, 32), 10)
    buffers = sum(b.numel() for b in model.buffers())
    assert buffers > 0
    assert resources.count_parameters("resnet18", (3, 32, 32), 10, {}) == (
        sum(p.numel() for p in model.parameters()) + buffers)
    monkeypatch.setattr(resources, "count_parameters", lambda *args: 1)
    assert resources.model_needs("mlp", {}, (60,), 10, torch.device("cpu"))[0][0][2] == 4 * resources.MODEL_COPIES
    monkeypatch.setattr(resources, "count_parameters", lambda *args: 0)
    assert resources.model_needs("mlp", {}, (60,), 10, torch.device("cpu")) == ([], [])


def test_an_accelerators_memory_is_its_total_and_the_cpu_has_none(monkeypatch):
    asked = []

    class Properties:
        total_memory = 80 * 2**30

    def properties(device):
        asked.append(device)
        return Properties()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert resources.device_memory(torch.device("cuda", 1)) == 80 * 2**30
    assert asked == [torch.device("cuda", 1)]
    assert resources.device_memory(torch.device("cpu")) is None
    assert asked == [torch.device("cuda", 1)]


def test_the_checks_count_vmapped_clients_only_when_asked(monkeypatch):
    cfg = config.load(None, ["data.num_clients=40", "train.local_steps=100000", "train.batch_size=1"])
    one = resources.plan_bytes(100000, 1, 1, None, clients=1)
    assert resources.config_estimates(cfg)[-1][2] == one
    total = sum(need[2] for need in resources.config_estimates(cfg))  # the synthetic data and one plan
    monkeypatch.setattr(resources, "available_memory", lambda: total + one)
    resources.check_config(cfg)
    with pytest.raises(ConfigError, match=r"^train\.local_steps = 100000"):
        resources.check_config(cfg, vmap=True)
    with_samples = resources.plan_bytes(100000, 1, 1, [500], clients=1)
    monkeypatch.setattr(resources, "available_memory", lambda: 2 * with_samples)
    resources.check_plan(cfg, [500], vmap=False)
    with pytest.raises(ConfigError, match=r"^train\.local_steps = 100000"):
        resources.check_plan(cfg, [500], vmap=True)


def test_an_epoch_plan_is_checked_on_the_clients_sizes(monkeypatch):
    cfg = config.load(None, ["train.local_epochs=100000", "train.batch_size=1"])
    monkeypatch.setattr(resources, "available_memory", lambda: 10**6)
    resources.check_plan(cfg, [], vmap=False)
    with pytest.raises(ConfigError, match=r"^train\.local_epochs = 100000: the local step plan"):
        resources.check_plan(cfg, [500], vmap=False)


def test_a_model_that_fits_the_host_but_not_the_accelerator_is_refused_on_the_accelerators_memory(monkeypatch):
    cfg = config.load(None, ["model.name=mlp", "model.options={hidden = [1000]}"])
    count = resources.count_parameters("mlp", (60,), 10, {"hidden": [1000]})
    asked = []

    def device_memory(device):
        asked.append(device)
        return 2 * 4 * count  # two copies of the four
    monkeypatch.setattr(resources, "available_memory", lambda: 10**12)
    monkeypatch.setattr(resources, "device_memory", device_memory)
    with pytest.raises(ConfigError, match=r"^model\.options = \{'hidden': \[1000\]\}: the model mlp .* more than "
                                          r"the 0\.6 MB available"):
        resources.check_model(cfg, (60,), 10, torch.device("cuda", 0))
    assert asked == [torch.device("cuda", 0)]


def test_one_byte_is_a_need_and_sizes_switch_to_gb_at_exactly_100_mb():
    with pytest.raises(ConfigError, match="needs about 0.0 MB"):
        resources.require([("a", 1, 1, "x")], available=0)
    assert resources._size(100_000_000) == "0.1 GB"
    assert resources._size(99_999_999) == "100.0 MB"
    assert resources._size(12_350_001) == "12.4 MB"
