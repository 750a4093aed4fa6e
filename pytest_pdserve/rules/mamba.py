"""Hybrid (Mamba) models: the ``--mamba-cache-mode`` values each vLLM takes and the mode it then runs, and the
prefill vLLM for CPU's Mamba kernel dies on. [stdlib]

**The flag** (:data:`MODES`, :func:`check_mode`, :func:`running_mode`), read in vLLM's source:

* 0.26: ``MambaCacheMode = Literal["all", "align", "none"]`` (``config/cache.py:38``). With prefix caching,
  ``MambaModelConfig.verify_and_update_config`` (``model_executor/models/config.py:558``) turns ``none`` into
  ``all`` for a model that supports Mamba prefix caching (NemotronH does) and ``all`` into ``align`` for one that
  does not; without prefix caching the mode is what was asked. Its ``run_mamba_prefix_cache_test.sh`` passes
  ``--mamba-cache-mode all``.
* 0.32: ``Literal["align", "none"]`` (``config/cache.py:63``): ``all`` fails argparse (exit 2). With prefix caching
  ``none`` becomes ``align``; without it any mode becomes ``none`` (``models/config.py:685``). Its script passes
  ``align``.
* 0.33 and 0.34: the same two choices, and the flag is a deprecated no-op (``engine/arg_utils.py:462``
  ``_MAMBA_CACHE_MODE_DEPRECATION_MESSAGE``, warned at :2304 in 0.33 and :2337 in 0.34; ``CacheConfig`` is built
  without it): the mode is ``align`` with prefix caching and ``none`` without (``models/config.py:763`` in 0.33,
  :1094 in 0.34). Their scripts pass no ``--mamba-cache-mode``.

So in every version checked, a cluster that passes no ``--mamba-cache-mode`` runs what the version's own script
asks for (0.26: ``all`` on NemotronH; 0.32 on: ``align``): ``ClusterSpec.hybrid_ssm()`` passes none.

**vLLM for CPU's Mamba prefill** (:func:`cpu_prefill_dies`): in ``align`` mode a prefill that crosses a Mamba block
boundary saves a checkpoint there (``model_executor/layers/mamba/checkpoint.py:21``
``compute_mamba_prefill_checkpoints``; ``v1/kv_cache_interface.py:1125`` ``is_mamba_prefill_checkpoint_valid``),
which needs the kernel's per-chunk states; the CPU kernel ignores ``return_intermediate_states`` and returns one
state per sequence (``model_executor/layers/mamba/ops/cpu/mamba_ssm.py:22``), so
``varlen_states[last_chunk_indices_p]`` (``mamba_mixer2.py:880`` in 0.32, :894 in 0.33, :895 in 0.34) raises
``IndexError: index N is out of bounds for dimension 0 with size 1`` and the engine dies (HTTP 500, then the server
exits). A checkpoint is valid when the prefill computes more than one Mamba block (``mamba_block_size`` is the
block size with prefix caching, ``models/config.py:700``) from a block-aligned start: a fresh prompt of more than
``block_size`` tokens. 0.26 had no CPU Mamba kernel (not modelled).
"""

from __future__ import annotations

from pytest_pdserve.rules.verdict import Refusal, Replacement
from pytest_pdserve.rules.versions import VersionTable, release, shown

__all__ = [
    "CPU_KERNEL_DROPS_CHECKPOINTS",
    "MODES",
    "check_mode",
    "checkpoint_in_prefill",
    "deprecation_warning",
    "cpu_prefill_dies",
    "cpu_prefill_error",
    "flag_ignored",
    "running_mode",
]

#: ``--mamba-cache-mode``'s argparse choices.
MODES: VersionTable[tuple[str, ...]] = VersionTable.of(
    [("0.26", ("all", "align", "none")), ("0.32", ("align", "none"))]
)
#: Whether the flag is a deprecated no-op (the mode follows ``--enable-prefix-caching``).
FLAG_IGNORED: VersionTable[bool] = VersionTable.of([("0.26", False), ("0.33", True)])
#: Whether vLLM's CPU Mamba kernel drops the per-chunk states a prefill checkpoint needs (0.26 had no CPU kernel).
CPU_KERNEL_DROPS_CHECKPOINTS: VersionTable[bool] = VersionTable.of([("0.32", True)])

