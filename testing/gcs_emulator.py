"""The GCS emulator harness of the tests: :mod:`bench.harness.gcs_emulator` (shipped with
``bench``, whose gcs group starts the emulator from an installed wheel too)."""

from __future__ import annotations

from bench.harness.gcs_emulator import (
    BINARY_ENV,
    EMULATOR_HOST_ENV,
    READY_TIMEOUT_S,
    ZB_HNS_ENV,
    Emulator,
    EmulatorNotFoundError,
    EmulatorStartError,
    check_gcsfs_import_state,
    create_bucket,
    emulator_env,
    emulator_in_environ,
    find_binary,
    gcs_filesystem,
    start_emulator,
)

__all__ = [
    "BINARY_ENV",
    "EMULATOR_HOST_ENV",
    "READY_TIMEOUT_S",
    "ZB_HNS_ENV",
    "Emulator",
    "EmulatorNotFoundError",
    "EmulatorStartError",
    "check_gcsfs_import_state",
    "create_bucket",
    "emulator_env",
    "emulator_in_environ",
    "find_binary",
    "gcs_filesystem",
    "start_emulator",
]
