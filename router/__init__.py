"""The router: priority scheduling across workers. Imports no torch."""
