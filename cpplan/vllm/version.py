"""The vLLM releases whose partition and DSA builders ``cpplan.vllm`` reproduces.

``adapter.local_batch`` and ``adapter.dsa_metadata`` restate rules that live in vLLM's own code
(``PCPManager.partition_batch``, the DSA indexer's and FlashMLA-sparse's builders); another
release may change them without notice, so a caller checks the installed version first and
gets one typed line, never a silent mismatch. Only :func:`check_vllm_version` imports vLLM,
and only when it is not handed a version string.
"""

from __future__ import annotations

import re

from cpplan.schemas.errors import CpplanError

# (major, minor) release series whose rules the adapter states; 0.32.x is the series of
# PCPManager with shard_decode_requests and the PCP+DCP sparse-MLA builders
SUPPORTED = ((0, 32),)
SUPPORTED_NAMES = tuple(f"{major}.{minor}.x" for major, minor in SUPPORTED)
# a final or post release of a series, with an optional local label: 0.32.0, 0.32.1.post1,
# 0.32.0+cpu; pre-releases (rc, dev, a, b) predate the series' rules and are refused
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(\.post\d+)?(\+[0-9A-Za-z.]+)?$")


class VllmVersionError(CpplanError, RuntimeError):
    """The installed vLLM is not a release whose rules cpplan.vllm states (or is missing)."""


def check_vllm_version(version: str | None = None) -> str:
    """The vLLM version (``version``, else the installed ``vllm.__version__``) if it is a
    supported release (:data:`SUPPORTED_NAMES`); VllmVersionError otherwise, one line naming
    the version got and the releases expected."""
    expected = " or ".join(SUPPORTED_NAMES)
    if version is None:
        try:
            from vllm import __version__ as version  # lazy: importing vLLM costs seconds
        except ImportError as err:
            raise VllmVersionError(f"vLLM is not importable ({err}): cpplan.vllm expects vLLM "
                                   f"{expected}") from None
    if not isinstance(version, str):
        raise VllmVersionError(f"vLLM version must be a str: got {type(version).__name__} "
                               f"{version!r}")
    match = _RELEASE.match(version)
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED:
        raise VllmVersionError(f"vLLM {version} is not supported by cpplan.vllm: expected "
                               f"{expected} (the release whose PCPManager.partition_batch and "
                               f"DSA builders it reproduces)")
    return version
