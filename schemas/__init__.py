"""cpplan.schemas: the plan, step and config structs, the codec and the digest (no torch)."""

from cpplan.schemas.arrays import Array
from cpplan.schemas.codec import (
    SCHEMA_VERSION,
    config_fingerprint,
    decode_config,
    decode_plan,
    decode_step,
    digest,
    encode_config,
    encode_config_json,
    encode_plan,
    encode_step,
    encode_step_json,
    plan_payload,
)
from cpplan.schemas.config import ParallelConfig
from cpplan.schemas.errors import (
    CapacityError,
    CollectiveLedgerError,
    ConfigError,
    CpplanError,
    InputFileError,
    OutputError,
    PeerFailedError,
    PlanFormatError,
    PlanMismatchError,
    RankLostError,
    SchemaVersionError,
    StepInputError,
    TensorArgError,
    UsageError,
)
from cpplan.schemas.plan import (
    EAGER,
    MODE_DECODE,
    MODE_NAMES,
    MODE_OWNED,
    MODE_REPLICATED,
    MODE_SPLIT,
    PER_RANK_MODES,
    Collective,
    GatherChunk,
    StepPlan,
)
from cpplan.schemas.sharding import local_index, owner, shard_count, shard_rows
from cpplan.schemas.step import RequestInput, StepInput

__all__ = [name for name in dir() if not name.startswith("_")]
