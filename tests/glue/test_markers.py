"""cuda / rocm / gpus(n) / distributed(num_gpus=N) markers: registration and skips under a simulated
or forced inventory, so the outcome does not depend on the machine running the tests."""

from __future__ import annotations

import pytest

from pytest_pdserve.glue.markers import Requirement, skip_reason
from pytest_pdserve.machine.inventory import Gpu, Inventory

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

MARKED_TESTS = """
import pytest

@pytest.mark.cuda
def test_cuda(): pass

@pytest.mark.rocm
def test_rocm(): pass

@pytest.mark.gpus(1)
def test_one(): pass

@pytest.mark.gpus(n=2)
def test_two(): pass

@pytest.mark.distributed(num_gpus=2)
def test_distributed_two(): pass

@pytest.mark.distributed
def test_distributed_label(): pass

@pytest.mark.cuda
@pytest.mark.rocm
def test_either(): pass

def test_plain(): pass
"""


def outcomes(pytester: pytest.Pytester, *args: str) -> dict[str, str]:
    """Run the inner session in-process; test name -> "PASSED" or the skip reason."""
    reprec = pytester.inline_run("--strict-markers", *args)
    out: dict[str, str] = {}
    for rep in reprec.getreports("pytest_runtest_logreport"):
        name = rep.nodeid.split("::")[-1]
        if rep.skipped:
            assert isinstance(rep.longrepr, tuple)
            out[name] = rep.longrepr[2].removeprefix("Skipped: ")
        elif rep.when == "call" and rep.passed:
            out[name] = "PASSED"
    return out


def passed(got: dict[str, str]) -> set[str]:
    return {k for k, v in got.items() if v == "PASSED"}


def test_skips_under_one_simulated_cuda_gpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MARKED_TESTS)
    got = outcomes(pytester, "--pd-simulate-gpus=cuda:1")
    assert passed(got) == {
        "test_cuda",
        "test_one",
        "test_distributed_label",
        "test_either",
        "test_plain",
    }
    sim = "simulated via --pd-simulate-gpus=cuda:1"
    assert got["test_rocm"] == f"needs platform rocm, this machine is cuda ({sim})"
    assert got["test_two"] == f"needs 2 GPUs, 1 visible (cuda, {sim})"
    assert got["test_distributed_two"] == f"needs 2 GPUs, 1 visible (cuda, {sim})"


def test_markers_on_a_module_or_class_apply_to_each_of_its_tests(pytester: pytest.Pytester) -> None:
    """The skip check walks each item's parents once per collection (collection cost, issue 27): a marker on the
    module or the class still reaches every test under it, and a sibling module without one is untouched."""
    pytester.makepyfile(
        test_mod="import pytest\n\npytestmark = pytest.mark.gpus(2)\n\ndef test_a(): pass\n\ndef test_b(): pass\n",
        test_cls="import pytest\n\n@pytest.mark.rocm\nclass TestR:\n    def test_c(self): pass\n\n"
        "def test_free(): pass\n",
    )
    got = outcomes(pytester, "--pd-simulate-gpus=cuda:1")
    sim = "simulated via --pd-simulate-gpus=cuda:1"
    assert got == {
        "test_a": f"needs 2 GPUs, 1 visible (cuda, {sim})",
        "test_b": f"needs 2 GPUs, 1 visible (cuda, {sim})",
        "test_c": f"needs platform rocm, this machine is cuda ({sim})",
        "test_free": "PASSED",
    }


