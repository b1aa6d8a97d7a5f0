"""Each parallelism as a package of its own: FSDP2 (fsdp), tensor and sequence parallelism (tp), expert parallelism (ep), pipeline parallelism (pp). Imports the layers below."""
