"""The recorder: each vLLM step's global batch as a cpplan step file, named with its plan's digest.

A record folder holds, written by one rank (PCP, DCP, TP and PP rank 0 of its data-parallel
rank; the plugin chooses it)::

    config.json                    the cpplan config the plugin compiled the steps with
    replay-config.json             the same topology with cpplan's small simulation model
    step-000000-<digest>.msgpack   step 0's StepInput (cpplan's step file), <digest> the
    step-000001-<digest>.msgpack   32 hex digits of its plan's digest under config.json
    ...

so ``cpplan inspect step-....msgpack --config config.json`` shows the plan vLLM ran (its digest
the one in the name), ``cpplan diff A B --config config.json`` compares two steps, and
``cpplan plan STEP --config replay-config.json -o plan.msgpack`` makes a plan that
``cpplan replay`` runs on the CPU (docs/vllm.md). Every file is written whole or not at all
(schemas/files.py: a temp file in the folder, then a rename); a failed write raises
:class:`OutputError`, one line naming the file, and leaves nothing behind.
"""

from __future__ import annotations

import os

import msgspec

from cpplan.schemas.codec import encode_config_json, encode_step
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import OutputError
from cpplan.schemas.files import write_atomic
from cpplan.schemas.step import StepInput

CONFIG_NAME = "config.json"
REPLAY_CONFIG_NAME = "replay-config.json"
# cpplan simulate's small model (cpplan/sim/simulate.py PRESET, two layers), which replay runs
REPLAY_MODEL = dict(num_layers=2, num_heads=8, topk=64, index_num_heads=4, index_head_dim=128,
                    qk_head_dim=576, v_head_dim=512, activation_dtype="float32",
                    indexer_sources=())


def step_file_name(step_id: int, digest: bytes) -> str:
    return f"step-{step_id:06d}-{digest.hex()}.msgpack"


def replay_config(config: ParallelConfig) -> ParallelConfig:
    """``config``'s topology, batch rules and formats with the simulation model's dimensions
    (hidden_size = layers x heads x 512, as ``cpplan replay`` requires)."""
    dims = dict(REPLAY_MODEL)
    dims["hidden_size"] = dims["num_layers"] * dims["num_heads"] * dims["v_head_dim"]
    return msgspec.structs.replace(config, **dims)


class Recorder:
    """Writes one folder of steps for one config (both config files at the first step)."""

    def __init__(self, folder: str | os.PathLike, config: ParallelConfig) -> None:
        self.folder, self.config = os.fspath(folder), config
        self._configs_written = False

    def _write_configs(self) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot write the record folder {self.folder}: "
                              f"{exc.strerror or exc}") from None
        write_atomic(os.path.join(self.folder, CONFIG_NAME), encode_config_json(self.config))
        write_atomic(os.path.join(self.folder, REPLAY_CONFIG_NAME),
                     encode_config_json(replay_config(self.config)))
        self._configs_written = True

    def write(self, step: StepInput, digest: bytes) -> str:
        """Write ``step`` (its plan's ``digest`` in the name); returns the file's path."""
        if not self._configs_written:
            self._write_configs()
        path = os.path.join(self.folder, step_file_name(step.step_id, digest))
        write_atomic(path, encode_step(step))
        return path
