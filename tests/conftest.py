import os

# Tests never reach a hub and never log to W&B servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("SPECDISTILL_LOGGER", "none")  # experiment=smoke: no W&B run (tests/test_plots.py turns it on)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Test models are tiny and latency-bound: one thread avoids fighting other processes for 2 cores.
torch.set_num_threads(1)


def write_generated(run_dir, responses: list[list[int]]) -> None:
    """A generate stage's output as later stages read it: one shard of records with these answers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = run_dir / "generate"
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [f"p-{i:04d}" for i in range(len(responses))], "response_ids": responses})
    pq.write_table(table, out / "shard-r0-00000.parquet")
