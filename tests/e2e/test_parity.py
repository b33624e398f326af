"""`scaletrain parity` over mixed layouts, up to 8 processes: every layout's fp32 losses and gradient norms equal
the single-process run's within rtol 1e-5 over the same steps (the harness users run, run by CI)."""

from tests.helpers import DEBUG, run_cli

MIXED = [
    "pp=2,dp_shard=2,tp=2,data_parallel=fsdp",  # 8 processes
    "dp_shard=2,cp=2",  # ddp over dp x cp
    "tp=2,cp=2,data_parallel=fsdp",
    "dp_replicate=2,dp_shard=2,data_parallel=hsdp",
    "dp_shard=2,tp=2,data_parallel=zero2,sequence_parallel=true",
    "pp=2,pp_schedule=interleaved_1f1b,dp_shard=2,data_parallel=fsdp",
]


def test_mixed_layouts_match_the_single_process_run():
    proc = run_cli(
        "parity",
        "--config",
        DEBUG,
        "--steps",
        "4",
        "--layouts",
        *MIXED,
        "--training.micro_batch",
        "2",
        "--checkpoint.enabled",
        "false",
        timeout=900,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if "nproc" in line]
    assert len(lines) == len(MIXED), proc.stdout + proc.stderr
    assert all(line.rstrip().endswith("OK (rtol 1e-05)") for line in lines), proc.stdout
    assert proc.returncode == 0
