"""Programs users write, as they write them: the workloads memsafe is judged on."""
