"""What the benchmarks run besides our code, shipped so that ``python -m bench`` works from
an installed wheel: ``local_cluster`` (real torchrun agents on one machine),
``gcs_emulator`` (fake-gcs-server) and ``s3_server`` (moto in server mode), both from the
``bench`` extra and run as a ``server_process``, and ``ports``. The test suite imports
them through ``testing/``."""