RULE_MODE = "mamba-cache-mode"
RULE_CPU = "cpu-mamba-prefill"
SOURCE_MODE = "config/cache.py:63 (MambaCacheMode), model_executor/models/config.py:685 (MambaModelConfig)"
SOURCE_IGNORED = "engine/arg_utils.py:462 (_MAMBA_CACHE_MODE_DEPRECATION_MESSAGE, vLLM 0.33)"
SOURCE_CPU = (
    "model_executor/layers/mamba/ops/cpu/mamba_ssm.py:22 (return_intermediate_states ignored), "
    "model_executor/layers/mamba/mamba_mixer2.py:880 (varlen_states[last_chunk_indices_p]), "
    "v1/kv_cache_interface.py:1125 (is_mamba_prefill_checkpoint_valid)"
)
DEPRECATION = (
    "--mamba-cache-mode is deprecated and will be removed in v{next}. It has no effect: Mamba prefix caching follows "
    "--enable-prefix-caching."
)


def deprecation_warning(version: object) -> str:
    """``--mamba-cache-mode``'s deprecation warning as vLLM ``version`` (0.33 on) logs it: it names the release it
    runs in as the one that removes the flag (``engine/arg_utils.py`` ``_MAMBA_CACHE_MODE_DEPRECATION_MESSAGE``:
    "v0.33.0" in 0.33, "v0.34.0" in 0.34)."""
    major, minor, _ = release(version)
    return DEPRECATION.format(next=f"{major}.{max(minor, 33)}.0")


def flag_ignored(version: object) -> bool:
    """Whether ``version`` ignores ``--mamba-cache-mode`` (0.33 on)."""
    return bool(FLAG_IGNORED.at(version))


def check_mode(asked: str | None, version: object) -> Refusal | None:
    """vLLM's argparse refusal of ``--mamba-cache-mode asked`` (None: taken, or not given)."""
    choices = MODES.at(version)
    if asked is None or choices is None or asked in choices:
        return None
    listed = ", ".join(repr(c) for c in choices)
    message = f"argument --mamba-cache-mode: invalid choice: {asked!r} (choose from {listed})"
    return Refusal(RULE_MODE, "argparse", message, "argparse", SOURCE_MODE)


def running_mode(asked: str | None, *, prefix_caching: bool, version: object, supports_all: bool = True) -> str:
    """The Mamba cache mode vLLM ``version`` runs for ``--mamba-cache-mode asked`` (None: not given).

    :param supports_all: the model supports Mamba prefix caching (0.26's ``all``); NemotronH does.
    """
    choices = MODES.at(version) or ()
    if "all" not in choices or flag_ignored(version):  # 0.32 on (and versions below the table): prefix caching decides
        return "align" if prefix_caching else "none"
    if not prefix_caching:
        return "none"
    if asked == "align":
        return "align"
    return "all" if supports_all else "align"


def replacement(asked: str | None, *, prefix_caching: bool, version: object) -> Replacement | None:
    """What vLLM runs instead of an asked mode, when it differs (a no-op flag, or prefix caching deciding)."""
    if asked is None or check_mode(asked, version) is not None:
        return None
    runs = running_mode(asked, prefix_caching=prefix_caching, version=version)
    if runs == asked:
        return None
    if flag_ignored(version):
        why = f"vLLM {shown(version)} ignores --mamba-cache-mode: the mode follows --enable-prefix-caching"
        return Replacement(RULE_MODE, "--mamba-cache-mode", asked, runs, why, SOURCE_IGNORED)
    pc = "on" if prefix_caching else "off"
    why = f"vLLM {shown(version)} sets the mode from prefix caching ({pc})"
    return Replacement(RULE_MODE, "--mamba-cache-mode", asked, runs, why, SOURCE_MODE)


def checkpoint_in_prefill(query_start: int, query_end: int, block_size: int) -> bool:
    """Whether a prefill computing tokens ``query_start..query_end`` (``query_start`` block-aligned: a prefix hit
    ends on a block) saves an ``align``-mode Mamba checkpoint: it crosses into a second Mamba block.

    ``is_mamba_prefill_checkpoint_valid`` with the checkpoint at the last block boundary before ``query_end``
    (``get_mamba_prefill_checkpoint_position``: one token left to recompute) and alignment 1 (Mamba2).
    """
    return query_end - query_start > block_size


def cpu_prefill_dies(
    *, version: object, platform: str, hybrid: bool, mode: str, query_start: int, query_end: int, block_size: int
) -> bool:
    """Whether vLLM for CPU's engine dies computing this prefill (the module docstring has the rule)."""
    return (
        platform == "cpu"
        and hybrid
        and mode == "align"
        and bool(CPU_KERNEL_DROPS_CHECKPOINTS.at(version))
        and checkpoint_in_prefill(query_start, query_end, block_size)
    )


def cpu_prefill_error(query_start: int, query_end: int, chunk_size: int) -> str:
    """The ``IndexError`` vLLM for CPU dies with: the prefill's last chunk index into a one-state tensor."""
    chunks = -(-(query_end - query_start) // chunk_size)
    return f"index {chunks - 1} is out of bounds for dimension 0 with size 1"
