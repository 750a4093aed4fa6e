"""The README's promises that code can check: the options table, the Quickstart commands, and that every command,
flag, environment variable and repository path it names is real."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_pdserve.config._options_table import BEGIN, END, render
from pytest_pdserve.config.setting_table import SETTINGS
from pytest_pdserve.running.process import MAX_POLL_INTERVAL_S, POLL_INTERVAL_S, poll_interval

README = Path(__file__).resolve().parents[2] / "README.md"


def test_options_table_is_generated_from_the_settings() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render(), (
        "README options table is stale: run python -m pytest_pdserve.config._options_table"
    )


def test_every_setting_is_in_the_table() -> None:
    table = render()
    for s in SETTINGS:
        assert f"`{s.flag}`" in table
        assert f"`{s.env_var}`" in table
        assert f"`{s.ini_key}`" in table


def test_quickstart_commands_exist() -> None:
    text = README.read_text()
    quickstart = text[text.index("## Quickstart") :]
    quickstart = quickstart[: quickstart.index("\n## ", 5)]
    assert "pytest examples --pd-engine=sim" in quickstart
    assert "bash .ci/run" in quickstart
    ci = (README.parent / ".ci" / "run").read_text()
    assert ".venv/bin/python -m pytest -p no:cacheprovider" in ci


def test_readme_example_test_passes_on_the_simulator(pytester: pytest.Pytester, tmp_path: Path) -> None:
    text = README.read_text()
    section = text[text.index("## A test, as a vLLM author writes it") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    pytester.makepyfile(test_pd=code)
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={tmp_path / 'leases'}", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)


# ------------------------------------------------------------------------------ every README command is real

REPO = README.parent
#: Placeholders the README uses on purpose (`set --pd-x / PDSERVE_X / pdserve_x` stands for any setting).
PLACEHOLDERS = {"--pd-x", "PDSERVE_X"}
#: Paths the README names that are not in this repository, and why.
NOT_HERE = {
    "benchmarks/results/": "written by benchmarks/run_all.py",
    "tests/v1/": "vLLM's own tree (nixl_integration), not this repository's tests/",
    "tests/conftest.py": "vLLM's tests/conftest.py (the --confcutdir rule)",
}
#: Files the README's commands use that the reader creates: the README's own example test.
READER_FILES = {"test_pd.py": "the test under 'A test, as a vLLM author writes it'"}


def _bash_commands() -> list[list[str]]:
    """Every command of the README's ```bash blocks, split into words, without comments and VAR=value prefixes."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)\n```", text, re.S):
        for line in block.splitlines():
            command: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word != "&&":
                    command.append(word)
                    continue
                while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                    command.pop(0)
                if command:
                    commands.append(command)
                command = []
    return commands


def _pytest_options(pytester: pytest.Pytester) -> set[str]:
    result = pytester.runpytest_subprocess("--help")
    assert result.ret == 0
    return set(re.findall(r"--(?:no-)?pd-[a-z0-9-]+", result.stdout.str()))


def test_every_pdserve_flag_the_readme_names_is_an_option(pytester: pytest.Pytester) -> None:
    options = _pytest_options(pytester)
    named = set(re.findall(r"--(?:no-)?pd-[a-z0-9-]+", README.read_text())) - PLACEHOLDERS
    assert named, "the README names no --pd- flag"
    assert not named - options, f"README names flags pytest --help does not list: {sorted(named - options)}"


def test_every_pdserve_env_var_the_readme_names_is_read_by_the_code() -> None:
    source = "\n".join(p.read_text() for p in (REPO / "pytest_pdserve").rglob("*.py"))
    named = set(re.findall(r"\bPDSERVE_[A-Z0-9_]*[A-Z0-9]\b", README.read_text())) - PLACEHOLDERS
    env_vars = {s.env_var for s in SETTINGS}
    unknown = sorted(n for n in named if n not in env_vars and n not in source)
    assert not unknown, f"README names environment variables no code reads: {unknown}"