def test_simulated_rocm_from_the_environment(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_SIMULATE_GPUS", "rocm:2")
    pytester.makepyfile(MARKED_TESTS)
    got = outcomes(pytester)
    assert len(passed(got)) == 7
    reason = got["test_cuda"]
    assert (
        reason
        == "needs platform cuda, this machine is rocm (simulated via environment variable PDSERVE_SIMULATE_GPUS=rocm:2)"
    )


def test_gpu_counts_on_a_cpu_only_machine_skip_tests_without_a_pd_fixture(pytester: pytest.Pytester) -> None:
    # Such tests do their own GPU work (vLLM's test_accuracy_rocm.py): skipped. Platform markers still apply.
    pytester.makepyfile(MARKED_TESTS)
    got = outcomes(pytester, "--pd-platform=cpu")
    assert got["test_two"] == (
        "needs 2 GPUs, this machine has none (platform set to cpu); it uses no pd fixture, so the CPU engine "
        "cannot stand in for them"
    )
    assert got["test_distributed_two"].startswith("needs 2 GPUs, this machine has none")
    assert {"test_plain", "test_distributed_label"} <= passed(got)
    assert got["test_cuda"] == "needs platform cuda, this machine is cpu (platform set to cpu)"


def test_gpu_counts_on_a_cpu_only_machine_run_pd_tests_on_the_cpu_engine(pytester: pytest.Pytester) -> None:
    # Servers run on the CPU there (simulator or vLLM's CPU backend); -rA says why the count was not enforced.
    pytester.makeconftest("import pytest\n\n@pytest.fixture\ndef cluster(pd_cluster_factory):\n    return 1\n")
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.gpus(2)\ndef test_pd(pd_cluster_factory): pass\n\n"
        "@pytest.mark.distributed(num_gpus=4)\ndef test_indirect(cluster): pass\n"
    )
    result = pytester.runpytest("--pd-platform=cpu", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*Captured pdserve setup*",
            "gpus(2) not enforced: this machine is CPU-only (platform set to cpu), so the pd cluster runs on the "
            "CPU engine; --pd-platform=cuda or rocm makes GPU counts apply",
            "*Captured pdserve setup*",
            "distributed(num_gpus=4) not enforced: *",
        ]
    )


def test_markers_are_listed(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.cuda: run only on the CUDA platform*",
            "@pytest.mark.rocm: run only on the ROCm platform*",
            "@pytest.mark.gpus(n): needs at least n GPUs*",
            "@pytest.mark.distributed(num_gpus): run this test only in distributed GPU tests*",
        ],
        consecutive=False,
    )


def test_vllm_style_marker_selection(pytester: pytest.Pytester) -> None:
    # vLLM's CI selects with -m 'distributed(num_gpus=2)'; that must keep working with our registration
    pytester.makepyfile(MARKED_TESTS)
    result = pytester.runpytest("--strict-markers", "-m", "distributed(num_gpus=2)", "--pd-simulate-gpus=2")
    result.assert_outcomes(passed=1, deselected=7)


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        ('gpus("two")', "@pytest.mark.gpus('two'): the GPU count must be a whole number >= 1, got 'two'"),
        ("gpus(0)", "@pytest.mark.gpus(0): the GPU count must be a whole number >= 1, got 0"),
        ("gpus(True)", "got True"),
        ("gpus()", "@pytest.mark.gpus(): takes exactly one GPU count; use @pytest.mark.gpus(2)"),
        ("gpus(1, 2)", "takes exactly one GPU count"),
        ("gpus(count=2)", "@pytest.mark.gpus(count=2): unknown keyword argument count; gpus takes one GPU count, n"),
        ("gpus(2, n=2)", "takes exactly one GPU count"),
        ("distributed(num_gpu=2)", "@pytest.mark.distributed(num_gpu=2): unknown keyword argument num_gpu"),
        ("distributed(2, num_gpus=2)", "takes one GPU count, num_gpus"),
        ("cuda(2)", "@pytest.mark.cuda(2): takes no arguments"),
        ("rocm(arch='gfx942')", "@pytest.mark.rocm(arch='gfx942'): takes no arguments"),
        ("gpus(10**9)", "must be at most 4096"),
        ("distributed(num_gpus=-1)", "@pytest.mark.distributed(num_gpus=-1): num_gpus must be a whole number >= 1"),
        ('distributed(num_gpus="2")', "use @pytest.mark.distributed(num_gpus=2)"),
    ],
)
def test_bad_marker_arguments_are_a_usage_error(pytester: pytest.Pytester, mark: str, message: str) -> None:
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.{mark}\ndef test_bad(): pass\n\ndef test_fine(): pass\n")
    result = pytester.runpytest("--pd-simulate-gpus=4")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "ERROR: pdserve: bad marker arguments:" in err
    assert "test_bad_marker_arguments_are_a_usage_error.py::test_bad: " in err
    assert message in err
    assert "test_fine" not in err
    assert "INTERNALERROR" not in err + result.stdout.str()


# --------------------------------------------------------------------------- reasons for real inventories


def _gpus(n: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(i, f"GPU-{i}", "NVIDIA H200", 143771, str(i)) for i in range(n))


