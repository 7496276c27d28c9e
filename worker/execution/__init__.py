"""Execution: a scheduled step becomes one flattened batch and one forward pass, on one rank
or across a tensor/pipeline-parallel worker's ranks."""
