"""`python -m worker --queues cpu --slots 1`: the same as `trainq worker`."""

from worker.cli import main

main()
