"""Data: jsonl/parquet readers, chat templates and loss masks, batching, and the synthetic math data set."""
