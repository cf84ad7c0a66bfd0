"""validation.json's contract: its schema version, a check's verdicts and the tolerances each
compared figure is held to. The validation job writes them (distlab.jobs.validate), its ranks
and each task's checks decide with them, the report shows them."""
from __future__ import annotations

VALIDATION_SCHEMA_VERSION = 1
PASSED, FAILED, UNSUPPORTED = "passed", "failed", "unsupported"
# Every compared forward runs streamed on the CPU in fp32 (distlab.runtime.streamed), whatever the
# training device and precision: the same code on the same weights agrees to float rounding.
RELOAD_TOLERANCE = 1e-5
# Merging LoRA into the base weights changes float rounding, not the function.
MERGE_TOLERANCE = 1e-4
# Resume parity compares training trajectories: bit-exact is expected for fp32 on one machine;
# autocast precisions get room for reduced-precision kernels that are not bit-reproducible.
PARITY_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}
