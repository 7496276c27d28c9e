"""The ``headrace bench`` commands: engine, parallel, serve and kernels."""