def test_every_repository_path_the_readme_names_exists() -> None:
    pattern = (
        r"(?<![\w/.-])((?:\.ci|benchmarks|constraints|docs|examples|plugins|pytest_pdserve|scripts|tests)/[\w./-]*)"
    )
    missing = []
    for path in sorted(set(re.findall(pattern, README.read_text()))):
        path = path.rstrip(".")
        if any(path.startswith(prefix) for prefix in NOT_HERE):
            continue
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"README names paths this repository lacks: {missing}"


#: pytest options whose value is the next word (`-m "not vllm"`, `-k name`, `-p plugin`, `-n 2`, `--dist loadfile`).
PYTEST_VALUE_FLAGS = frozenset({"-m", "-k", "-p", "-n", "-o", "-c", "--rootdir", "--basetemp", "--dist"})


def test_every_readme_command_is_real(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Each command of the README's shell blocks runs something that exists: scripts and files are there, pytest's
    paths exist and its options are registered, `pdserve` accepts the arguments, `tox -e` envs are defined."""
    from pytest_pdserve import cli
    from pytest_pdserve.glue.markers import MARKERS

    options = _pytest_options(pytester)
    # The markers this repository registers (pyproject's tiers) and the plugin's own (cuda, rocm, gpus, ...).
    ini = (REPO / "pyproject.toml").read_text().split("markers = [", 1)[1].split("]", 1)[0]
    markers = set(re.findall(r'^\s*"(\w+)', ini, re.M)) | {line.split("(")[0].split(":")[0] for line in MARKERS}
    assert {"vllm", "gpu", "cuda"} <= markers, sorted(markers)
    tox = (REPO / "tox.ini").read_text()
    tox_envs = set(re.findall(r"^\[testenv:([\w-]+)\]", tox, re.M)) | {"py310", "py311", "py312", "py313"}
    problems = []
    commands = _bash_commands()
    assert len(commands) >= 10, commands
    for command in commands:
        where = shlex.join(command)
        program, args = command[0], command[1:]
        if program in (".venv/bin/python", "python3") and args[:2] == ["-m", "pytest"]:
            program, args = "pytest", args[2:]
        if program == "pytest":
            for i, arg in enumerate(args):
                flag = arg.split("=", 1)[0]
                if i and args[i - 1] in PYTEST_VALUE_FLAGS:
                    if args[i - 1] == "-m":  # a marker expression: every name in it is a registered marker
                        names = set(re.findall(r"[A-Za-z_]\w*", arg)) - {"and", "or", "not"}
                        problems += [f"{where}: -m names {n}, no registered marker" for n in sorted(names - markers)]
                    continue
                if flag.startswith(("--pd-", "--no-pd-")) and flag not in options:
                    problems.append(f"{where}: {flag} is not an option")
                elif not arg.startswith("-") and arg not in READER_FILES and not (REPO / arg).exists():
                    problems.append(f"{where}: {arg} does not exist")
        elif program in ("bash", ".venv/bin/python"):
            if args[:2] == ["-m", "venv"] or args[:1] == ["-m"] and args[1:2] == ["pip"]:
                continue
            if not (REPO / args[0]).is_file():
                problems.append(f"{where}: {args[0]} does not exist")
        elif program == "python3" and args[:2] == ["-m", "venv"]:
            continue
        elif program == ".venv/bin/pip" and args[:1] == ["install"]:
            for arg in args[1:]:
                if not arg.startswith("-") and not (REPO / arg.split("[", 1)[0]).exists():
                    problems.append(f"{where}: {arg} does not exist")
        elif program == "pdserve":
            try:  # a reuse dir that does not exist: parsed and answered, nothing touched
                cli.main(["--dir", str(tmp_path / "no-reuse-dir"), *args])
            except SystemExit as exc:  # argparse's usage error
                problems.append(f"{where}: pdserve refused its arguments (exit {exc.code})")
        elif program == "tox":
            env = args[args.index("-e") + 1] if "-e" in args else None
            if env is not None and env not in tox_envs:
                problems.append(f"{where}: tox has no env {env}")
        elif program == "pre-commit":
            if args != ["install"] or not (REPO / ".pre-commit-config.yaml").is_file():
                problems.append(f"{where}: not `pre-commit install` with a .pre-commit-config.yaml")
        else:
            problems.append(f"{where}: {program} is a command this test does not know how to check: teach it")
    assert not problems, "\n".join(problems)


def test_readme_limit_of_prompt_with_tokens_holds_on_the_simulator(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """The README says `prompt_with_tokens(cluster, 5000)` raises ValueError on the simulator's max_model_len 2048."""
    text = " ".join(README.read_text().split())
    said = "`5000 tokens do not fit http://127.0.0.1:PORT: its max_model_len is 2048`"
    assert "`prompt_with_tokens(cluster, 5000)`" in text
    assert said in text
    pytester.makepyfile(
        test_limit="""
import pytest
from pytest_pdserve.prompts import prompt_with_tokens

def test_limit(pd_cluster):
    with pytest.raises(ValueError, match=r"^5000 tokens do not fit http://127.0.0.1:\\d+: its max_model_len is 2048$"):
        prompt_with_tokens(pd_cluster, 5000)
    assert len(prompt_with_tokens(pd_cluster, 2048)) > 0  # the limit itself fits
"""
    )
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={tmp_path / 'leases'}", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)


def test_readme_poll_interval_is_the_codes() -> None:
    """README's "polled every 5 ms at first ... at most every 50 ms" is the readiness poll's own bounds."""
    text = " ".join(README.read_text().split())
    claim = re.search(r"polled every (\d+) ms at first, less often as the wait grows \(at most every (\d+) ms\)", text)
    assert claim, "README no longer says how often a starting server is polled (Lifecycle guarantees)"
    first, most = (int(n) / 1000 for n in claim.groups())
    assert (first, most) == (POLL_INTERVAL_S, MAX_POLL_INTERVAL_S)
    assert poll_interval(0.0) == first
    assert poll_interval(3600.0) == most


#: How far a README tier count may drift from what pytest collects before the sentence must change: "about N" is a
#: claim about the order of the suite, not a figure to bump with every test (the lead fixes the counts at merges).
TIER_COUNT_TOLERANCE = 0.15
_COUNT_PLUGIN = """
import json, os

def pytest_collection_finish(session):
    marks = [{m.name for m in item.iter_markers()} for item in session.items]
    counts = {
        "unit": sum("unit" in m for m in marks),
        "simulator": sum("vllm" not in m for m in marks),
        "vllm": sum("vllm" in m for m in marks),
    }
    with open(os.environ["PDSERVE_TIER_COUNTS"], "w") as fh:
        json.dump(counts, fh)
"""


def _readme_tier_counts() -> dict[str, int]:
    block = README.read_text().split("## Development", 1)[1]
    found = {
        "unit": re.search(r"the unit tier: (?:about )?([\d,]+) tests", block),
        "simulator": re.search(r"the simulator tier: (?:about )?([\d,]+) tests", block),
        "vllm": re.search(r"the real-vLLM tier: (?:about )?([\d,]+) tests", block),
    }
    missing = sorted(tier for tier, m in found.items() if m is None)
    assert not missing, f'README\'s "Development" block no longer counts the tiers {missing}'
    return {tier: int(m.group(1).replace(",", "")) for tier, m in found.items() if m is not None}


@pytest.mark.timeout(1200)  # a whole --collect-only of tests/: 6 s of CPU, minutes of wall time on a loaded machine
def test_readme_tier_counts_match_the_collection(tmp_path: Path) -> None:
    """The three tier counts in README's "Development" block, against what pytest collects of tests/ now."""
    claimed = _readme_tier_counts()
    (tmp_path / "pdserve_tier_counts.py").write_text(_COUNT_PLUGIN)
    out = tmp_path / "counts.json"
    env = {**os.environ, "PDSERVE_TIER_COUNTS": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "pdserve_tier_counts",
         "tests"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1100,
    )  # fmt: skip
    assert out.exists(), result.stdout[-2000:] + result.stderr[-2000:]
    collected: dict[str, int] = json.loads(out.read_text())
    off = {
        tier: (claimed[tier], collected[tier])
        for tier in claimed
        if abs(collected[tier] - claimed[tier]) > TIER_COUNT_TOLERANCE * collected[tier]
    }
    assert not off, f"README's tier counts (claimed, collected) drifted past {TIER_COUNT_TOLERANCE:.0%}: {off}"
