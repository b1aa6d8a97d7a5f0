"""What and how to cast beyond the table: delayed scaling, activation checkpointing, module filters, checkpoints. Imports f8dist.config and f8dist.core."""