def test_reason_names_the_visibility_variable() -> None:
    inv = Inventory("cuda", _gpus(1), "CUDA_VISIBLE_DEVICES", "nvidia-smi", visibility="CUDA_VISIBLE_DEVICES=3")
    assert skip_reason(Requirement(gpus=2), inv) == "needs 2 GPUs, 1 visible: CUDA_VISIBLE_DEVICES=3"
    assert skip_reason(Requirement(gpus=1), inv) is None


def test_reason_for_a_truncated_visibility_list() -> None:
    note = "CUDA_VISIBLE_DEVICES entry 'GPU-x' matches no GPU UUID; CUDA/HIP ignore it and every entry after it"
    inv = Inventory(
        "cuda", (), "CUDA_VISIBLE_DEVICES", "nvidia-smi", visibility="CUDA_VISIBLE_DEVICES=GPU-x", note=note
    )
    assert skip_reason(Requirement(gpus=1), inv) == f"needs 1 GPU, none visible: CUDA_VISIBLE_DEVICES=GPU-x ({note})"


def test_reason_for_platform_mismatch_on_real_hardware() -> None:
    inv = Inventory("cuda", _gpus(2), None, "nvidia-smi")
    assert skip_reason(Requirement(frozenset({"rocm"})), inv) == (
        "needs platform rocm, this machine is cuda (detected via nvidia-smi)"
    )
    assert skip_reason(Requirement(gpus=4), inv) == "needs 4 GPUs, 2 visible (cuda, detected via nvidia-smi)"
    cpu = Inventory("cpu", (), None, "no nvidia-smi, no /dev/kfd")
    assert skip_reason(Requirement(gpus=2), cpu) is None
    no_gpu = Inventory("cuda", (), None, "nvidia-smi")
    assert skip_reason(Requirement(gpus=2), no_gpu) == "needs 2 GPUs, none visible (cuda, detected via nvidia-smi)"


SHARED_GPU_TESTS = """
import pytest

@pytest.mark.gpus(2)
def test_pd_on_two(pd_cluster_factory): pass

@pytest.mark.distributed(num_gpus=2)
def test_pd_distributed_two(pd_cluster_factory): pass

@pytest.mark.gpus(2)
def test_own_gpu_work_on_two(): pass
"""


@pytest.mark.parametrize("how", ["argv", "env", "ini", "off"])
def test_share_gpus_counts_a_pd_test_as_one_gpu_whatever_its_gpus_mark(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Issue 24: under --pd-share-gpus a P/D test's gpus(2) / distributed(num_gpus=2) is what its cluster needs,
    one GPU (so vLLM's mamba P/D test runs on one H200); a test doing its own GPU work still needs two."""
    pytester.makepyfile(SHARED_GPU_TESTS)
    args = ["-rA", "--pd-simulate-gpus=cuda:1"]
    if how == "argv":
        args.append("--pd-share-gpus")
    elif how == "env":
        monkeypatch.setenv("PDSERVE_SHARE_GPUS", "1")
    elif how == "ini":
        pytester.makeini("[pytest]\npdserve_share_gpus = true\n")
    got = outcomes(pytester, *args)
    sim = "simulated via --pd-simulate-gpus=cuda:1"
    assert got["test_own_gpu_work_on_two"] == f"needs 2 GPUs, 1 visible (cuda, {sim})"
    if how == "off":
        assert got["test_pd_on_two"] == got["test_pd_distributed_two"] == f"needs 2 GPUs, 1 visible (cuda, {sim})"
        return
    assert got["test_pd_on_two"] == got["test_pd_distributed_two"] == "PASSED"
    result = pytester.runpytest(*args)
    result.stdout.fnmatch_lines(["*gpus(2) counted as 1 GPU: --pd-share-gpus runs every server of the test's pd "
                                 "cluster on one GPU (1 visible)*"])  # fmt: skip


@pytest.mark.parametrize("share", [True, False])
def test_the_shared_gpu_rule_as_a_function(share: bool) -> None:
    inv = Inventory("cuda", _gpus(1), None, "nvidia-smi")
    pd = Requirement(gpus=2, uses_cluster=True, shown=("gpus(2)",))
    own = Requirement(gpus=2, uses_cluster=False, shown=("gpus(2)",))
    assert (skip_reason(pd, inv, share_gpus=share) is None) is share
    assert skip_reason(own, inv, share_gpus=share) is not None
